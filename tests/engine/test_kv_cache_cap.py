"""`KVCacheManager.max_blocks_in_use`: a large pool capped to N blocks in use admits and preempts
as a pool of N blocks does, while its free blocks keep more prefixes cached."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_scheduler_empty, make_request, make_scheduler, run_step

from kvport.engine.block_pool import BlockPool
from kvport.engine.kv_cache_manager import KVCacheManager
from kvport.engine.scheduler import Scheduler


def _in_use(kv: KVCacheManager) -> int:
    return kv.pool.num_blocks - kv.pool.num_free_blocks


def test_cap_refuses_blocks_the_pool_still_has() -> None:
    kv = KVCacheManager(BlockPool(16), block_size=4, max_blocks_in_use=4)
    a, b = make_request("a", list(range(1, 12))), make_request("b", list(range(20, 28)))
    assert kv.allocate_slots(a, 11) is not None  # 3 blocks
    assert kv.allocate_slots(b, 8) is None  # 3 + 2 > 4 although 13 blocks are free
    assert kv.get_block_ids("b") == ([],) and _in_use(kv) == 3  # and nothing changed
    kv.free(a)
    assert kv.allocate_slots(b, 8) is not None
    kv.free(b)
    kv.pool.assert_all_free()


def test_a_free_cached_block_taken_by_a_hit_counts_as_newly_in_use() -> None:
    kv = KVCacheManager(BlockPool(16), block_size=4, max_blocks_in_use=4)
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    first = make_request("first", prompt)
    kv.allocate_slots(first, 9)
    kv.free(first)  # its 2 full blocks stay cached, free
    other = make_request("other", list(range(30, 36)))
    kv.allocate_slots(other, 6)  # 2 blocks in use
    again = make_request("again", prompt)
    hits, _ = kv.get_computed_blocks(again)
    assert len(hits[0]) == 2 and all(b.ref_cnt == 0 for b in hits[0])
    # 1 new block + 2 free hits: 2 + 3 > 4 (counting only the new block would let it in)
    assert kv.allocate_slots(again, 1, hits) is None
    kv.free(other)
    assert kv.allocate_slots(again, 1, hits) is not None and _in_use(kv) == 3


def test_a_hit_on_a_block_already_in_use_costs_nothing() -> None:
    kv = KVCacheManager(BlockPool(16), block_size=4, max_blocks_in_use=4)
    prompt = list(range(1, 10))
    first = make_request("first", prompt)
    kv.allocate_slots(first, 9)  # 3 blocks in use, 2 of them cached
    second = make_request("second", prompt)
    hits, _ = kv.get_computed_blocks(second)
    assert kv.allocate_slots(second, 1, hits) is not None  # only its last block is new: 3 + 1
    assert _in_use(kv) == 4


def test_bad_cap_is_named() -> None:
    with pytest.raises(ValueError, match="max_blocks_in_use .* got 0"):
        KVCacheManager(BlockPool(4), block_size=4, max_blocks_in_use=0)


Step = tuple[dict[str, int], set[str], list[str]]  # scheduled tokens, preempted, finished


def _trace(sched: Scheduler, prompts: list[list[int]], max_tokens: list[int]) -> list[Step]:
    for i, p in enumerate(prompts):
        sched.add_request(make_request(str(i), p, max_tokens=max_tokens[i]))
    steps: list[Step] = []
    while sched.requests:
        out, finished = run_step(sched)
        steps.append((out.num_scheduled_tokens, out.preempted_req_ids,
                      sorted(r.request_id for r in finished)))
        assert len(steps) < 500, "workload did not finish in 500 steps"
    assert_scheduler_empty(sched)
    return steps


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 12),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    prompts=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=14), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 6), min_size=8, max_size=8),
)
def test_capped_large_pool_schedules_as_the_small_pool(
    num_blocks: int, budget: int, max_num_seqs: int, prompts: list[list[int]],
    max_tokens: list[int],
) -> None:
    """Without prefix caching (so that the larger pool cannot give extra hits), every step
    schedules the same tokens, preempts the same requests and finishes the same ones."""
    def scheduler(pool_blocks: int) -> Scheduler:
        return make_scheduler(num_blocks=pool_blocks, max_num_batched_tokens=budget,
                              max_num_seqs=max_num_seqs, max_model_len=16,
                              enable_prefix_caching=False)

    small, large = scheduler(num_blocks), scheduler(4 * num_blocks)
    large.kv.max_blocks_in_use = num_blocks
    assert _trace(large, prompts, max_tokens) == _trace(small, prompts, max_tokens)


def test_preemption_happens_under_the_cap_as_in_the_small_pool() -> None:
    """The case of test_scheduler's preemption test, in a pool four times larger, capped."""
    sched = make_scheduler(num_blocks=16, max_model_len=16)
    sched.kv.max_blocks_in_use = 4
    steps = _trace(sched, [[1, 2, 3], [4, 5, 6]], [8, 8])
    assert any(preempted == {"1"} for _, preempted, _ in steps)
