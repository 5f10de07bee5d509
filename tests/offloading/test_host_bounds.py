"""Every copy path of the host tier refuses an engine block or host row id out of range (past
the end, or negative) before it copies anything: the C copy and the numpy one, pools of one
segment and of several (the bench's own strategies: tests/bench/test_transfer_strategies.py).
numpy's take(mode="clip") would copy the last block instead, and negative ids would wrap to
the other end (review D14)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from needs import native_switched_off, require

from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host import block_copy
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool, copy_segments, row_runs
from kvport.connectors.offloading.tiers.host.tier import (
    STRATEGIES, HostTier, copy_rows, copy_rows_numpy,
)
from kvport.connectors.offloading.tiers.host.row_checks import (
    IdOutOfRangeError, check_pairs, first_bad_pair,
)

NUM_BLOCKS, NUM_SLOTS = 12, 4
STRATEGIES_HERE = [s for s in STRATEGIES if not (s == "native" and native_switched_off())]


def one_segment() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(NUM_BLOCKS, 2, 2, 4, 2, 8, generator=gen)


def layers() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(NUM_BLOCKS, 2, 4, 8, generator=gen) for _ in range(3)]


# (EngineBlocks refuses a negative id itself; the copy functions below take negative ones)
@pytest.mark.parametrize("bad", [NUM_BLOCKS, NUM_BLOCKS + 5])
@pytest.mark.parametrize("strategy", STRATEGIES_HERE)
def test_a_store_or_load_of_a_block_out_of_range_raises_and_copies_nothing(
        strategy: str, bad: int) -> None:
    pool = one_segment()
    host = HostTier.for_pool(pool, NUM_SLOTS, blocks_per_slot=1, strategy=strategy)
    host.store(EngineBlocks([0, 1, 2, 3]), HostBlocks([0, 1, 2, 3]))
    before, slots = pool.clone(), host.buffer.clone()
    with pytest.raises(IdOutOfRangeError, match=rf"engine block {bad} <-> host row 1 \(pair 1\)|"
                                                rf"source row {bad} -> destination row 1 "
                                                rf"\(pair 1\)") as info:
        host.store(EngineBlocks([5, bad]), HostBlocks([0, 1]))
    assert f"{NUM_BLOCKS}" in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(IdOutOfRangeError, match=rf"(engine block|destination row) {bad}"):
        host.load(HostBlocks([2, 3]), EngineBlocks([4, bad]))
    assert torch.equal(pool, before) and torch.equal(host.buffer, slots)


@pytest.mark.parametrize("bad", [NUM_BLOCKS, NUM_BLOCKS + 1])
@pytest.mark.parametrize("strategy", STRATEGIES_HERE)
def test_a_pool_of_several_segments_refuses_a_block_out_of_range(strategy: str,
                                                                 bad: int) -> None:
    tensors = layers()
    host = HostTier.for_pool(EnginePool.from_pages(tensors), NUM_SLOTS, 1, strategy=strategy)
    before = [t.clone() for t in tensors]
    with pytest.raises(IdOutOfRangeError, match=rf"engine block {bad} <-> host row 0 \(pair 0\): "
                                                rf"out of range, the pool has {NUM_BLOCKS} blocks "
                                                rf"and the tier {NUM_SLOTS} rows"):
        host.store(EngineBlocks([bad]), HostBlocks([0]))
    with pytest.raises(IdOutOfRangeError, match=rf"engine block {bad}"):
        host.load(HostBlocks([0, 1]), EngineBlocks([3, bad]))
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert not host.buffer.any()


@pytest.mark.parametrize("bad", [NUM_SLOTS, -1])
def test_copy_segments_refuses_a_host_row_out_of_range(bad: int) -> None:
    pool = EnginePool.from_pages(layers())
    rows = torch.zeros(NUM_SLOTS, pool.row_elems, dtype=pool.dtype)
    with pytest.raises(IdOutOfRangeError, match=rf"engine block 2 <-> host row {bad} "
                                                rf"\(pair 1\)"):
        copy_segments(pool, rows, [1, 2], [0, bad], to_host=True)
    assert not rows.any()


@pytest.mark.parametrize("bad", [-1, -NUM_BLOCKS])
def test_copy_segments_refuses_a_negative_block_it_would_wrap(bad: int) -> None:
    tensors = layers()
    before = [t.clone() for t in tensors]
    pool = EnginePool.from_pages(tensors)
    rows = torch.ones(NUM_SLOTS, pool.row_elems, dtype=pool.dtype)
    with pytest.raises(IdOutOfRangeError, match=rf"engine block {bad} <-> host row 0"):
        copy_segments(pool, rows, [bad], [0], to_host=False)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


@pytest.mark.parametrize("bad", [6, 9, -1, -6])
@pytest.mark.parametrize("strategy", STRATEGIES_HERE)
def test_copy_rows_refuses_a_destination_row_out_of_range(strategy: str, bad: int) -> None:
    src = torch.arange(40, dtype=torch.uint8).view(10, 4)
    dst = torch.zeros(6, 4, dtype=torch.uint8)
    with pytest.raises(IdOutOfRangeError, match=rf"{bad}.*\(pair 2\): out of range"):
        copy_rows(src, dst, [7, 8, 2], [5, 0, bad], strategy)
    assert not dst.any()


@pytest.mark.parametrize("bad", [10, -1])
def test_the_numpy_copy_refuses_a_source_row_it_would_clip(bad: int) -> None:
    src = np.arange(40, dtype=np.uint8).reshape(10, 4)
    dst = np.zeros((6, 4), dtype=np.uint8)
    with pytest.raises(IdOutOfRangeError, match=rf"source row {bad} -> destination row 1 "
                                                rf"\(pair 1\): out of range, the source has 10 "
                                                rf"rows and the destination 6"):
        copy_rows_numpy(src, dst, [3, bad], [0, 1])  # one gather into consecutive rows
    assert not dst.any()


def test_the_checks_find_the_first_bad_pair_on_either_side() -> None:
    assert first_bad_pair([], 0, [], 0) == -1
    assert first_bad_pair([0, 11], 12, [3, 0], 4) == -1
    assert first_bad_pair([0, 12, -1], 12, [0, 0, 0], 4) == 1
    assert first_bad_pair([0, 1, -1], 12, [0, 0, 0], 4) == 2
    assert first_bad_pair([0, 1], 12, [0, 4], 4) == 1
    assert first_bad_pair([0, 1], 12, [-1, 0], 4) == 0
    with pytest.raises(ValueError, match="2 ids pair with 1"):
        first_bad_pair([0, 1], 12, [0], 4)
    with pytest.raises(IndexError):  # also an IndexError, for callers that catch that
        check_pairs([3], 2, [0], 1)


def test_mismatched_pairs_are_a_value_error_not_an_assert() -> None:
    with pytest.raises(ValueError, match="2 source rows pair with 1"):
        row_runs([0, 1], [0])


def test_slots_out_of_range_are_refused_with_the_same_error() -> None:
    host = HostTier.for_pool(one_segment(), NUM_SLOTS, 1, strategy="numpy")
    with pytest.raises(IdOutOfRangeError, match=rf"slots \[{NUM_SLOTS}\] out of range"):
        host.store(EngineBlocks([0]), HostBlocks([NUM_SLOTS]))
    with pytest.raises(IdOutOfRangeError, match=r"slot -1 out of range"):
        host.slot(-1)


@pytest.mark.parametrize(("block", "row", "to_host"),
                         [(NUM_BLOCKS, 0, False), (-1, 0, False), (0, NUM_SLOTS, True),
                          (0, -1, True)])
@pytest.mark.parametrize("split", [False, True])
def test_the_c_copy_refuses_an_id_past_either_end_of_either_side(
        block: int, row: int, to_host: bool, split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """block_copy.c's own check (review M4): the pool and the host rows are views with a guard
    row on each side, so an unchecked id writes into memory this test owns, where it shows."""
    if native_switched_off():
        pytest.skip("native code switched off on purpose (KVPORT_NATIVE_KERNELS=0)")
    require(block_copy.available(), "block_copy.c did not build (kvport.native warned)")
    if split:  # the job is checked whole before its parts are handed to the helper
        monkeypatch.setattr(block_copy, "_MIN_SPLIT_BYTES", 1)
    pool_whole = torch.arange((NUM_BLOCKS + 2) * 64, dtype=torch.uint8).view(NUM_BLOCKS + 2, 64)
    rows_whole = torch.full((NUM_SLOTS + 2, 64), 7, dtype=torch.uint8)
    before = pool_whole.clone(), rows_whole.clone()
    pool, rows = pool_whole[1:NUM_BLOCKS + 1], rows_whole[1:NUM_SLOTS + 1]
    copier = block_copy.BlockCopier.for_pool(EnginePool.block_major(pool), rows)
    assert copier is not None
    with ThreadPoolExecutor(1) as helpers, \
            pytest.raises(IdOutOfRangeError, match=rf"engine block {block} <-> host row {row} "
                                                   rf"\(pair 1\): out of range, the pool has "
                                                   rf"{NUM_BLOCKS} blocks and the tier "
                                                   rf"{NUM_SLOTS} rows"):
        copier.copy([1, block], [2, row], to_host, helpers, 1)
    assert torch.equal(pool_whole, before[0]) and torch.equal(rows_whole, before[1])
