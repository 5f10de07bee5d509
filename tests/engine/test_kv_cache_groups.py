"""The KV cache manager with several groups: one full-attention and one sliding-window group
(window 6, blocks of 4: a sliding group needs the 2 blocks before a position). Random schedules
over hybrid group sets: tests/engine/test_scheduler.py."""

from __future__ import annotations

from utils import make_request

from kvport.engine.block_pool import BlockPool
from kvport.engine.kv_cache_manager import KVCacheManager

WINDOW, BS = 6, 4


def manager(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, reserve_null_block=True), BS,
                          group_windows=(None, WINDOW))


def computed(kv: KVCacheManager, rid: str, prompt: list[int]) -> None:
    """Run `prompt` through allocation as one prefill, then free it (its blocks stay cached)."""
    req = make_request(rid, prompt)
    assert kv.allocate_slots(req, len(prompt)) is not None
    req.num_computed_tokens = len(prompt)
    kv.free(req)


def test_a_hit_needs_the_full_prefix_and_only_the_window_of_the_sliding_group() -> None:
    kv = manager()
    prompt = list(range(1, 26))  # 6 full blocks + 1 token
    computed(kv, "a", prompt)
    again = make_request("b", prompt)
    (full, sliding), num_tokens = kv.get_computed_blocks(again)
    assert num_tokens == 24  # 6 blocks: the last token is always computed
    assert all(b is not kv.pool.null_block for b in full) and len(full) == 6
    null = kv.pool.null_block
    # the next token (position 24) sees positions 19..24: blocks 4 and 5 of the sliding group
    assert sliding[:4] == [null] * 4 and null not in sliding[4:] and len(sliding) == 6
    tables = kv.allocate_slots(again, 1, (full, sliding))
    assert tables is not None
    assert [len(t) for t in kv.get_block_ids("b")] == [7, 7]
    assert kv.get_block_ids("b")[1][:4] == [0, 0, 0, 0]  # the null block's id
    in_use = kv.pool.num_usable_blocks - kv.pool.num_free_blocks
    assert in_use == 7 + 3  # full: 6 hits + 1 new; sliding: 2 hits + 1 new
    kv.free(again)
    kv.pool.assert_all_free()


def test_an_evicted_window_block_shortens_the_hit_for_every_group() -> None:
    kv = manager()
    prompt = list(range(1, 26))
    req = make_request("a", prompt)
    kv.allocate_slots(req, len(prompt))
    sliding_ids = kv.get_block_ids("a")[1]
    kv.free(req)
    kv.pool.uncache_block(kv.pool.blocks[sliding_ids[4]])  # the window of a 24-token hit
    (full, sliding), num_tokens = kv.get_computed_blocks(make_request("b", prompt))
    # 16 tokens: the sliding group holds blocks 2 and 3 (positions 10..15), and the full
    # group's hit is cut to match
    assert num_tokens == 16 and len(full) == 4 and len(sliding) == 4


def test_a_growing_request_frees_what_its_window_left() -> None:
    kv = manager()
    req = make_request("a", list(range(1, 9)), max_tokens=40)
    kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    for _ in range(20):  # decode one token at a time
        req.append_output_token(7)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        full, sliding = kv.req_to_blocks["a"]
        real = [b for b in sliding if b is not kv.pool.null_block]
        assert len(full) == -(-req.num_computed_tokens // BS)  # the full group keeps all
        assert len(real) <= 3  # the window's 5 earlier tokens and the token itself
    in_use = kv.pool.num_usable_blocks - kv.pool.num_free_blocks
    assert in_use == len(kv.req_to_blocks["a"][0]) + len(real)
    kv.free(req)
    kv.pool.assert_all_free()


def test_one_group_keeps_the_layout_of_every_non_hybrid_model() -> None:
    kv = KVCacheManager(BlockPool(16), BS)
    prompt = list(range(1, 10))
    computed(kv, "a", prompt)
    (hits,), num_tokens = kv.get_computed_blocks(make_request("b", prompt))
    assert num_tokens == 8 and len(hits) == 2
    # keys are the block hashes themselves, as before groups existed
    assert hits[0].block_hash == make_request("b", prompt).block_hashes[0]


def test_bad_groups_are_named() -> None:
    import pytest

    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(BlockPool(8), BS, group_windows=(None, WINDOW))
    with pytest.raises(ValueError, match="at least one group"):
        KVCacheManager(BlockPool(8, reserve_null_block=True), BS, group_windows=())
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1, reserve_null_block=True)


def test_the_null_block_is_never_handed_out() -> None:
    pool = BlockPool(4, reserve_null_block=True)
    blocks = pool.allocate(3)
    assert pool.null_block not in blocks and pool.num_free_blocks == 0
    pool.free(blocks)
    pool.assert_all_free()


def test_the_blocks_in_use_cap_counts_every_group() -> None:
    kv = KVCacheManager(BlockPool(32, reserve_null_block=True), BS, max_blocks_in_use=6,
                        group_windows=(None, WINDOW))
    a = make_request("a", list(range(1, 12)))  # 3 blocks in each group
    assert kv.allocate_slots(a, 11) is not None
    b = make_request("b", list(range(20, 24)))  # 1 block in each group: 6 + 2 > 6
    assert kv.allocate_slots(b, 4) is None and kv.get_block_ids("b") == ([], [])
    kv.free(a)
    assert kv.allocate_slots(b, 4) is not None
    kv.free(b)
    kv.pool.assert_all_free()


def test_a_failed_load_in_a_window_rewinds_to_where_every_window_is_held() -> None:
    # A request loaded 24 tokens: the sliding group holds blocks 4 and 5 (the window before
    # position 24) and the null block before them. Block 5 of the sliding group failed: at
    # every earlier boundary the window would read a null or the failed block, so the request
    # computes again from 0, and the sliding table is cut at its first null block (those
    # positions get real blocks when it is scheduled again).
    from kvport.engine.kv_transfer import KVTransferTracker
    from kvport.engine.recovery import rewind_to_valid_blocks
    from kvport.engine.request import RequestStatus

    kv = manager()
    req = make_request("a", list(range(1, 27)))
    assert kv.allocate_slots(req, 2, num_external_tokens=24) is not None
    full, sliding = kv.get_block_ids("a")
    assert sliding[:4] == [0, 0, 0, 0] and 0 not in sliding[4:]
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, 26
    rewound, resend = rewind_to_valid_blocks(kv, KVTransferTracker(None, BS), [req], [],
                                             {sliding[5]}, step_id=3)
    assert rewound == resend == {"a"} and req.num_computed_tokens == 0
    assert kv.get_block_ids("a") == (full, [])
    # Scheduled again from 0, every position of the window gets a real block.
    assert kv.allocate_slots(req, 8) is not None
    assert 0 not in kv.get_block_ids("a")[1][:2]
    kv.free(req)
    kv.pool.assert_all_free()


def test_a_failed_full_block_also_rewinds_past_the_released_windows() -> None:
    # A prefix hit of 24 tokens keeps the sliding group's blocks 4 and 5 only (the window
    # before 24). Block 5 of the full group failed: the window of every boundary before it
    # reads a released (null) block, so the request computes again from 0 in every group.
    from kvport.engine.kv_transfer import KVTransferTracker
    from kvport.engine.recovery import rewind_to_valid_blocks
    from kvport.engine.request import RequestStatus

    kv = manager()
    prompt = list(range(1, 27))
    computed(kv, "warm", prompt)  # the whole prompt cached in both groups
    req = make_request("a", prompt)
    hits, num_hit = kv.get_computed_blocks(req)
    assert num_hit == 24
    assert kv.allocate_slots(req, 2, hits) is not None
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, 26
    full, sliding = kv.get_block_ids("a")
    rewound, _ = rewind_to_valid_blocks(kv, KVTransferTracker(None, BS), [req], [],
                                        {full[5]}, step_id=3)
    assert rewound == {"a"} and req.num_computed_tokens == 0
    kv.free(req)
    kv.pool.assert_all_free()
