"""The tier-transfer targets of issue 13, evaluated on a `kvport bench transfer` result: the host
tier at least 0.9x of a torch copy of the same bytes (store and load, every job size, slots
consecutive as the allocator hands them out), disk loads at least 0.8x of one sequential file
cold and 0.9x warm. Each ratio is the median of per-round ratios, so both sides met the same
machine."""

from __future__ import annotations

from typing import Any

HOST_MIN, DISK_COLD_MIN, DISK_WARM_MIN = 0.9, 0.8, 0.9


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per (row, side): what was measured, the limit, met or not."""
    targets: list[dict[str, Any]] = []
    strategies = result["config"]["strategies"]
    for r in result["host"]:
        if r["slots"] != "consecutive":  # scattered slots are reported, not a target
            continue
        for strategy in (s for s in strategies if s in r):
            for side in ("store", "load"):
                targets.append(_target(
                    f"host {r['case']} {r['offload_block_bytes']} B, jobs of "
                    f"{r['job_blocks']}, {strategy} {side}", r[strategy][f"{side}_ratio"],
                    HOST_MIN, "torch copy"))
    for r in result.get("disk", []):
        for kind, limit in (("cold", DISK_COLD_MIN), ("warm", DISK_WARM_MIN)):
            targets.append(_target(
                f"disk {r['offload_block_bytes']} B, jobs of {r['job_blocks']}, {kind} load",
                r[kind]["ratio"], limit, "one file"))
    return targets


def _target(what: str, ratio: float, limit: float, against: str) -> dict[str, Any]:
    return {"what": what, "ratio": ratio, "limit": limit, "against": against,
            "met": ratio >= limit}


def format_targets(targets: list[dict[str, Any]]) -> list[str]:
    lines = [f"target {t['what']} vs {t['against']}: {t['ratio']:.2f}x >= {t['limit']:.2f}x: "
             f"{'met' if t['met'] else 'NOT met'}" for t in targets]
    if targets:
        lines.append(f"targets met: {sum(t['met'] for t in targets)} of {len(targets)}")
    return lines
