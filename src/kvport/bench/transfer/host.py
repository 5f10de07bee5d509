"""Host tier rows of `kvport bench transfer`: jobs of offload blocks between the engine pool and
host slots, next to a plain torch copy of the same bytes.

For each pool case and offload block size S (one engine block by default), a pool of
`total_mib` MiB is moved in jobs, as the connector moves a request's blocks: one large job of
`total_mib` MiB, and small jobs of `small_job_blocks` blocks one after another over the same
bytes. The engine block ids are shuffled (a pool that has served a while is fragmented). The
slots of a job are consecutive (the host tier allocates a job's slots in ascending order,
consecutive where free ones allow: the target case) or shuffled (a fragmented host tier,
reported). Baseline: `Tensor.copy_` of each job's bytes between two contiguous buffers, with
torch's thread count; the host tier copies with as many threads. Rounds run tier store, tier
load and the copy back to back (paired_rounds); the ratios are per round, their median is
reported. The tier's own strategies copy through `HostTier`, the bench's through
`StrategyTier` (strategies). After the rounds the pool must be what it was (every load put
back what its store took), else the row fails.
"""

from __future__ import annotations

import statistics
from typing import Protocol

import torch

from kvport.bench.transfer.config import GEOMETRIES, MIB, PoolCase, TransferBenchConfig
from kvport.bench.transfer.rows import HostRow, HostSides
from kvport.bench.transfer.strategies import StrategyTier
from kvport.bench.transfer.timing import gib_s, paired_rounds, ratio_stats
from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.tier import STRATEGIES as TIER_STRATEGIES
from kvport.connectors.offloading.tiers.host.tier import HostTier

Jobs = list[tuple[list[int], list[int]]]  # (engine block ids, slot ids) per job


class Copier(Protocol):
    """What moves a job: the host tier, or the bench's StrategyTier."""

    def store(self, src: EngineBlocks, dst: HostBlocks) -> object: ...

    def load(self, src: HostBlocks, dst: EngineBlocks) -> object: ...


def bench_host(cfg: TransferBenchConfig) -> list[HostRow]:
    gen = torch.Generator().manual_seed(cfg.seed)
    rows: list[HostRow] = []
    for case in cfg.cases():
        for size in cfg.offload_sizes(case):
            rows += _case_rows(cfg, case, size, gen)
    return rows


def _make_pool(case: PoolCase, num_blocks: int, gen: torch.Generator) -> EnginePool:
    layers, heads, head_dim = GEOMETRIES[case.geometry]
    bs = case.block_tokens
    if case.layout == "kvport":
        return EnginePool.block_major(
            torch.randn((num_blocks, layers, 2, bs, heads, head_dim), generator=gen))
    # one storage, layer-major, each layer's pages [block, head, token, K|V] as vLLM's CPU pool
    storage = torch.randn((layers, num_blocks, heads, bs, 2 * head_dim), generator=gen)
    return EnginePool.from_pages([storage[i] for i in range(layers)])


def _copier(pool: EnginePool, num_slots: int, f: int, strategy: str) -> Copier:
    if strategy in TIER_STRATEGIES:
        return HostTier.for_pool(pool, num_slots, f, strategy)
    return StrategyTier(pool, num_slots, f, strategy)


def _case_rows(cfg: TransferBenchConfig, case: PoolCase, size: int,
               gen: torch.Generator) -> list[HostRow]:
    f = size // case.engine_block_bytes
    num_slots = max(1, cfg.total_mib * MIB // size)
    num_blocks = num_slots * f
    pool = _make_pool(case, num_blocks, gen)
    tiers = {s: _copier(pool, num_slots, f, s) for s in cfg.host_strategies(case)}
    engine = torch.randperm(num_blocks, generator=gen).tolist()
    shuffled = torch.randperm(num_slots, generator=gen).tolist()
    rows = []
    for job_blocks in dict.fromkeys((num_slots, min(num_slots, cfg.small_job_blocks))):
        for slots_kind, slots in (("consecutive", list(range(num_slots))),
                                  ("scattered", shuffled)):
            jobs = [(engine[i * f:(i + job_blocks) * f], slots[i:i + job_blocks])
                    for i in range(0, num_slots, job_blocks)]
            rows.append(_row(cfg, case, size, pool, tiers, jobs, slots_kind))
    return rows


def _row(cfg: TransferBenchConfig, case: PoolCase, size: int, pool: EnginePool,
         tiers: dict[str, Copier], jobs: Jobs, slots_kind: str) -> HostRow:
    specs = [(EngineBlocks(e), HostBlocks(s)) for e, s in jobs]
    num_bytes = sum(len(s) for _, s in jobs) * size
    # the baseline: each job's bytes, one copy_ between contiguous buffers, over the same total
    elems = [len(s) * size // 4 for _, s in jobs]
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)

    def torch_copy() -> None:
        at = 0
        for n in elems:
            dst[at:at + n].copy_(src[at:at + n])
            at += n

    before = [s.clone() for s in pool.segments]
    copy_gib_s = None
    sides: dict[str, HostSides] = {}
    for strategy, host in tiers.items():
        def store(host: Copier = host) -> None:
            for e, h in specs:
                host.store(e, h)

        def load(host: Copier = host) -> None:
            for e, h in specs:
                host.load(h, e)

        times = paired_rounds({"copy": torch_copy, "store": store, "load": load}, cfg.repeats)
        if not all(torch.equal(a, b) for a, b in zip(pool.segments, before)):
            raise RuntimeError(f"host tier bench, {case.name} {strategy} {slots_kind}: the pool "
                               f"changed after store + load of the same blocks (a copy moved "
                               f"the wrong bytes)")
        copy_gib_s = gib_s(num_bytes, statistics.median(times["copy"]))
        sides[strategy] = HostSides(
            gib_s(num_bytes, statistics.median(times["store"])),
            gib_s(num_bytes, statistics.median(times["load"])),
            ratio_stats(times["store"], times["copy"]), ratio_stats(times["load"], times["copy"]))
    return HostRow(case, size, len(jobs[0][1]), len(jobs), slots_kind, num_bytes,
                   torch.get_num_threads(), copy_gib_s, sides)
