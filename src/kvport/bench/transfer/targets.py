"""The tier-transfer targets, evaluated on a `kvport bench transfer` result: the host tier at
least 0.9x of a torch copy of the same bytes (store and load, every job size, slots consecutive
as the allocator hands them out), disk loads at least 0.8x of one sequential file cold and 0.9x
warm. Each ratio is the median of per-round ratios, so both sides met the same machine."""

from __future__ import annotations

from collections.abc import Sequence

from kvport.bench.transfer.rows import DiskRow, HostRow, TransferTarget

HOST_MIN, DISK_COLD_MIN, DISK_WARM_MIN = 0.9, 0.8, 0.9


def evaluate_targets(host: Sequence[HostRow],
                     disk: Sequence[DiskRow] | None) -> list[TransferTarget]:
    """One target per (row, side): what was measured, the limit, met or not."""
    targets: list[TransferTarget] = []
    for r in host:
        if r.slots != "consecutive":  # scattered slots are reported, not a target
            continue
        for strategy, sides in r.strategies.items():
            for side, stats in (("store", sides.store), ("load", sides.load)):
                targets.append(_target(
                    f"host {r.case.name} {r.offload_block_bytes} B, jobs of {r.job_blocks}, "
                    f"{strategy} {side}", stats.ratio, HOST_MIN, "torch copy"))
    for d in disk or ():
        for kind, limit, ratio in (("cold", DISK_COLD_MIN, d.cold.sides.ratio.ratio),
                                   ("warm", DISK_WARM_MIN, d.warm.sides.ratio.ratio)):
            targets.append(_target(f"disk {d.offload_block_bytes} B, jobs of {d.job_blocks}, "
                                   f"{kind} load", ratio, limit, "one file"))
    return targets


def _target(what: str, ratio: float, limit: float, against: str) -> TransferTarget:
    return TransferTarget(what, ratio, limit, against, ratio >= limit)


def format_targets(targets: Sequence[TransferTarget]) -> list[str]:
    lines = [f"target {t.what} vs {t.against}: {t.ratio:.2f}x >= {t.limit:.2f}x: "
             f"{'met' if t.met else 'NOT met'}" for t in targets]
    if targets:
        lines.append(f"targets met: {sum(t.met for t in targets)} of {len(targets)}")
    return lines
