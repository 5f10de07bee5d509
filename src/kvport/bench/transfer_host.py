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
reported. After the rounds the pool must be what it was (every load put back what its store
took), else the row fails.
"""

from __future__ import annotations

from typing import Any

from kvport.bench.transfer_common import (
    GEOMETRIES,
    MIB,
    PoolCase,
    TransferBenchConfig,
    gib_s,
    paired_rounds,
    ratio_stats,
)


def bench_host(cfg: TransferBenchConfig) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    rows: list[dict[str, Any]] = []
    for case in cfg.cases():
        for size in cfg.offload_sizes(case):
            rows += _case_rows(cfg, case, size, gen)
    return rows


def _make_pool(case: PoolCase, num_blocks: int, gen: Any) -> Any:
    import torch

    from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool

    layers, heads, head_dim = GEOMETRIES[case.geometry]
    bs = case.block_tokens
    if case.layout == "kvport":
        return torch.randn((num_blocks, layers, 2, bs, heads, head_dim), generator=gen)
    # one storage, layer-major, each layer's pages [block, head, token, K|V] as vLLM's CPU pool
    storage = torch.randn((layers, num_blocks, heads, bs, 2 * head_dim), generator=gen)
    return EnginePool.from_pages([storage[i] for i in range(layers)])


def _case_rows(cfg: TransferBenchConfig, case: PoolCase, size: int,
               gen: Any) -> list[dict[str, Any]]:
    import torch

    from kvport.connectors.offloading.tiers.host.tier import HostTier

    f = size // case.engine_block_bytes
    num_slots = max(1, cfg.total_mib * MIB // size)
    num_blocks = num_slots * f
    pool = _make_pool(case, num_blocks, gen)
    tiers = {s: HostTier.for_pool(pool, num_slots, f, s) for s in cfg.host_strategies(case)}
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


def _row(cfg: TransferBenchConfig, case: PoolCase, size: int, pool: Any,
         tiers: dict[str, Any], jobs: list[tuple[list[int], list[int]]],
         slots_kind: str) -> dict[str, Any]:
    import torch

    from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks

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

    row: dict[str, Any] = {
        "case": case.name, "geometry": case.geometry, "layout": case.layout,
        "engine_block_bytes": case.engine_block_bytes, "offload_block_bytes": size,
        "job_blocks": len(jobs[0][1]), "num_jobs": len(jobs), "slots": slots_kind,
        "bytes_per_transfer": num_bytes, "torch_threads": torch.get_num_threads()}
    before = pool.clone() if isinstance(pool, torch.Tensor) else \
        [s.clone() for s in pool.segments]
    for strategy, host in tiers.items():
        def store(host: Any = host) -> None:
            for e, h in specs:
                host.store(e, h)

        def load(host: Any = host) -> None:
            for e, h in specs:
                host.load(h, e)

        times = paired_rounds({"copy": torch_copy, "store": store, "load": load}, cfg.repeats)
        _check_pool_unchanged(pool, before, f"{case.name} {strategy} {slots_kind}")
        row["torch_copy_gib_s"] = gib_s(num_bytes, _median(times["copy"]))
        row[strategy] = {
            "store_gib_s": gib_s(num_bytes, _median(times["store"])),
            "load_gib_s": gib_s(num_bytes, _median(times["load"])),
            **{f"store_{k}": v for k, v in ratio_stats(times["store"], times["copy"]).items()},
            **{f"load_{k}": v for k, v in ratio_stats(times["load"], times["copy"]).items()}}
    return row


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def _check_pool_unchanged(pool: Any, before: Any, what: str) -> None:
    import torch

    now = [pool] if isinstance(pool, torch.Tensor) else list(pool.segments)
    then = [before] if isinstance(before, torch.Tensor) else before
    if not all(torch.equal(a, b) for a, b in zip(now, then)):
        raise RuntimeError(f"host tier bench, {what}: the pool changed after store + load of "
                           f"the same blocks (a copy moved the wrong bytes)")
