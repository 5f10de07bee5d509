"""A recorded connector's stats and Prometheus metrics, as they pass through the wrapper.

vLLM's front end calls build_kv_connector_stats and build_prom_metrics on the class named in the
outer config (the wrapper), with a stats dict only, in a process where no connector exists. So
the wrapper's stats (RecordingStats) carry the inner connector's name in their dict, and the
class hooks below rebuild the inner connector's stats and metrics from it. Everything else about
the stats is the inner connector's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvport.vllm.compat import require_vllm
from kvport.vllm.recording_inner import inner_class, inner_vllm_config, resolve

require_vllm()

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

STATS_KEY = "kvport_recorded_connector"  # RecordingStats.to_dict(): the inner connector's name


def stats_ref(ktc: KVTransferConfig) -> dict[str, Any]:
    """What names the inner connector in a RecordingStats dict."""
    return {"kv_connector": ktc.kv_connector,
            "kv_connector_module_path": ktc.kv_connector_module_path}


class RecordingStats(KVConnectorStats):
    """The inner connector's stats, whose dict also names the inner connector."""

    def __init__(self, inner: KVConnectorStats, ref: dict[str, Any]) -> None:
        super().__init__(data={})
        self.inner = inner
        self.ref = ref

    def to_dict(self) -> dict[str, Any]:
        return {STATS_KEY: self.ref, "stats": self.inner.to_dict()}

    def reset(self) -> None:
        self.inner.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        inner = other.inner if isinstance(other, RecordingStats) else other
        return RecordingStats(self.inner.aggregate(inner), self.ref)

    def reduce(self) -> dict[str, int | float]:
        return self.inner.reduce()

    def is_empty(self) -> bool:
        return self.inner.is_empty()


def _split_stats_dict(data: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
    """(the inner connector's reference or None, its stats dict) of a RecordingStats dict."""
    if isinstance(data, dict) and STATS_KEY in data:
        return data[STATS_KEY], data.get("stats")
    return None, data


class RecordingPromMetrics(KVConnectorPromMetrics):
    """The inner connector's Prometheus metrics, fed the inner part of RecordingStats' dicts."""

    def __init__(self, inner: KVConnectorPromMetrics, vllm_config: VllmConfig,
                 metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.inner = inner

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.inner.observe(_split_stats_dict(transfer_stats_data)[1], engine_idx)


def rebuild_stats(data: dict[str, Any] | None = None) -> KVConnectorStats | None:
    """The inner connector's stats from a RecordingStats dict; None from any other dict (it
    cannot say whose stats it holds)."""
    ref, inner_data = _split_stats_dict(data)
    if ref is None:
        return None
    return inner_class(KVTransferConfig(kv_role="kv_both", **ref)).build_kv_connector_stats(
        inner_data)


def prom_metrics(vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
    """The inner class's metrics (None if it has none), fed the inner stats."""
    cls, inner, _ = resolve(vllm_config.kv_transfer_config)
    metrics = cls.build_prom_metrics(inner_vllm_config(vllm_config, inner), metric_types,
                                     labelnames, per_engine_labelvalues)
    if metrics is None:
        return None
    return RecordingPromMetrics(metrics, vllm_config, metric_types, labelnames,
                                per_engine_labelvalues)
