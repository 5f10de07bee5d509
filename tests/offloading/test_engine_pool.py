"""EnginePool: the host tier moves engine blocks whose bytes lie in several segments (vLLM's
layer-major pool: one storage, or one tensor per layer) as byte identities, into the same host
row format as a block-major pool holding the same bytes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool, copy_segments
from kvport.connectors.offloading.tiers.host.tier import STRATEGIES, HostTier

NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD2 = 3, 10, 2, 4, 16  # vLLM CPU: [B, H, N, 2*C]


def layer_major(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One storage, layer-major, and its per-layer views (as vLLM's CPU backend registers)."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn((NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD2), generator=gen).to(dtype)
    return storage, [storage[i] for i in range(NUM_LAYERS)]


def block_of(layers: list[torch.Tensor], block: int) -> torch.Tensor:
    """An engine block's bytes in host row order: its page of every layer, in layer order."""
    return torch.cat([t[block].reshape(-1).view(torch.uint8) for t in layers])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_through_a_layer_major_pool(strategy: str, separate: bool,
                                               dtype: torch.dtype) -> None:
    storage, layers = layer_major(dtype)
    if separate:  # one allocation per layer: the fallback
        layers = [t.clone() for t in layers]
    pool = EnginePool.from_pages(layers)
    assert len(pool.segments) == NUM_LAYERS and pool.num_blocks == NUM_BLOCKS
    host = HostTier.for_pool(pool, num_slots=3, blocks_per_slot=2, strategy=strategy)
    src_ids = [4, 5, 9, 1]  # a consecutive pair and a scattered pair
    expected = {b: block_of(layers, b).clone() for b in src_ids}
    host.store(EngineBlocks(src_ids), HostBlocks([2, 0]))
    for slot, (a, b) in zip([2, 0], [(4, 5), (9, 1)]):
        assert torch.equal(host.slot(slot), torch.cat([expected[a], expected[b]]))
    before = [t.clone() for t in layers]
    dst_ids = [7, 8, 0, 3]
    out = host.load(HostBlocks([2, 0]), EngineBlocks(dst_ids))
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(block_of(layers, d), expected[s])
    for t, b in zip(layers, before):  # nothing else changed
        untouched = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
        assert torch.equal(t[untouched], b[untouched])
    assert out.num_bytes == 4 * pool.block_bytes


def test_host_rows_match_a_block_major_pool_of_the_same_bytes() -> None:
    """Slot bytes depend on the segment widths only: a block-major pool holding each block's
    pages side by side stores the same slot bytes."""
    _, layers = layer_major()
    block_major = torch.stack([block_of(layers, b) for b in range(NUM_BLOCKS)])
    a = HostTier.for_pool(EnginePool.from_pages(layers), num_slots=2, blocks_per_slot=1)
    b = HostTier.for_pool(block_major, num_slots=2, blocks_per_slot=1)
    a.store(EngineBlocks([6]), HostBlocks([1]))
    b.store(EngineBlocks([6]), HostBlocks([1]))
    assert torch.equal(a.slot(1), b.slot(1))


def test_copies_split_between_threads_are_the_same() -> None:
    _, layers = layer_major()
    pool = EnginePool.from_pages(layers)
    rows = torch.zeros((NUM_BLOCKS, pool.row_elems), dtype=pool.dtype)
    ids = list(range(NUM_BLOCKS))
    with ThreadPoolExecutor(3) as helpers:
        copy_segments(pool, rows, ids, ids[::-1], to_host=True, helpers=helpers, num_helpers=3)
    alone = torch.zeros_like(rows)
    copy_segments(pool, alone, ids, ids[::-1], to_host=True)
    assert torch.equal(rows, alone)


def test_bad_pools_are_refused_with_what_is_wrong() -> None:
    storage, layers = layer_major()
    with pytest.raises(ValueError, match="no KV cache tensors"):
        EnginePool.from_pages([])
    with pytest.raises(ValueError, match="tensor 1 has 9 blocks, tensor 0 has 10"):
        EnginePool.from_pages([layers[0], layers[1][:9]])
    with pytest.raises(ValueError, match="tensor 0: a block of this KV cache view .* is not one "
                                         "run of memory"):
        EnginePool.from_pages([layers[0][..., ::2]])
    overlapping = storage.view(-1)[:NUM_BLOCKS * 8].as_strided((NUM_BLOCKS, 8), (4, 1))
    with pytest.raises(ValueError, match="blocks of 32 bytes lie 16 bytes apart: they overlap"):
        EnginePool.from_pages([overlapping])
    with pytest.raises(ValueError, match="tensor 0 has 10 blocks, not a multiple of the "
                                         "engine's 4"):
        EnginePool.from_pages(layers, num_blocks=4)
    with pytest.raises(ValueError, match="unknown copy strategy 'gather'"):  # the bench's own
        HostTier(2, EnginePool.from_pages(layers).block_bytes, strategy="gather")
    meta = torch.empty((NUM_BLOCKS, HEADS, BLOCK, HEAD2), device="meta")  # as a GPU's would
    for strategy in ("native", "numpy"):
        with pytest.raises(ValueError, match=f"the '{strategy}' copy reads host memory; this KV "
                                             f"pool is on meta: copy it with strategy 'torch'"):
            HostTier.for_pool(EnginePool.from_pages([meta]), 2, 1, strategy=strategy)
    assert HostTier.for_pool(EnginePool.from_pages([meta]), 2, 1).strategy == "torch"
    with pytest.raises(ValueError, match="not a multiple of the engine block"):
        HostTier(2, 1000).register_engine_pool(EnginePool.from_pages(layers))


@pytest.mark.parametrize("slots", [[0, 1, 2, 3, 4], [4, 0, 3, 1, 2]])
def test_jobs_of_engine_blocks_through_a_layer_major_pool(slots: list[int]) -> None:
    """f = 1: a job of shuffled engine blocks into consecutive or scattered slots and back into
    other blocks, every page of every layer exact."""
    _, layers = layer_major(seed=5)
    pool = EnginePool.from_pages(layers)
    host = HostTier.for_pool(pool, num_slots=5, blocks_per_slot=1)
    src_ids, dst_ids = [8, 2, 5, 0, 9], [1, 7, 3, 6, 4]
    expected = {b: block_of(layers, b).clone() for b in src_ids}
    host.store(EngineBlocks(src_ids), HostBlocks(slots))
    for b, s in zip(src_ids, slots):
        assert torch.equal(host.slot(s), expected[b])
    host.load(HostBlocks(slots), EngineBlocks(dst_ids))
    for b, d in zip(src_ids, dst_ids):
        assert torch.equal(block_of(layers, d), expected[b])
