"""kvport's connector counters in vLLM's logs ("KV Transfer metrics: ...") and on the
Prometheus endpoint of `vllm serve` (`/metrics`, names `vllm:kvport_*`).

The scheduler half holds every number: its own (hits by tier, evictions, occupancy, failed jobs)
and the workers' cumulative tier counters, which reach it with each step's worker metadata. The
scheduler-side connector therefore reports the interval's increase of each counter (and the
current value of each gauge) from `get_kv_connector_stats`; vLLM adds that to the workers' stats
(kvport's workers report none), sums it over the logging interval with `aggregate`, logs
`reduce()`, and hands each step's numbers to `KvportPromMetrics.observe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvport.connectors.offloading.metrics import ConnectorMetrics
from kvport.vllm.compat import require_vllm

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics, KVConnectorStats,
)


@dataclass(frozen=True)
class Metric:
    # (section, field) of ConnectorMetrics (a record of its own, or a tier's, which may be
    # absent); a test resolves every path against the records' fields.
    path: tuple[str, str]
    name: str  # Prometheus name
    labels: tuple[tuple[str, str], ...]
    gauge: bool = False  # a level: the latest value, not a sum

    @property
    def key(self) -> str:
        """Its key in the stats dict vLLM carries between processes."""
        return ".".join(self.path)


def _m(key: str, name: str, gauge: bool = False, **labels: str) -> Metric:
    section, _, field_name = key.partition(".")
    return Metric((section, field_name), f"vllm:kvport_{name}", tuple(labels.items()), gauge)


METRICS = (
    _m("requests.num_queried_tokens", "queried_tokens_total"),
    _m("host.hit_tokens", "hit_tokens_total", tier="host"),
    _m("disk.hit_tokens", "hit_tokens_total", tier="disk"),
    _m("host.bytes_stored", "transfer_bytes_total", tier="host", direction="store"),
    _m("host.bytes_loaded", "transfer_bytes_total", tier="host", direction="load"),
    _m("disk.bytes_stored", "transfer_bytes_total", tier="disk", direction="store"),
    _m("disk.bytes_loaded", "transfer_bytes_total", tier="disk", direction="load"),
    _m("host.store_seconds", "transfer_seconds_total", tier="host", direction="store"),
    _m("host.load_seconds", "transfer_seconds_total", tier="host", direction="load"),
    _m("disk.store_seconds", "transfer_seconds_total", tier="disk", direction="store"),
    _m("disk.load_seconds", "transfer_seconds_total", tier="disk", direction="load"),
    _m("host.evictions", "evicted_blocks_total", tier="host"),
    _m("disk.evictions", "evicted_blocks_total", tier="disk"),
    _m("requests.num_failed_loads", "failures_total", kind="load"),
    _m("requests.num_failed_stores", "failures_total", kind="store"),
    _m("disk.failures", "failures_total", kind="disk_io"),
    _m("disk.skipped_stores", "skipped_stores_total", tier="disk"),
    _m("requests.num_inflight_waits", "inflight_wait_answers_total"),
    _m("requests.num_inflight_timeouts", "inflight_wait_timeouts_total"),
    # Lower-tier I/O past its deadline (load_timeout_s, write_timeout_s): given up on.
    _m("worker.num_late_loads", "late_jobs_total", kind="load"),
    _m("worker.num_late_writes", "late_jobs_total", kind="write"),
    _m("worker.num_replaced_threads", "replaced_threads_total"),
    _m("host.occupancy_bytes", "occupancy_bytes", gauge=True, tier="host"),
    _m("disk.occupancy_bytes", "occupancy_bytes", gauge=True, tier="disk"),
    # The Redis tier: the same families, plus what only a network store has.
    _m("redis.hit_tokens", "hit_tokens_total", tier="redis"),
    _m("redis.bytes_stored", "transfer_bytes_total", tier="redis", direction="store"),
    _m("redis.bytes_loaded", "transfer_bytes_total", tier="redis", direction="load"),
    _m("redis.store_seconds", "transfer_seconds_total", tier="redis", direction="store"),
    _m("redis.load_seconds", "transfer_seconds_total", tier="redis", direction="load"),
    _m("redis.failures", "failures_total", kind="redis_load"),
    _m("redis.skipped_stores", "skipped_stores_total", tier="redis"),
    _m("redis.lookup_keys_queried", "redis_lookup_keys_total", result="queried"),
    _m("redis.lookup_keys_found", "redis_lookup_keys_total", result="found"),
    _m("redis.round_trips", "redis_round_trips_total", side="worker"),
    _m("redis.lookup_round_trips", "redis_round_trips_total", side="scheduler"),
    _m("redis.timeouts", "redis_problems_total", kind="timeout", side="worker"),
    _m("redis.lookup_timeouts", "redis_problems_total", kind="timeout", side="scheduler"),
    _m("redis.errors", "redis_problems_total", kind="error", side="worker"),
    _m("redis.lookup_errors", "redis_problems_total", kind="error", side="scheduler"),
    _m("redis.skipped_down", "redis_problems_total", kind="down", side="worker"),
    _m("redis.lookup_skipped_down", "redis_problems_total", kind="down", side="scheduler"),
    _m("redis.vanished", "redis_problems_total", kind="vanished", side="worker"),
    _m("redis.corrupt", "redis_problems_total", kind="corrupt", side="worker"),
    _m("redis.refused_stores", "redis_problems_total", kind="refused", side="worker"),
)
_GAUGES = {m.key for m in METRICS if m.gauge}
_DOC = {
    "queried_tokens_total": "Prompt tokens beyond the engine's own prefix hit asked of kvport.",
    "hit_tokens_total": "Prompt tokens kvport loaded, by the tier they came from.",
    "transfer_bytes_total": "Bytes kvport moved, by tier and direction.",
    "transfer_seconds_total": "Seconds kvport's copies and file I/O took, by tier and direction.",
    "evicted_blocks_total": "Offload blocks evicted, by tier.",
    "failures_total": "Failed loads, stores, disk I/O and Redis loads.",
    "skipped_stores_total": "Stores skipped: the tier was full, or Redis down or refusing.",
    "redis_lookup_keys_total": "Keys the scheduler asked Redis about, and those it held.",
    "redis_round_trips_total": "Pipelined round trips to Redis, by side.",
    "redis_problems_total": "Redis timeouts, errors, calls skipped while down, keys vanished "
                            "before their load, corrupt values deleted, writes refused.",
    "inflight_wait_answers_total": "Times a request was told to ask again because another "
                                   "request was writing its next blocks to host memory.",
    "inflight_wait_timeouts_total": "Requests that reached inflight_wait_s (counted from their "
                                    "first wait) and computed the blocks still being written.",
    "late_jobs_total": "Loads and write-throughs from or to disk or Redis given up after "
                       "load_timeout_s or write_timeout_s (a late load's blocks are recomputed).",
    "replaced_threads_total": "Transfer threads started in place of threads stuck in I/O.",
    "occupancy_bytes": "Bytes held, by tier.",
}


def flatten(metrics: ConnectorMetrics) -> dict[str, float]:
    """The numbers METRICS names, from the scheduler half's record (tiers not configured are
    absent)."""
    out: dict[str, float] = {}
    for m in METRICS:
        section = getattr(metrics, m.path[0])
        if section is not None:
            out[m.key] = float(getattr(section, m.path[1]))
    return out


class StatsDelta:
    """Turns cumulative counters into per-interval increases (gauges pass through)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, current: dict[str, float]) -> dict[str, float]:
        out = {k: v if k in _GAUGES else v - self._last.get(k, 0.0) for k, v in current.items()}
        self._last = dict(current)
        return {k: v for k, v in out.items() if v or k in _GAUGES}


class KvportStats(KVConnectorStats):
    """`data`: flat metric key -> increase in the interval (gauges: the latest value)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvportStats:
        data = dict(self.data)
        for key, value in other.data.items():
            data[key] = value if key in _GAUGES else data.get(key, 0.0) + value
        return KvportStats(data=data)

    def reduce(self) -> dict[str, int | float]:
        return {key: round(value, 6) for key, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(value for key, value in self.data.items() if key not in _GAUGES)


class KvportPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter or gauge per name, labelled by engine and by tier, direction or
    kind (METRICS)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for m in METRICS:
            if m.name in self._families:
                continue
            cls = self._gauge_cls if m.gauge else self._counter_cls
            extra = [k for k, _ in m.labels]
            short = m.name.removeprefix("vllm:kvport_")
            self._families[m.name] = cls(name=m.name, documentation=_DOC[short],
                                         labelnames=labelnames + extra)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = self.per_engine_labelvalues[engine_idx]
        for m in METRICS:
            value = transfer_stats_data.get(m.key)
            if value is None:
                continue
            metric = self._families[m.name].labels(*base, *[v for _, v in m.labels])
            if m.gauge:
                metric.set(value)
            elif value > 0:
                metric.inc(value)


def offloading_metrics(metrics: object) -> ConnectorMetrics | None:
    """The OffloadingConnector's record: the connector's own, or a MultiConnector child's."""
    if isinstance(metrics, ConnectorMetrics):
        return metrics
    if isinstance(metrics, dict):
        return next((m for m in metrics.values() if isinstance(m, ConnectorMetrics)), None)
    return None
