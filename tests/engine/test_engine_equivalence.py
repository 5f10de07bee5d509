"""Greedy output does not depend on how the engine gets there: prefix caching, chunking,
preemption, arrival order. Every scenario ends with the "nothing leaked" check."""

from __future__ import annotations

import pytest

from kvport import LLM, SamplingParams
from kvport.engine.core import EngineCore

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    # Several lengths, and shared prefixes so that prefix caching has something to hit.
    base = [(i * 37 + 11) % 250 + 3 for i in range(70)]
    return [base[:5], base[:40], base[:40] + [7, 8, 9], base[:64], base[3:20], base[:1]]


def run(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    llm.engine.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("builtin:tiny-llama", enable_prefix_caching=False, max_num_batched_tokens=4096)
    return run(llm, prompts())


def test_prefix_caching_gives_the_same_output_and_hits(reference: list[list[int]]) -> None:
    llm = LLM("builtin:tiny-llama", block_size=8)
    assert run(llm, prompts()) == reference
    again = llm.generate(prompts(), GREEDY, use_tqdm=False)  # second pass: served from the cache
    assert [o.outputs[0].token_ids for o in again] == reference
    assert again[3].num_cached_tokens == 56  # 63 // 8 full blocks of the 64-token prompt
    assert llm.engine.pool.stats.num_hit_blocks > 0
    llm.engine.check_no_leaks()


def test_prefix_lookups_are_counted_once_per_admission() -> None:
    # 10 blocks of 8 tokens hold one of these 60-token prompts at a time: the others are looked
    # up again on every step they wait, and must still count once (one token each: no decode
    # growth, so no preemption and no second admission).
    llm = LLM("builtin:tiny-llama", block_size=8, num_kv_blocks=10, max_model_len=80)
    ps = [[(t * 7 + i * 31) % 250 + 3 for t in range(60)] for i in range(3)]
    lookups = []
    get_computed_blocks = llm.engine.kv_cache_manager.get_computed_blocks
    llm.engine.kv_cache_manager.get_computed_blocks = (  # type: ignore[method-assign]
        lambda req: lookups.append(req.request_id) or get_computed_blocks(req))
    llm.generate(ps, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert len(lookups) > len(ps)  # the waiting requests were looked up more than once
    stats = llm.engine.pool.stats
    assert stats.num_queried_blocks == sum((len(p) - 1) // 8 for p in ps)
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("budget", [1, 7, 16, 33])
def test_chunked_prefill_gives_the_same_output(reference: list[list[int]], budget: int) -> None:
    llm = LLM("builtin:tiny-llama", max_num_batched_tokens=budget, block_size=4)
    assert run(llm, prompts()) == reference


def test_preemption_gives_the_same_output(reference: list[list[int]]) -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, num_kv_blocks=24, max_model_len=96)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    llm.engine.check_no_leaks()


def test_requests_arriving_while_others_decode(reference: list[list[int]]) -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, max_num_batched_tokens=16)
    core: EngineCore = llm.engine
    ps = prompts()
    reqs = []
    for i, p in enumerate(ps):
        reqs.append(core.add_request(f"r{i}", p, GREEDY))
        for _ in range(3):  # a few steps between arrivals: the earlier ones are decoding
            core.step()
    while core.has_pending_work():
        core.step()
    assert [r.output_token_ids for r in reqs] == reference
    core.check_no_leaks()


def test_abort_mid_generation_frees_everything() -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, max_num_batched_tokens=8)
    core = llm.engine
    for i, p in enumerate(prompts()):
        core.add_request(f"r{i}", p, GREEDY)
    for _ in range(6):
        core.step()
    core.abort_requests([f"r{i}" for i in range(0, 6, 2)])
    while core.has_pending_work():
        core.step()
    core.check_no_leaks()
