"""MultiConnector(Example, Example) in the engine: both children store identical trees; the first
child with an entry loads (every child is told about the blocks); the second takes over when the
first child's directory is gone. Children log what they do (LoggingExampleConnector), and
every connector's recorded call trace passes the trace checker."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from connector_fakes import assert_identical_trees, read_log

from kvport import LLM, SamplingParams
from kvport.connectors.example import num_aligned_tokens
from kvport.trace.checker import check_file

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 4
PROMPT = [(i * 53 + 5) % 250 + 3 for i in range(30)]
ALIGNED = num_aligned_tokens(len(PROMPT), BLOCK_SIZE)  # 28


def child(tmp_path: Path, name: str) -> dict[str, object]:
    return {"kv_connector": "LoggingExampleConnector",
            "kv_connector_module_path": "connector_fakes",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / f"storage_{name}"),
                                          "log_dir": str(tmp_path / f"log_{name}"),
                                          "record_trace": str(tmp_path / f"trace_{name}.jsonl")}}


def last_alloc(tmp_path: Path, name: str) -> tuple[int, int]:
    """(num_blocks, num_external_tokens) of the child's last update_state_after_alloc."""
    lines = [line for line in read_log(str(tmp_path / f"log_{name}"), "scheduler")
             if line.startswith("alloc ")]
    _, _, num_blocks, num_external = lines[-1].split()
    return int(num_blocks), int(num_external)


def worker_actions(tmp_path: Path, name: str) -> list[str]:
    """The child's loads and stores, without request ids."""
    lines = read_log(str(tmp_path / f"log_{name}"), "worker")
    return [" ".join(line.split()[::2]) for line in lines]


@pytest.mark.parametrize("worker", ["inproc", "process"])
def test_two_example_children(tmp_path: Path, worker: str) -> None:
    llm = LLM("builtin:tiny-llama", block_size=BLOCK_SIZE, worker=worker, kv_transfer_config={
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [child(tmp_path, "1"), child(tmp_path, "2")],
                                      "record_trace": str(tmp_path / "trace_multi.jsonl")}})

    def generate() -> tuple[list[int], int]:
        (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
        llm.engine.check_no_leaks()
        return out.outputs[0].token_ids, out.num_cached_tokens

    # First run: computed, then stored by both children; identical trees.
    expected, cached = generate()
    assert cached == 0
    assert_identical_trees(tmp_path / "storage_1", tmp_path / "storage_2")
    assert worker_actions(tmp_path, "1") == worker_actions(tmp_path, "2") == [f"store {ALIGNED}"]

    # Second run, engine prefix cache dropped: the first child loads, the second is told about
    # the same blocks with 0 external tokens.
    llm.reset_prefix_cache()
    assert generate() == (expected, ALIGNED)
    num_blocks, num_external = last_alloc(tmp_path, "1")
    assert num_external == ALIGNED and num_blocks > 0
    assert last_alloc(tmp_path, "2") == (num_blocks, 0)
    assert worker_actions(tmp_path, "1")[-1] == f"load {ALIGNED}"
    assert worker_actions(tmp_path, "2") == [f"store {ALIGNED}"]  # nothing new

    # Third run without the first child's directory: the second child loads; the first child,
    # which no longer has the entry, stores it again from the loaded blocks.
    shutil.rmtree(tmp_path / "storage_1")
    llm.reset_prefix_cache()
    assert generate() == (expected, ALIGNED)
    assert last_alloc(tmp_path, "1") == (num_blocks, 0)
    assert last_alloc(tmp_path, "2") == (num_blocks, ALIGNED)
    assert worker_actions(tmp_path, "2")[-1] == f"load {ALIGNED}"
    assert worker_actions(tmp_path, "1")[-1] == f"store {ALIGNED}"
    assert_identical_trees(tmp_path / "storage_1", tmp_path / "storage_2")
    llm.shutdown()
    # The MultiConnector and each child, seen from outside, keep the connector contract.
    for name in ("multi", "1", "2"):
        assert check_file(str(tmp_path / f"trace_{name}.jsonl")) == [], name
