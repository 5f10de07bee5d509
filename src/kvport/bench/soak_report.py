"""The soak's result: its samples, per-process figures, start vs end, and the bounds checked
(`violations`); and the human table of it.

Start is the first sample of the first process once it was ready, end the last sample of the
last process; step-time percentiles pool the first (last) `WINDOW` samples' steps, since one
sample holds too few steps for a p99.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvport.bench.soak_probe import DiskUsage, ProcessSample, RedisSample, percentile
from kvport.bench.soak_reference import ReferenceCheck

WINDOW = 5  # samples pooled for the start and end step-time percentiles
_TIERS = ("host", "disk", "redis")


@dataclass(frozen=True)
class SoakBounds:
    """Limits the soak checks; None: not checked. The ones without None always hold for a
    correct connector (disk within max_bytes, no temp file after a clean stop, ...)."""

    max_rss_growth_mib: float | None = None  # end or max RSS minus start
    max_fds: int | None = None
    max_fd_growth: int | None = None  # max over the run minus start
    max_threads: int | None = None
    max_thread_growth: int | None = None
    max_p99_step_ms: float | None = None  # of the end window
    disk_slack_bytes: int = 64 << 10  # beyond max_bytes (the ledger file and the like)
    min_kills: int = 1


@dataclass(frozen=True)
class Incarnation:
    """One workload process: when it started, got ready and ended, and how."""

    index: int
    pid: int
    started_s: float
    ready_s: float | None
    startup_s: float | None
    ended_s: float | None
    end: str  # "killed", "stopped", or what went wrong
    clean_exit: bool  # it reported "done" (shut down cleanly)
    requests: int
    metrics: dict[str, Any] | None  # its last LLM.get_metrics()


@dataclass(frozen=True)
class Tick:
    """One sample. `step_ms` and `requests` are the child's since the previous sample."""

    t_s: float
    incarnation: int
    ready: bool
    process: ProcessSample | None
    disk: DiskUsage
    redis: RedisSample | None
    step_ms: tuple[float, ...]
    requests: int
    metrics: dict[str, Any] | None


def _hits(metrics: dict[str, Any] | None) -> dict[str, int]:
    req = ((metrics or {}).get("connector") or {}).get("requests") or {}
    out = {t: int(req.get(f"num_{t}_hit_tokens", 0)) for t in _TIERS}
    out["queried"] = int(req.get("num_queried_tokens", 0))
    return out


def _row(tick: Tick, prev: Tick | None) -> dict[str, Any]:
    now = _hits(tick.metrics)
    before = _hits(prev.metrics) if prev is not None and prev.incarnation == tick.incarnation \
        else {k: 0 for k in now}
    delta = {k: now[k] - before[k] for k in now}
    hit = sum(delta[t] for t in _TIERS)
    return {"t_s": round(tick.t_s, 3), "incarnation": tick.incarnation, "ready": tick.ready,
            **(asdict(tick.process) if tick.process else {"rss_bytes": None, "fds": None,
                                                          "threads": None}),
            "disk_bytes": tick.disk.bytes, "disk_files": tick.disk.files,
            "temp_files": tick.disk.temp_files,
            "redis_used_memory": tick.redis.used_memory if tick.redis else None,
            "redis_evicted_keys": tick.redis.evicted_keys if tick.redis else None,
            "redis_keys": tick.redis.keys if tick.redis else None,
            "steps": len(tick.step_ms), "step_p50_ms": percentile(list(tick.step_ms), 0.5),
            "step_p99_ms": percentile(list(tick.step_ms), 0.99), "requests": tick.requests,
            "hit_tokens": {t: delta[t] for t in _TIERS}, "queried_tokens": delta["queried"],
            "hit_rate": hit / delta["queried"] if delta["queried"] > 0 else None}


def _figures(ticks: list[Tick], rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [x for t in ticks for x in t.step_ms]
    last = rows[-1] if rows else {}
    return {"rss_bytes": last.get("rss_bytes"), "fds": last.get("fds"),
            "threads": last.get("threads"), "disk_bytes": last.get("disk_bytes"),
            "temp_files": last.get("temp_files"),
            "redis_used_memory": last.get("redis_used_memory"),
            "redis_evicted_keys": last.get("redis_evicted_keys"),
            "step_p50_ms": percentile(steps, 0.5), "step_p99_ms": percentile(steps, 0.99)}


def summarize(config: dict[str, Any], bounds: SoakBounds, disk_max_bytes: int,
              incarnations: list[Incarnation], ticks: list[Tick], reference: ReferenceCheck,
              final_disk: DiskUsage, logs: dict[int, str], wall_s: float) -> dict[str, Any]:
    rows = [_row(t, ticks[i - 1] if i else None) for i, t in enumerate(ticks)]
    live = [(t, r) for t, r in zip(ticks, rows) if t.ready and t.process is not None]
    # Steps reach the soak up to half a second late (the child's stats lines), so the windows
    # are the first and last samples that hold steps; the other figures are the first and last
    # samples of a ready process.
    stepped = [t for t, _ in live if t.step_ms]
    start = _figures(stepped[:WINDOW], [r for _, r in live[:1]])
    end = _figures(stepped[-WINDOW:], [r for _, r in live[-1:]])
    peak = {k: max((r[k] for _, r in live if r[k] is not None), default=None)
            for k in ("rss_bytes", "fds", "threads")}
    peak["disk_bytes"] = max((r["disk_bytes"] for r in rows), default=0)
    kills = sum(i.end == "killed" for i in incarnations)
    restarted_disk_hits = sum(_hits(i.metrics)["disk"] for i in incarnations if i.index > 0)
    per_process = [{**{k: v for k, v in asdict(i).items() if k != "metrics"},
                    **_life_figures([r for t, r in live if t.incarnation == i.index]),
                    "hit_tokens": _hits(i.metrics),
                    "disk_evictions": ((i.metrics or {}).get("connector", {})
                                       .get("disk", {}).get("evictions")),
                    "bad_answers": _kv(i.metrics, "num_bad_answers"),
                    "hook_errors": _kv(i.metrics, "num_hook_errors")} for i in incarnations]
    violations: list[str] = []

    def bound(name: str, value: float | None, limit: float | None) -> None:
        if limit is not None and value is not None and value > limit:
            violations.append(f"{name} {value:g} > {limit:g}")

    if reference.mismatches:
        violations.append(f"{len(reference.mismatches)} of {reference.checked} answers differ "
                          f"from the no-connector reference")
    if reference.failed_requests:
        violations.append(f"{reference.failed_requests} requests failed")
    for i in incarnations:
        if i.end not in ("killed", "stopped"):
            violations.append(f"process {i.index} (pid {i.pid}): {i.end}")
        for what in ("bad_answers", "hook_errors"):
            n = per_process[i.index][what]
            if n:
                violations.append(f"process {i.index}: {n} {what.replace('_', ' ')}")
    if kills < bounds.min_kills:
        violations.append(f"{kills} kills < {bounds.min_kills}")
    if kills and not restarted_disk_hits:
        violations.append("no restarted process got a disk hit")
    bound("disk bytes", peak["disk_bytes"], disk_max_bytes + bounds.disk_slack_bytes)
    if final_disk.temp_files:
        violations.append(f"{final_disk.temp_files} temp files left after the last stop")
    growth = {"rss_mib": _diff(peak["rss_bytes"], start["rss_bytes"], 1 << 20),
              "fds": _diff(peak["fds"], start["fds"]),
              "threads": _diff(peak["threads"], start["threads"])}
    bound("RSS growth MiB", growth["rss_mib"], bounds.max_rss_growth_mib)
    bound("fds", peak["fds"], bounds.max_fds)
    bound("fd growth", growth["fds"], bounds.max_fd_growth)
    bound("threads", peak["threads"], bounds.max_threads)
    bound("thread growth", growth["threads"], bounds.max_thread_growth)
    bound("end p99 step ms", end["step_p99_ms"], bounds.max_p99_step_ms)
    return {"benchmark": "soak", "config": config, "bounds": asdict(bounds),
            "wall_s": wall_s, "kills": kills, "processes": per_process,
            "requests": reference.checked + reference.failed_requests,
            "reference": {"checked": reference.checked,
                          "distinct_prompts": reference.distinct_prompts,
                          "mismatches": [asdict(m) for m in reference.mismatches[:20]],
                          "num_mismatches": len(reference.mismatches)},
            "start": start, "end": end, "max": peak, "growth": growth,
            "restarted_disk_hit_tokens": restarted_disk_hits,
            "final_disk": asdict(final_disk), "samples": rows, "logs": logs,
            "violations": violations, "ok": not violations}


def _life_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One process's RSS, descriptors and threads: [first, last, max] of its ready samples
    (growth within a process, which the run's start vs end would blur across restarts)."""
    return {k: [rows[0][k], rows[-1][k], max(r[k] for r in rows)] if rows else None
            for k in ("rss_bytes", "fds", "threads")}


def _kv(metrics: dict[str, Any] | None, name: str) -> int:
    return int(((metrics or {}).get("kv_transfer") or {}).get(name, 0))


def _diff(a: float | None, b: float | None, unit: float = 1.0) -> float | None:
    return None if a is None or b is None else (a - b) / unit


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "MiB":
        return f"{value / (1 << 20):.1f}"
    if isinstance(value, float):
        return f"{value:.2f}" if math.isfinite(value) else str(value)
    return str(value)


def format_soak(result: dict[str, Any]) -> str:
    """Start vs end (and max) of each figure, the kills and hits, then the violations."""
    cfg = result["config"]
    lines = [f"soak: {result['wall_s']:.0f} s, {len(result['processes'])} processes, "
             f"{result['kills']} kills (every ~{cfg['kill_every_s']} s, seed {cfg['seed']}), "
             f"{result['requests']} requests, {result['reference']['num_mismatches']} "
             f"mismatches; disk max_bytes {cfg['disk_max_bytes'] / (1 << 20):.1f} MiB"]
    rows = [("figure", "start", "end", "max"),
            ("RSS MiB", _fmt(result["start"]["rss_bytes"], "MiB"),
             _fmt(result["end"]["rss_bytes"], "MiB"), _fmt(result["max"]["rss_bytes"], "MiB"))]
    for key, name in (("fds", "open fds"), ("threads", "threads")):
        rows.append((name, _fmt(result["start"][key]), _fmt(result["end"][key]),
                     _fmt(result["max"][key])))
    rows += [("disk MiB", _fmt(result["start"]["disk_bytes"], "MiB"),
              _fmt(result["end"]["disk_bytes"], "MiB"), _fmt(result["max"]["disk_bytes"], "MiB")),
             ("temp files", _fmt(result["start"]["temp_files"]),
              _fmt(result["final_disk"]["temp_files"]), "")]
    for key, name in (("redis_used_memory", "redis MiB"),):
        rows.append((name, _fmt(result["start"][key], "MiB"), _fmt(result["end"][key], "MiB"),
                     ""))
    for key, name in (("redis_evicted_keys", "redis evicted"), ("step_p50_ms", "step p50 ms"),
                      ("step_p99_ms", "step p99 ms")):
        rows.append((name, _fmt(result["start"][key]), _fmt(result["end"][key]), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    for p in result["processes"]:
        rss, fds = p["rss_bytes"], p["fds"]
        lines.append(f"  process {p['index']}: {p['end']} after {p['requests']} requests; RSS "
                     + (f"{_fmt(rss[0], 'MiB')} -> {_fmt(rss[2], 'MiB')} MiB, fds max {fds[2]}"
                        if rss else "-")
                     + f"; hit tokens disk {p['hit_tokens']['disk']} redis "
                       f"{p['hit_tokens']['redis']} host {p['hit_tokens']['host']}")
    lines.append(f"disk hit tokens after restarts: {result['restarted_disk_hit_tokens']}; "
                 f"temp files left after the final stop: {result['final_disk']['temp_files']}")
    lines += [f"VIOLATION: {v}" for v in result["violations"]] or ["all bounds held"]
    return "\n".join(lines)
