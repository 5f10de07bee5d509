"""kvport's engine on a hybrid model (tiny-gemma3: sliding-window and full attention in three KV
cache groups): greedy output equal to transformers with prefix hits, chunked prefill and
preemption; sliding groups give back the blocks their window left; nothing leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid_checks import GREEDY, byte_prompts, check, greedy_reference
from kvport import LLM
from kvport.model.builtin import builtin_model_dir

WINDOW = 48


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return builtin_model_dir("tiny-gemma3")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuation of every prompt these tests run."""
    return greedy_reference(model_dir, [
        *byte_prompts(3, 150, shared=100), *byte_prompts(4, 90, seed=1),
        *byte_prompts(2, 300, seed=2)])


def test_three_groups_and_a_null_block(model_dir: Path) -> None:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200)
    kv = llm.engine.kv_cache_manager
    assert kv.group_windows == (WINDOW, WINDOW, None)
    assert llm.engine.pool.null_block is not None
    # a block holds two layers (the groups' size), not all six
    assert llm.engine.runner.kv_cache.shape[1] == 2


def test_greedy_equals_transformers_with_prefix_hits(model_dir: Path, reference: dict) -> None:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200)
    prompts = byte_prompts(3, 150, shared=100)
    check(llm, prompts[:1], reference)
    before = llm.engine.pool.stats.num_hit_blocks
    check(llm, prompts[1:], reference)  # the shared 100 tokens: 6 full blocks in every group
    assert llm.engine.pool.stats.num_hit_blocks - before == 2 * 6


@pytest.mark.parametrize("mode", ["inline", "async", "process"])
def test_chunked_prefill_and_a_long_decode(model_dir: Path, reference: dict, mode: str) -> None:
    # async: step N+1 is scheduled (and a sliding group frees blocks) while step N runs
    kw = {"async": {"async_scheduling": True}, "process": {"worker": "process"}}.get(mode, {})
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200, max_num_batched_tokens=40, **kw)
    try:
        check(llm, byte_prompts(2, 300, seed=2), reference)
    finally:
        llm.shutdown()


def test_preemption_under_a_small_pool(model_dir: Path, reference: dict) -> None:
    # 4 requests of ~100 tokens: each needs 7 full-group blocks and about 4 per sliding group.
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=40, max_model_len=128,
              max_num_batched_tokens=32)
    prompts = byte_prompts(4, 90, seed=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == reference[tuple(p)]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.engine.check_no_leaks()


def test_sliding_groups_hold_only_their_window(model_dir: Path) -> None:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200)
    engine = llm.engine
    engine.add_request("r", byte_prompts(1, 300, seed=2)[0], GREEDY)
    kv = engine.kv_cache_manager
    null = engine.pool.null_block
    seen = []
    while engine.has_pending_work():
        engine.step()
        tables = kv.req_to_blocks.get("r")
        if tables:
            seen.append([sum(b is not null for b in t) for t in tables])
    assert len(seen) > 2
    assert seen[0][:2] == [19, 19]  # the prefill step writes every position in every group
    for sliding_a, sliding_b, _full in seen[1:]:
        # decodes: the window's 47 earlier tokens and the step's, at most 4 blocks of 16
        assert sliding_a <= 4 and sliding_b <= 4
    assert seen[-1][2] == -(-(300 + 11) // 16)  # the full group keeps everything
    engine.check_no_leaks()


def test_a_connector_gets_one_group_and_outputs_stay_equal(model_dir: Path,
                                                            reference: dict) -> None:
    # A connector that is not SupportsHMA reads one block table: the engine keeps one group of
    # every layer (sliding layers attend within their window but keep their blocks), as vLLM
    # turns its hybrid allocator off for it. (kvport's own connectors declare SupportsHMA:
    # tests/offloading/test_hybrid_offloading.py.)
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200,
              kv_transfer_config={"kv_connector": "NoOpConnector", "kv_role": "kv_both"})
    assert llm.engine.kv_cache_manager.group_windows == (None,)
    assert llm.engine.runner.kv_cache.shape[1] == 6
    prompts = byte_prompts(3, 150, shared=100)
    check(llm, prompts, reference)
    llm.reset_prefix_cache()
    check(llm, prompts, reference)
    stats = llm.engine.scheduler.xfer.stats
    assert stats.num_bad_answers == 0 and stats.num_hook_errors == 0