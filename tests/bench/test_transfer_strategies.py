"""The transfer bench's own host copy strategies (runs, gather, index, cat): round trips through
the host tier's job shape are byte identities on pools of one segment and (runs) of several, and
every id is checked before anything is copied, as the tier checks its own."""

from __future__ import annotations

import pytest
import torch

from kvport.bench.transfer.config import STRATEGIES, TransferBenchConfig
from kvport.bench.transfer.strategies import (
    BENCH_STRATEGIES,
    StrategyTier,
    copy_rows_with,
    copy_segment_runs,
)
from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.row_checks import IdOutOfRangeError

NUM_BLOCKS = 12


def one_segment() -> torch.Tensor:
    """kvport's pool: (blocks, layers, K|V, block_size, heads, head_dim), a block contiguous."""
    return torch.randn(NUM_BLOCKS, 2, 2, 4, 2, 8, generator=torch.Generator().manual_seed(0))


def layers() -> list[torch.Tensor]:
    """vLLM's layer-major pool: a (blocks, heads, block_size, K|V x head_dim) page per layer."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(NUM_BLOCKS, 2, 4, 8, generator=gen) for _ in range(3)]


def test_the_bench_offers_the_tiers_strategies_and_its_own() -> None:
    assert STRATEGIES == ("native", "numpy", "torch", "runs", "gather", "index", "cat")
    cfg = TransferBenchConfig(strategies=STRATEGIES)
    [kvport, vllm_pool] = [c for c in cfg.cases() if c.geometry == "tiny-llama"]
    assert cfg.host_strategies(kvport) == STRATEGIES
    assert cfg.host_strategies(vllm_pool) == ("native", "numpy", "torch", "runs")  # segments


@pytest.mark.parametrize("strategy", BENCH_STRATEGIES)
def test_copy_rows_strategies_agree(strategy: str) -> None:
    src = torch.arange(40, dtype=torch.uint8).view(10, 4)
    dst = torch.zeros(6, 4, dtype=torch.uint8)
    copy_rows_with(strategy, src, dst, [7, 8, 2, 3, 0], [5, 0, 1, 2, 4])
    for s, d in zip([7, 8, 2, 3, 0], [5, 0, 1, 2, 4]):
        assert torch.equal(dst[d], src[s])
    assert not dst[3].any()


@pytest.mark.parametrize("strategy", BENCH_STRATEGIES)
@pytest.mark.parametrize("f", [1, 3])
def test_round_trip_into_other_engine_blocks(strategy: str, f: int) -> None:
    kv = one_segment()
    tier = StrategyTier(EnginePool.block_major(kv), num_slots=4, blocks_per_slot=f,
                        strategy=strategy)
    src_ids = [5, 2, 7, 8, 9, 0][: 2 * f]  # two offload blocks, scattered and consecutive ids
    tier.store(EngineBlocks(src_ids), HostBlocks([3, 1]))
    before = kv.clone()
    dst_ids = [11, 1, 4, 3, 10, 6][: 2 * f]
    tier.load(HostBlocks([3, 1]), EngineBlocks(dst_ids))
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(kv[d], before[s])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert torch.equal(kv[untouched], before[untouched])


def test_runs_moves_a_pool_of_several_segments_and_the_others_refuse_it() -> None:
    tensors = layers()
    pool = EnginePool.from_pages(tensors)
    tier = StrategyTier(pool, num_slots=3, blocks_per_slot=2, strategy="runs")
    tier.store(EngineBlocks([4, 5, 9, 1]), HostBlocks([2, 0]))
    before = [t.clone() for t in tensors]
    tier.load(HostBlocks([2, 0]), EngineBlocks([7, 8, 0, 3]))
    for s, d in zip([4, 5, 9, 1], [7, 8, 0, 3]):
        assert all(torch.equal(t[d], b[s]) for t, b in zip(tensors, before))
    with pytest.raises(ValueError, match="'gather' moves one-segment pools only"):
        StrategyTier(pool, 3, 1, "gather")
    with pytest.raises(ValueError, match="unknown copy strategy 'native'"):  # the tier's own
        StrategyTier(pool, 3, 1, "native")


@pytest.mark.parametrize("bad", [6, 9, -1, -6])
@pytest.mark.parametrize("strategy", BENCH_STRATEGIES)
def test_copy_rows_refuses_a_destination_row_out_of_range(strategy: str, bad: int) -> None:
    src = torch.arange(40, dtype=torch.uint8).view(10, 4)
    dst = torch.zeros(6, 4, dtype=torch.uint8)
    with pytest.raises(IdOutOfRangeError, match=rf"{bad}.*\(pair 2\): out of range"):
        copy_rows_with(strategy, src, dst, [7, 8, 2], [5, 0, bad])
    assert not dst.any()


@pytest.mark.parametrize("bad", [4, -1])
def test_segment_runs_refuse_a_host_row_out_of_range(bad: int) -> None:
    pool = EnginePool.from_pages(layers())
    rows = torch.zeros(4, pool.row_elems, dtype=pool.dtype)
    with pytest.raises(IdOutOfRangeError, match=rf"engine block 2 <-> host row {bad} "
                                                rf"\(pair 1\)"):
        copy_segment_runs(pool, rows, [1, 2], [0, bad], to_host=True)
    assert not rows.any()
