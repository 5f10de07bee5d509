"""ExampleConnector in the engine: output with loads equals output without any connector (greedy),
on the plain path, with chunked prefill, partial local hits, preemption, async scheduling and a
failed load."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvport import LLM, SamplingParams
from kvport.connectors.example import num_aligned_tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 4


def prompts() -> list[list[int]]:
    # Several lengths; two share a 24-token prefix; the 3-token one has no full aligned block.
    base = [(i * 41 + 7) % 250 + 3 for i in range(60)]
    return [base[:45], base[:24] + [9, 8, 7, 6, 5, 4, 3, 2, 1], base[5:38], base[:3]]


def example_llm(root: Path, **kwargs: object) -> LLM:
    return LLM("builtin:tiny-llama", block_size=BLOCK_SIZE, kv_transfer_config={
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(root)}}, **kwargs)


def run(llm: LLM, ps: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    llm.engine.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("builtin:tiny-llama", block_size=BLOCK_SIZE, enable_prefix_caching=False)
    return run(llm, prompts())[0]


MODES = {
    "sync": {},
    "async": {"async_scheduling": True},
    "process": {"worker": "process"},
    "process-async": {"worker": "process", "async_scheduling": True},
}


@pytest.mark.parametrize("mode", MODES)
def test_loaded_prompts_give_the_output_of_no_connector(
    tmp_path: Path, reference: list[list[int]], mode: str,
) -> None:
    llm = example_llm(tmp_path, **MODES[mode])
    tokens, cached = run(llm, prompts())
    assert tokens == reference
    assert len(os.listdir(tmp_path)) == 3  # one entry per prompt with an aligned block
    llm.reset_prefix_cache()
    tokens, cached = run(llm, prompts())  # every aligned prefix now comes from disk
    assert tokens == reference
    assert cached == [num_aligned_tokens(len(p), BLOCK_SIZE) for p in prompts()]
    assert len(os.listdir(tmp_path)) == 3  # nothing stored twice
    llm.shutdown()


@pytest.mark.parametrize("mode", ["sync", "process"])
def test_failed_load_recomputes_and_gives_the_same_output(
    tmp_path: Path, reference: list[list[int]], caplog: pytest.LogCaptureFixture, mode: str,
) -> None:
    llm = example_llm(tmp_path, **MODES[mode])
    assert run(llm, prompts()[:1])[0] == reference[:1]
    (entry,) = os.listdir(tmp_path)
    (tmp_path / entry / "layers.2.safetensors").write_bytes(b"not a safetensors file")
    llm.reset_prefix_cache()
    with caplog.at_level(logging.WARNING, logger="kvport.connectors.example"):
        tokens, _ = run(llm, prompts()[:1])  # a hit is reported, its load fails, it is recomputed
    assert tokens == reference[:1]
    assert llm.engine.scheduler.xfer.stats.num_invalid_blocks > 0
    if mode == "sync":  # the worker (and its log) is in this process
        assert any("loading entry" in r.getMessage() for r in caplog.records)
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_partial_local_hits_and_preemption(
    tmp_path: Path, reference: list[list[int]], async_scheduling: bool,
) -> None:
    # A 16-token budget splits every prompt into chunks (stores land in the last chunk's step);
    # a 22-block pool cannot hold four requests at once (preemption).
    llm = example_llm(tmp_path, max_num_batched_tokens=16, num_kv_blocks=22, max_model_len=64,
                      async_scheduling=async_scheduling)
    ps = prompts()
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    llm.engine.check_no_leaks()
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool should force preemption"
    # The second prompt's blocks stay in the prefix cache; the first prompt shares its first
    # 24 tokens, so it hits them locally and loads only the rest of its 44 aligned tokens.
    llm.reset_prefix_cache()
    assert run(llm, [ps[1]]) == ([reference[1]], [32])
    assert run(llm, [ps[0]]) == ([reference[0]], [44])
