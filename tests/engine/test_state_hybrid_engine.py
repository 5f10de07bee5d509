"""kvport's engine on a state-space hybrid (tiny-granite4: Mamba2 and full-attention layers in
two KV cache groups): greedy output equal to transformers with prefix hits, chunked prefill
(chunks that end inside a block and cross several), preemption and every executor; a state group
holds only the block of its latest state; nothing leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid_checks import GREEDY, byte_prompts, check, greedy_reference
from kvport import LLM
from kvport.model.builtin import builtin_model_dir


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return builtin_model_dir("tiny-granite4")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuation of every prompt these tests run."""
    return greedy_reference(model_dir, [
        *byte_prompts(3, 150, shared=100), *byte_prompts(4, 90, seed=1),
        *byte_prompts(2, 300, seed=2), *byte_prompts(2, 7, seed=3)])


def test_a_state_group_and_an_attention_group(model_dir: Path) -> None:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200)
    assert [(g.layer_ids, g.state) for g in llm.engine.groups] == [((0, 2), True), ((1, 3), False)]
    assert llm.engine.kv_cache_manager.group_windows == (2, None)
    assert llm.engine.runner.kv_cache.shape[1] == 2


def test_greedy_equals_transformers_with_prefix_hits(model_dir: Path, reference: dict) -> None:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200)
    prompts = byte_prompts(3, 150, shared=100)
    check(llm, [*prompts[:1], *byte_prompts(2, 7, seed=3)], reference)
    engine = llm.engine
    engine.add_request("hit", prompts[1], GREEDY)
    engine.step()
    # The shared 100 tokens are 6 full blocks: the state after token 95 (block 5 of the state
    # group) and the K/V of blocks 0-5 come from the cache, 96 tokens are not computed again.
    assert engine.scheduler.requests["hit"].num_cached_tokens == 96
    while engine.has_pending_work():
        engine.step()
    check(llm, prompts[1:], reference)


@pytest.mark.parametrize("tail", [1, 30])
def test_a_hit_on_a_state_written_in_the_same_step(model_dir: Path, tail: int) -> None:
    # B is admitted in the step that computes A's prompt, and hits the blocks A's prefill
    # publishes when scheduled: B starts from the state A writes in that very step, so its
    # state layers run after A's (a 1-token rest of B would otherwise run first, as a decode).
    a = byte_prompts(1, 120, seed=4)[0]
    b = a[:96] + byte_prompts(1, tail + 1, seed=5)[0][1:]
    reference = greedy_reference(model_dir, [a, b])
    expected = [reference[tuple(a)], reference[tuple(b)]]
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200)
    engine = llm.engine
    reqs = [engine.add_request("a", a, GREEDY), engine.add_request("b", b, GREEDY)]
    engine.step()
    assert reqs[1].num_cached_tokens == 96  # in the step that computes A's first 96 tokens
    while engine.has_pending_work():
        engine.step()
    assert [list(r.output_token_ids) for r in reqs] == expected
    engine.check_no_leaks()


@pytest.mark.parametrize("mode", ["inline", "async", "process"])
def test_chunked_prefill_and_a_long_decode(model_dir: Path, reference: dict, mode: str) -> None:
    # 40-token chunks of 16-token blocks: chunks start and end inside blocks and cross two
    kw = {"async": {"async_scheduling": True}, "process": {"worker": "process"}}.get(mode, {})
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200, max_num_batched_tokens=40, **kw)
    try:
        check(llm, byte_prompts(2, 300, seed=2), reference)
    finally:
        llm.shutdown()


def test_preemption_under_a_small_pool(model_dir: Path, reference: dict) -> None:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=24, max_model_len=128,
              max_num_batched_tokens=32)
    prompts = byte_prompts(4, 90, seed=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == reference[tuple(p)]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.engine.check_no_leaks()


def test_a_state_group_holds_only_its_latest_state(model_dir: Path) -> None:
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200)
    engine = llm.engine
    engine.add_request("r", byte_prompts(1, 300, seed=2)[0], GREEDY)
    kv, null = engine.kv_cache_manager, engine.pool.null_block
    seen = []
    while engine.has_pending_work():
        engine.step()
        tables = kv.req_to_blocks.get("r")
        if tables:
            seen.append([sum(b is not null for b in t) for t in tables])
    assert seen[0] == [19, 19]  # the prefill step writes a state at every block boundary
    assert all(state <= 2 for state, _full in seen[1:])  # then: the latest state's block (+ one)
    assert seen[-1][1] == -(-(300 + 11) // 16)  # the attention group keeps everything
    engine.check_no_leaks()


def test_a_connector_gets_one_group_and_outputs_stay_equal(model_dir: Path,
                                                            reference: dict) -> None:
    # A connector that is not SupportsHMA reads one block table: one group of every layer, whose
    # blocks hold K/V in the attention layers' slots and the state in the Mamba layers' slots.
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=200,
              kv_transfer_config={"kv_connector": "NoOpConnector", "kv_role": "kv_both"})
    assert llm.engine.kv_cache_manager.group_windows == (None,)
    assert llm.engine.runner.kv_cache.shape[1] == 4
    prompts = byte_prompts(3, 150, shared=100)
    check(llm, prompts, reference)
    llm.reset_prefix_cache()
    check(llm, prompts, reference)
    stats = llm.engine.scheduler.xfer.stats
    assert stats.num_bad_answers == 0 and stats.num_hook_errors == 0


def test_a_block_too_small_for_the_state_is_refused_at_start(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="block_size >= 12"):
        LLM(str(model_dir), block_size=8, num_kv_blocks=200)
