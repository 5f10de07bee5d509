"""Block pool: reference counts, LRU reuse of freed cached blocks, integrity checks."""

from __future__ import annotations

import pytest

from kvport.engine.block_pool import BlockPool


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_allocate_and_free_count_references() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.touch([a])  # a second request shares block a
    pool.free([a, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 0, 3)
    pool.free([a])
    pool.assert_all_free()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_freed_cached_blocks_keep_contents_and_are_reused_in_lru_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    # free tail first, as the KV cache manager does: 3, 2, then 1, 0 later
    pool.free([blocks[3], blocks[2]])
    pool.free([blocks[1], blocks[0]])
    assert pool.get_cached_block(h(0)) is blocks[0]  # still cached while free
    # a prefix hit on block 1 takes it out of the free queue without evicting it
    pool.touch([blocks[1]])
    assert pool.num_free_blocks == 3
    # allocation evicts in free order: 3, then 2, then 0
    first = pool.allocate(2)
    assert [b.block_id for b in first] == [3, 2]
    assert pool.get_cached_block(h(3)) is None and pool.get_cached_block(h(2)) is None
    assert pool.stats.num_evicted_blocks == 2  # counted, not listed: the pool runs for months
    assert pool.get_cached_block(h(0)) is blocks[0]
    (last,) = pool.allocate(1)
    assert last.block_id == 0 and pool.get_cached_block(h(0)) is None
    pool.free(first + [last, blocks[1]])
    pool.assert_all_free()
    assert pool.num_cached_blocks == 1  # block 1 still holds h(1)


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(7))
    pool.cache_block(b, h(7))
    assert pool.get_cached_block(h(7)) is a and b.block_hash is None
    pool.free([b, a])
    pool.assert_all_free()


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(1))
    assert pool.get_cached_block(h(1)) is None
    pool.free([a])
    pool.assert_all_free()


def test_reset_prefix_cache_forgets_hashes() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1))
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(h(1)) is None and pool.num_cached_blocks == 0
    pool.free([b])
    pool.assert_all_free()


def test_integrity_check_catches_corruption() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    a.ref_cnt = 0  # lost reference without returning to the free queue
    with pytest.raises(RuntimeError, match="free\\(2\\) \\+ in_use\\(0\\) != total\\(3\\)"):
        pool.check_integrity()
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a])


def test_leak_oracle_names_blocks_in_use() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="2 blocks still in use"):
        pool.assert_all_free()
