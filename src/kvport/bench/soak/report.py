"""The soak's text report: start vs end (and max) of each figure, each process's life, the kills
and disk hits, then the violations."""

from __future__ import annotations

import math

from kvport.bench.common.table import table_lines
from kvport.bench.soak.result import SoakResult


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "MiB":
        return f"{value / (1 << 20):.1f}"
    if isinstance(value, float):
        return f"{value:.2f}" if math.isfinite(value) else str(value)
    return str(value)


def format_soak(result: SoakResult) -> str:
    """Start vs end (and max) of each figure, the kills and hits, then the violations."""
    cfg, start, end, peak = result.config, result.start, result.end, result.peak
    lines = [(f"soak: {result.wall_s:.0f} s, {len(result.processes)} processes, "
              f"{result.kills} kills (every ~{cfg['kill_every_s']} s, seed {cfg['seed']}), "
              f"{result.reference.checked + result.reference.failed_requests} requests, "
              f"{len(result.reference.mismatches)} mismatches; disk max_bytes "
              f"{cfg['disk_max_bytes'] / (1 << 20):.1f} MiB")]
    rows = [("figure", "start", "end", "max"),
            ("RSS MiB", _fmt(start.rss_bytes, "MiB"), _fmt(end.rss_bytes, "MiB"),
             _fmt(peak["rss_bytes"], "MiB")),
            ("open fds", _fmt(start.fds), _fmt(end.fds), _fmt(peak["fds"])),
            ("threads", _fmt(start.threads), _fmt(end.threads), _fmt(peak["threads"])),
            ("disk MiB", _fmt(start.disk_bytes, "MiB"), _fmt(end.disk_bytes, "MiB"),
             _fmt(peak["disk_bytes"], "MiB")),
            ("temp files", _fmt(start.temp_files), _fmt(result.final_disk.temp_files), ""),
            ("redis MiB", _fmt(start.redis_used_memory, "MiB"), _fmt(end.redis_used_memory, "MiB"),
             ""),
            ("redis evicted", _fmt(start.redis_evicted_keys), _fmt(end.redis_evicted_keys), ""),
            ("step p50 ms", _fmt(start.step_p50_ms), _fmt(end.step_p50_ms), ""),
            ("step p99 ms", _fmt(start.step_p99_ms), _fmt(end.step_p99_ms), "")]
    lines += table_lines(rows)
    for p in result.processes:
        rss, fds = p.resources["rss_bytes"], p.resources["fds"]
        lines.append(f"  process {p.life.index}: {p.life.end} after {p.life.requests} requests; "
                     f"RSS " + (f"{_fmt(rss[0], 'MiB')} -> {_fmt(rss[2], 'MiB')} MiB, fds max "
                                f"{fds[2] if fds else None}" if rss else "-")
                     + f"; hit tokens disk {p.hit_tokens['disk']} redis "
                       f"{p.hit_tokens['redis']} host {p.hit_tokens['host']}")
    lines.append(f"disk hit tokens after restarts: {result.restarted_disk_hit_tokens}; "
                 f"temp files left after the final stop: {result.final_disk.temp_files}")
    lines += [f"VIOLATION: {v}" for v in result.violations] or ["all bounds held"]
    return "\n".join(lines)
