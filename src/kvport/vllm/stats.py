"""kvport's connector metrics in vLLM's logs ("KV Transfer metrics: ...") and on the Prometheus
endpoint of `vllm serve` (`/metrics`): vLLM's own `vllm:kv_offload_*` names where the meaning is
the same, `vllm:kvport_*` for the rest (metric_names.py).

The scheduler half holds every number: its own (hits by tier, evictions, occupancy, decisions)
and the workers' cumulative tier counters, which reach it with each step's worker metadata. The
scheduler-side connector therefore reports the interval's increase of each counter (the current
value of each gauge, and the interval's single measurements of each histogram) from
`get_kv_connector_stats`; vLLM adds that to the workers' stats (kvport's workers report none),
sums it over the logging interval with `aggregate`, logs `reduce()`, and hands each step's
numbers to `KvportPromMetrics.observe`.
"""

from __future__ import annotations

from typing import Any

from kvport.connectors.offloading.metrics import ConnectorMetrics
from kvport.vllm.compat import require_vllm
from kvport.vllm.metric_names import DOC, HISTOGRAM, METRICS, OBSERVATIONS

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics, KVConnectorStats,
)

_GAUGES = {m.key for m in METRICS if m.gauge}


def flatten(metrics: ConnectorMetrics) -> dict[str, float]:
    """The numbers METRICS names, from the scheduler half's record (tiers not configured are
    absent; histograms come from observations, `with_observations`)."""
    out: dict[str, float] = {}
    for m in METRICS:
        if m.kind == HISTOGRAM:
            continue
        section = getattr(metrics, m.path[0])
        if section is not None:
            out[m.key] = float(getattr(section, m.path[1]))
    return out


def with_observations(data: dict[str, Any], observations: dict[str, list[float]],
                      ) -> dict[str, Any]:
    """`data` and the interval's single measurements (a list under "obs.<name>")."""
    return {**data, **{f"{OBSERVATIONS}.{name}": values
                       for name, values in observations.items() if values}}


class StatsDelta:
    """Turns cumulative counters into per-interval increases (gauges pass through)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, current: dict[str, float]) -> dict[str, float]:
        out = {k: v if k in _GAUGES else v - self._last.get(k, 0.0) for k, v in current.items()}
        self._last = dict(current)
        return {k: v for k, v in out.items() if v or k in _GAUGES}


class KvportStats(KVConnectorStats):
    """`data`: flat metric key -> increase in the interval (gauges: the latest value;
    histograms: the interval's measurements, a list)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvportStats:
        data = dict(self.data)
        for key, value in other.data.items():
            if isinstance(value, list):
                data[key] = [*data.get(key, []), *value]
            else:
                data[key] = value if key in _GAUGES else data.get(key, 0.0) + value
        return KvportStats(data=data)

    def reduce(self) -> dict[str, int | float]:
        """For the log line: sums and levels, and each histogram's count and mean."""
        out: dict[str, int | float] = {}
        for key, value in sorted(self.data.items()):
            if isinstance(value, list):
                out[key + ".count"] = len(value)
                out[key + ".mean"] = round(sum(value) / len(value), 6) if value else 0.0
            else:
                out[key] = round(value, 6)
        return out

    def is_empty(self) -> bool:
        return not any(value for key, value in self.data.items() if key not in _GAUGES)


class KvportPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter, gauge or histogram per name, labelled by engine and by tier,
    source, outcome or kind (metric_names.METRICS)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for m in METRICS:
            if m.name in self._families:
                continue
            extra = [k for k, _ in m.labels]
            if m.kind == HISTOGRAM:
                self._families[m.name] = self._histogram_cls(
                    name=m.name, documentation=DOC[m.name], labelnames=labelnames + extra,
                    buckets=list(m.buckets))
                continue
            cls = self._gauge_cls if m.gauge else self._counter_cls
            self._families[m.name] = cls(name=m.name, documentation=DOC[m.name],
                                         labelnames=labelnames + extra)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = self.per_engine_labelvalues[engine_idx]
        for m in METRICS:
            value = transfer_stats_data.get(m.key)
            if value is None:
                continue
            metric = self._families[m.name].labels(*base, *[v for _, v in m.labels])
            if m.kind == HISTOGRAM:
                for one in value:
                    metric.observe(one)
            elif m.gauge:
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
