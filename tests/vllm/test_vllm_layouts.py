"""The host tier's byte views of vLLM's KV pool in every layout vLLM has, built by vLLM's own code
(`create_kv_cache_views` over one int8 allocation, as its workers do): stores and loads move
each layer's page exactly, in every copy path, and kernel blocks group into engine blocks."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.tier import STRATEGIES, HostTier

LAYERS, BLOCKS = 3, 6
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
# (segments, one layered view) each layout gives: layers outermost, one run per layer's page
# (LB*) or per head (LHBNC); blocks outermost, one run per block across layers (BL*C), or one per
# layer and head (BHLNC, whose heads enclose the layers)
EXPECTED = {"LBHNC": (LAYERS, True), "LBNHC": (LAYERS, True), "LHBNC": (LAYERS * 2, True),
            "BLHNC": (1, True), "BLNHC": (1, True), "BHLNC": (LAYERS * 2, False)}


def views(layout: KVCacheLayout, seed: int = 0,
          kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """vLLM's per-layer views `[B, H, N, C]` of one allocation of random bytes."""
    strides = compute_layout_strides(SPEC, BLOCKS, LAYERS, layout)
    size = SPEC.page_size_bytes * BLOCKS * LAYERS
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(seed))
    tensor = KVCacheTensor(size=size, layers=[f"layers.{i}" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1])
    # as int16: random bytes make NaNs, which torch.equal never finds equal
    return [v.view(torch.int16) for v in
            create_kv_cache_views(raw, SPEC, BLOCKS, layout, tensor, kernel_block_size)]


def test_every_layout_of_vllm_is_covered() -> None:
    assert set(EXPECTED) == {layout.name for layout in KVCacheLayout}


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_byte_views_of_each_layout(layout: KVCacheLayout) -> None:
    pool = EnginePool.from_pages(views(layout))
    assert (len(pool.segments), pool.layered is not None) == EXPECTED[layout.name]
    assert pool.num_blocks == BLOCKS and pool.block_bytes == LAYERS * SPEC.page_size_bytes


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_blocks_round_trip_in_each_layout(layout: KVCacheLayout, strategy: str) -> None:
    layers = views(layout)
    host = HostTier.for_pool(EnginePool.from_pages(layers), num_slots=4, blocks_per_slot=1,
                             strategy=strategy)
    before = [t.clone() for t in layers]
    host.store(EngineBlocks([4, 1, 2]), HostBlocks([3, 0, 1]))
    host.load(HostBlocks([3, 0, 1]), EngineBlocks([0, 5, 3]))
    for t, old in zip(layers, before):
        for src, dst in [(4, 0), (1, 5), (2, 3)]:
            assert torch.equal(t[dst], old[src])
        assert torch.equal(t[[1, 2, 4]], old[[1, 2, 4]])


def test_host_rows_depend_on_the_page_order_only() -> None:
    """A page's bytes in LBHNC and BLHNC are the same [H, N, C] run: equal slots for equal KV,
    while LBNHC's [N, H, C] pages differ (so the layout is part of the disk namespace)."""
    slots = {}
    reference = views(KVCacheLayout.LBHNC)
    for layout in (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.LBNHC):
        layers = views(layout, seed=1)
        for t, ref in zip(layers, reference):
            t.copy_(ref)  # the same logical KV in this layout
        host = HostTier.for_pool(EnginePool.from_pages(layers), 1, 1, strategy="native")
        host.store(EngineBlocks([2]), HostBlocks([0]))
        slots[layout.name] = host.slot(0).clone()
    assert torch.equal(slots["LBHNC"], slots["BLHNC"])
    assert not torch.equal(slots["LBHNC"], slots["LBNHC"])


def test_kernel_blocks_group_into_engine_blocks() -> None:
    """vLLM splits a block into kernel blocks of 8 tokens: each layer's view then has 2 * BLOCKS
    blocks, and two consecutive ones are one engine block."""
    layers = views(KVCacheLayout.LBNHC, kernel_block_size=8)
    assert layers[0].shape[0] == 2 * BLOCKS
    pool = EnginePool.from_pages(layers, num_blocks=BLOCKS)
    assert pool.num_blocks == BLOCKS and pool.block_bytes == LAYERS * SPEC.page_size_bytes
    host = HostTier.for_pool(pool, 2, 1, strategy="torch")
    before = [t.clone() for t in layers]
    host.store(EngineBlocks([1]), HostBlocks([0]))
    host.load(HostBlocks([0]), EngineBlocks([4]))
    for t, old in zip(layers, before):
        assert torch.equal(t[8:10], old[2:4])
