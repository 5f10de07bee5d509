"""The soak's result: its samples, per-process figures, start vs end, and the bounds checked
(`violations`); the JSON it is written as.

Start is the first sample of the first process once it was ready, end the last sample of the
last process; step-time percentiles pool the first (last) `WINDOW` samples' steps, since one
sample holds too few steps for a p99.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvport.bench.common.command import JsonObject
from kvport.bench.common.stats import nearest_rank
from kvport.bench.soak.probe import DiskUsage, ProcessSample, RedisSample
from kvport.bench.soak.reference import ReferenceCheck

WINDOW = 5  # samples pooled for the start and end step-time percentiles
_TIERS = ("host", "disk", "redis")
_RESOURCES = ("rss_bytes", "fds", "threads")


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
    metrics: JsonObject | None  # its last LLM.get_metrics()


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
    metrics: JsonObject | None


@dataclass(frozen=True)
class SampleRow:
    """A sample as the report lists it; hit tokens since the previous sample of its process."""

    t_s: float
    incarnation: int
    ready: bool
    rss_bytes: int | None
    fds: int | None
    threads: int | None
    disk_bytes: int
    disk_files: int
    temp_files: int
    redis_used_memory: int | None
    redis_evicted_keys: int | None
    redis_keys: int | None
    steps: int
    step_p50_ms: float | None
    step_p99_ms: float | None
    requests: int
    hit_tokens: dict[str, int]
    queried_tokens: int
    hit_rate: float | None


@dataclass(frozen=True)
class Figures:
    """The soak's figures at its start or end (a window of samples)."""

    rss_bytes: int | None
    fds: int | None
    threads: int | None
    disk_bytes: int | None
    temp_files: int | None
    redis_used_memory: int | None
    redis_evicted_keys: int | None
    step_p50_ms: float | None
    step_p99_ms: float | None


@dataclass(frozen=True)
class ProcessFigures:
    """One workload process: its life, and [first, last, max] of its RSS, descriptors and
    threads over its ready samples (growth within a process, which the run's start vs end would
    blur across restarts)."""

    life: Incarnation
    resources: dict[str, list[int | None] | None]  # "rss_bytes", "fds", "threads"
    hit_tokens: dict[str, int]
    disk_evictions: int | None
    bad_answers: int
    hook_errors: int

    def to_json(self) -> JsonObject:
        life = {k: v for k, v in asdict(self.life).items() if k != "metrics"}
        return {**life, **self.resources, "hit_tokens": self.hit_tokens,
                "disk_evictions": self.disk_evictions, "bad_answers": self.bad_answers,
                "hook_errors": self.hook_errors}


@dataclass(frozen=True)
class SoakResult:
    config: JsonObject  # as run, the Redis URL's password redacted
    bounds: SoakBounds
    wall_s: float
    kills: int
    processes: tuple[ProcessFigures, ...]
    reference: ReferenceCheck
    start: Figures
    end: Figures
    peak: dict[str, int | None]  # max over the run: RSS, descriptors, threads, disk bytes
    growth: dict[str, float | None]  # max minus start: "rss_mib", "fds", "threads"
    restarted_disk_hit_tokens: int
    final_disk: DiskUsage
    samples: tuple[SampleRow, ...]
    logs: dict[int, str]  # process -> its log's end, for processes that ended unasked
    violations: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> JsonObject:
        ref = self.reference
        return {"benchmark": "soak", "config": self.config, "bounds": asdict(self.bounds),
                "wall_s": self.wall_s, "kills": self.kills,
                "processes": [p.to_json() for p in self.processes],
                "requests": ref.checked + ref.failed_requests,
                "reference": {"checked": ref.checked, "distinct_prompts": ref.distinct_prompts,
                              "mismatches": [asdict(m) for m in ref.mismatches[:20]],
                              "num_mismatches": len(ref.mismatches)},
                "start": asdict(self.start), "end": asdict(self.end), "max": self.peak,
                "growth": self.growth,
                "restarted_disk_hit_tokens": self.restarted_disk_hit_tokens,
                "final_disk": asdict(self.final_disk),
                "samples": [asdict(s) for s in self.samples], "logs": self.logs,
                "violations": list(self.violations), "ok": self.ok}


def _hits(metrics: JsonObject | None) -> dict[str, int]:
    req = ((metrics or {}).get("connector") or {}).get("requests") or {}
    out = {t: int(req.get(f"num_{t}_hit_tokens", 0)) for t in _TIERS}
    out["queried"] = int(req.get("num_queried_tokens", 0))
    return out


def _row(tick: Tick, prev: Tick | None) -> SampleRow:
    now = _hits(tick.metrics)
    before = _hits(prev.metrics) if prev is not None and prev.incarnation == tick.incarnation \
        else {k: 0 for k in now}
    delta = {k: now[k] - before[k] for k in now}
    hit = sum(delta[t] for t in _TIERS)
    proc, redis, steps = tick.process, tick.redis, list(tick.step_ms)
    return SampleRow(
        round(tick.t_s, 3), tick.incarnation, tick.ready,
        proc.rss_bytes if proc else None, proc.fds if proc else None,
        proc.threads if proc else None, tick.disk.bytes, tick.disk.files, tick.disk.temp_files,
        redis.used_memory if redis else None, redis.evicted_keys if redis else None,
        redis.keys if redis else None, len(steps), nearest_rank(steps, 0.5),
        nearest_rank(steps, 0.99), tick.requests, {t: delta[t] for t in _TIERS},
        delta["queried"], hit / delta["queried"] if delta["queried"] > 0 else None)


def _figures(ticks: list[Tick], rows: list[SampleRow]) -> Figures:
    steps = [x for t in ticks for x in t.step_ms]
    last = rows[-1] if rows else None
    return Figures(
        last.rss_bytes if last else None, last.fds if last else None,
        last.threads if last else None, last.disk_bytes if last else None,
        last.temp_files if last else None, last.redis_used_memory if last else None,
        last.redis_evicted_keys if last else None, nearest_rank(steps, 0.5),
        nearest_rank(steps, 0.99))


def _process_figures(life: Incarnation, rows: list[SampleRow]) -> ProcessFigures:
    def first_last_max(name: str) -> list[int | None] | None:
        values = [getattr(r, name) for r in rows]
        return [values[0], values[-1], max(values)] if rows else None

    return ProcessFigures(life, {k: first_last_max(k) for k in _RESOURCES}, _hits(life.metrics),
                          ((life.metrics or {}).get("connector", {})
                           .get("disk", {}).get("evictions")),
                          _kv(life.metrics, "num_bad_answers"),
                          _kv(life.metrics, "num_hook_errors"))


def summarize(config: JsonObject, bounds: SoakBounds, disk_max_bytes: int,
              incarnations: list[Incarnation], ticks: list[Tick], reference: ReferenceCheck,
              final_disk: DiskUsage, logs: dict[int, str], wall_s: float) -> SoakResult:
    rows = [_row(t, ticks[i - 1] if i else None) for i, t in enumerate(ticks)]
    live = [(t, r) for t, r in zip(ticks, rows) if t.ready and t.process is not None]
    # Steps reach the soak up to half a second late (the child's stats lines), so the windows
    # are the first and last samples that hold steps; the other figures are the first and last
    # samples of a ready process.
    stepped = [t for t, _ in live if t.step_ms]
    start = _figures(stepped[:WINDOW], [r for _, r in live[:1]])
    end = _figures(stepped[-WINDOW:], [r for _, r in live[-1:]])
    peak: dict[str, int | None] = {
        k: max((getattr(r, k) for _, r in live if getattr(r, k) is not None), default=None)
        for k in _RESOURCES}
    peak["disk_bytes"] = max((r.disk_bytes for r in rows), default=0)
    processes = tuple(_process_figures(i, [r for t, r in live if t.incarnation == i.index])
                      for i in incarnations)
    growth = {"rss_mib": _diff(peak["rss_bytes"], start.rss_bytes, 1 << 20),
              "fds": _diff(peak["fds"], start.fds),
              "threads": _diff(peak["threads"], start.threads)}
    kills = sum(i.end == "killed" for i in incarnations)
    restarted_disk_hits = sum(_hits(i.metrics)["disk"] for i in incarnations if i.index > 0)
    violations = _violations(bounds, disk_max_bytes, reference, processes, kills,
                             restarted_disk_hits, final_disk, peak, growth, end)
    return SoakResult(config, bounds, wall_s, kills, processes, reference, start, end, peak,
                      growth, restarted_disk_hits, final_disk, tuple(rows), logs,
                      tuple(violations))


def _violations(bounds: SoakBounds, disk_max_bytes: int, reference: ReferenceCheck,
                processes: tuple[ProcessFigures, ...], kills: int, restarted_disk_hits: int,
                final_disk: DiskUsage, peak: dict[str, int | None],
                growth: dict[str, float | None], end: Figures) -> list[str]:
    """What broke: an answer unlike the reference, a process that died unasked, too few kills,
    no disk hit after a restart, the disk above its bound, a temp file left, a resource bound."""
    violations: list[str] = []

    def bound(name: str, value: float | None, limit: float | None) -> None:
        if limit is not None and value is not None and value > limit:
            violations.append(f"{name} {value:g} > {limit:g}")

    if reference.mismatches:
        violations.append(f"{len(reference.mismatches)} of {reference.checked} answers differ "
                          f"from the no-connector reference")
    if reference.failed_requests:
        violations.append(f"{reference.failed_requests} requests failed")
    for p in processes:
        i = p.life
        if i.end not in ("killed", "stopped"):
            violations.append(f"process {i.index} (pid {i.pid}): {i.end}")
        for what, n in (("bad answers", p.bad_answers), ("hook errors", p.hook_errors)):
            if n:
                violations.append(f"process {i.index}: {n} {what}")
    if kills < bounds.min_kills:
        violations.append(f"{kills} kills < {bounds.min_kills}")
    if kills and not restarted_disk_hits:
        violations.append("no restarted process got a disk hit")
    bound("disk bytes", peak["disk_bytes"], disk_max_bytes + bounds.disk_slack_bytes)
    if final_disk.temp_files:
        violations.append(f"{final_disk.temp_files} temp files left after the last stop")
    bound("RSS growth MiB", growth["rss_mib"], bounds.max_rss_growth_mib)
    bound("fds", peak["fds"], bounds.max_fds)
    bound("fd growth", growth["fds"], bounds.max_fd_growth)
    bound("threads", peak["threads"], bounds.max_threads)
    bound("thread growth", growth["threads"], bounds.max_thread_growth)
    bound("end p99 step ms", end.step_p99_ms, bounds.max_p99_step_ms)
    return violations


def _kv(metrics: JsonObject | None, name: str) -> int:
    return int(((metrics or {}).get("kv_transfer") or {}).get(name, 0))


def _diff(a: float | None, b: float | None, unit: float = 1.0) -> float | None:
    return None if a is None or b is None else (a - b) / unit
