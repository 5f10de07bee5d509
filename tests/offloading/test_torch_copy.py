"""The torch copy path (tiers/host/torch_copy.py), run on CPU tensors: the ops a GPU pool's copies
are made of. Host rows equal the native copy's for every pool shape; chunks, runs of rows, the
per-segment fallback and the id checks behave as the path's contract says."""

from __future__ import annotations

import pytest
import torch

from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.row_checks import IdOutOfRangeError
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.tiers.host.torch_copy import TorchCopier, row_runs_of

LAYERS, BLOCKS, HEADS, TOKENS, DIM = 3, 12, 2, 4, 8


def pools(dtype: torch.dtype = torch.bfloat16) -> dict[str, EnginePool]:
    """The same random bytes as a layer-major pool in one allocation (one layered view), as one
    tensor per layer (no layered view: the per-segment loop), and kvport's block-major pool."""
    gen = torch.Generator().manual_seed(7)
    storage = torch.randn((LAYERS, BLOCKS, HEADS, TOKENS, DIM), generator=gen).to(dtype)
    return {"layered": EnginePool.from_pages([storage[i] for i in range(LAYERS)]),
            "per-layer": EnginePool.from_pages([storage[i].clone() for i in range(LAYERS)]),
            "block-major": EnginePool.block_major(storage.transpose(0, 1).contiguous())}


def test_the_pools_are_what_the_cases_say() -> None:
    p = pools()
    assert p["layered"].layered is not None and p["layered"].layered.shape[0] == LAYERS
    assert p["per-layer"].layered is None
    assert p["block-major"].layered is not None and len(p["block-major"].segments) == 1


@pytest.mark.parametrize("case", ["layered", "per-layer", "block-major"])
@pytest.mark.parametrize("staging_blocks", [1, 3, 64])
@pytest.mark.parametrize("staged", [True, False])
def test_torch_copies_the_bytes_the_native_copy_does(case: str, staging_blocks: int,
                                                     staged: bool) -> None:
    """Stores into scattered and consecutive slots, then loads into other blocks: the slots hold
    what the native copy writes, and each loaded block equals its source, in chunks of any size,
    through the staging rows (a GPU pool's way) or straight into host rows (a host pool's)."""
    pool = pools()[case]
    slots, blocks = [4, 5, 6, 0, 2], [9, 1, 2, 3, 11]
    native = HostTier.for_pool(pool, num_slots=7, blocks_per_slot=1, strategy="native")
    native.store(EngineBlocks(blocks), HostBlocks(slots))
    host = HostTier.for_pool(pool, num_slots=7, blocks_per_slot=1, strategy="torch")
    assert host._torch is not None
    host._torch = TorchCopier(pool, host._rows, staging_bytes=staging_blocks * pool.block_bytes,
                              staged=staged)
    host.store(EngineBlocks(blocks), HostBlocks(slots))
    assert torch.equal(host.buffer, native.buffer)
    before = [s.clone() for s in pool.segments]
    targets = [0, 5, 7, 8, 10]
    host.load(HostBlocks(slots), EngineBlocks(targets))
    for seg, old in zip(pool.segments, before):
        for src, dst in zip(blocks, targets):
            assert torch.equal(seg[dst], old[src])
        kept = [b for b in range(BLOCKS) if b not in targets]
        assert torch.equal(seg[kept], old[kept])


def test_a_load_with_skip_and_several_blocks_a_slot() -> None:
    """f = 2 and a partial first offload block: the rows after `skip` land in order."""
    pool = pools()["layered"]
    host = HostTier.for_pool(pool, num_slots=3, blocks_per_slot=2, strategy="torch")
    host.store(EngineBlocks([1, 2, 7, 4]), HostBlocks([2, 0]))
    old = [s.clone() for s in pool.segments]
    host.load(HostBlocks([2, 0]), EngineBlocks([9, 10, 11], skip=1))
    for seg, before in zip(pool.segments, old):
        assert [torch.equal(seg[d], before[s]) for s, d in [(2, 9), (7, 10), (4, 11)]] \
            == [True] * 3


def test_ids_out_of_range_are_refused_before_anything_is_copied() -> None:
    pool = pools()["layered"]
    host = HostTier.for_pool(pool, num_slots=4, blocks_per_slot=1, strategy="torch")
    assert host._torch is not None
    rows = host.buffer.clone()
    with pytest.raises(IdOutOfRangeError):
        host._torch.copy([1, BLOCKS], [0, 1], to_host=True)
    with pytest.raises(IdOutOfRangeError):
        host._torch.copy([1, 2], [0, 4], to_host=True)
    assert torch.equal(host.buffer, rows)
    segs = [s.clone() for s in pool.segments]
    with pytest.raises(IdOutOfRangeError):
        host._torch.copy([0, -1], [0, 1], to_host=False)
    assert all(torch.equal(a, b) for a, b in zip(pool.segments, segs))


def test_bad_host_rows_and_staging_are_refused_naming_them() -> None:
    pool = pools()["layered"]
    rows = torch.zeros((4, pool.row_elems), dtype=pool.dtype)
    with pytest.raises(ValueError, match=r"host rows: contiguous \(rows, 48\) of torch.int64, got \(4, 10\)"):
        TorchCopier(pool, rows[:, :10])
    with pytest.raises(ValueError, match="staging_bytes 8 is below one engine block"):
        TorchCopier(pool, rows, staging_bytes=8)


def test_row_runs() -> None:
    assert row_runs_of([]) == []
    assert row_runs_of([4, 5, 6, 0, 2, 3]) == [(0, 4, 3), (3, 0, 1), (4, 2, 2)]
