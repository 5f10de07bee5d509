"""OffloadingConnector: tiered KV offload to host memory and, below it, local disk and Redis.

Configuration (`kv_connector_extra_config`, vLLM's names; see config.OffloadingConfig):
    cpu_bytes_to_use   host tier size in bytes (required)
    block_size         offload block in tokens (a multiple of the engine's; default: its block)
    eviction_policy    "lru" (default) or "arc"
    sync_host_loads    host-only hits copied before the step's forward (default true)
    inflight_wait_s    how long a hit waits for keys another request is writing to host memory
                       (default 1.0; 0: it computes them at once)
    sync_write_through a step ends once its stores are written through to disk and Redis
                       (default: on for kv_producer, the prefill instance of a split)
    store_threshold    store a block only after it was looked up this many times (0: always)
    secondary_tiers    [{"type": "disk", "root_dir": PATH, "max_bytes": N},
                        {"type": "redis", "url": "redis://127.0.0.1:6379/0", ...}]

This class only routes the API to the half its role builds: `scheduler.half.OffloadingScheduler`
(hits, job planning, held blocks) or `worker.half.OffloadingConnectorWorker` (transfers). Each
half gets the same `geometry.OffloadGeometry`, built from (config, KVCacheSpec) once the spec is
known, and reads the engine's facts (KVCacheSpec.engine) from it: with tensor parallelism every
worker keeps its shard in its own share of the budgets; an engine that stops stepping when idle
(vLLM) gets its stores copied within their step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvport.connectors.base import (
    ForwardContext, KVCacheEvent, KVCacheSpec, KVConnectorBase, KVConnectorOutput,
    KVConnectorRole,
)
from kvport.connectors.factory import parse_extra_config
from kvport.connectors.hma import SupportsHMA
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.metadata import (
    OffloadingConnectorMetadata, OffloadingWorkerMetadata,
)
from kvport.connectors.offloading.metrics import ConnectorMetrics
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler
from kvport.connectors.offloading.worker.half import OffloadingConnectorWorker

if TYPE_CHECKING:
    from kvport.config import KVTransferConfig
    from kvport.connectors.views import RequestView, SchedulerOutputView


class OffloadingConnector(KVConnectorBase, SupportsHMA):
    """Declares SupportsHMA: a hybrid model's KV cache groups are offloaded each under its own
    keys (geometry.py), a hit is one every group can load (scheduler/group_hits.py)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.offloading_config = parse_extra_config(OffloadingConfig, config)
        if self.offloading_config.sync_write_through is None:
            # a producer's answer must come after what it stored can be found (config.py)
            self.offloading_config = dataclasses.replace(
                self.offloading_config, sync_write_through=config.kv_role == "kv_producer")
        self._scheduler: OffloadingScheduler | None = None  # built by set_kv_cache_spec
        self._worker = (self.make_worker(self.offloading_config)
                        if role == KVConnectorRole.WORKER else None)

    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        """The worker half (a seam: tests build one with faulty or controlled transfers)."""
        return OffloadingConnectorWorker(config)

    def make_scheduler(self, config: OffloadingConfig, geometry: OffloadGeometry, load: bool,
                       store: bool, spec: KVCacheSpec) -> OffloadingScheduler:
        """The scheduler half (a seam: tests build variants of it)."""
        return OffloadingScheduler(config, geometry, load=load, store=store,
                                   num_workers=spec.engine.tp_size,
                                   sync_stores=spec.engine.stops_when_idle,
                                   events=spec.engine.kv_events)

    def shares_storage(self) -> bool:
        """Disk and Redis entries are read by other processes and outlive this one."""
        return bool(self.offloading_config.tiers)

    def holds_only_what_it_was_handed(self) -> bool:
        """A host tier alone: this process's memory, empty at start."""
        return not self.offloading_config.tiers

    def storage_namespace(self) -> str | None:
        return self.offloading_config.namespace

    def _rank_config(self, spec: KVCacheSpec) -> OffloadingConfig:
        return self.offloading_config.per_rank(spec.engine.tp_size)

    # ---- scheduler side ---------------------------------------------------------------------

    def set_kv_cache_spec(self, spec: KVCacheSpec) -> None:
        role = self._config.kv_role  # kv_both, or only loads (consumer) or stores (producer)
        config = self._rank_config(spec)
        if spec.engine.load_failures_per_request and config.sync_host_loads:
            # The engine could not take a failed synchronous load (EngineInfo).
            config = dataclasses.replace(config, sync_host_loads=False)
        self._scheduler = self.make_scheduler(config, OffloadGeometry.build(config, spec),
                                              load=role != "kv_producer",
                                              store=role != "kv_consumer", spec=spec)

    @property
    def scheduler_half(self) -> OffloadingScheduler:
        assert self._scheduler is not None, "OffloadingConnector: set_kv_cache_spec was not called"
        return self._scheduler

    @property
    def worker_half(self) -> OffloadingConnectorWorker:
        assert self._worker is not None, "OffloadingConnector: not the worker half"
        return self._worker

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int] | tuple[list[int], ...],
        num_external_tokens: int,
    ) -> None:
        self.scheduler_half.update_state_after_alloc(request, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(self, request: RequestView,
                                       num_external_tokens: int) -> dict[str, int]:
        """Host hits as "HOST", hits promoted from disk as "DISK", from Redis as "REDIS"."""
        return self.scheduler_half.take_hit_split(request.request_id)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutputView,
    ) -> OffloadingConnectorMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_half.update_connector_output(connector_output)

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while the request's stores (or a late synchronous load) still read or write its
        blocks: the worker reports it in finished_sending when they stopped."""
        return self.scheduler_half.request_finished(request), None

    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` for every KV cache group (the same blocks are held or not)."""
        return self.scheduler_half.request_finished(request), None

    def take_observations(self) -> dict[str, list[float]]:
        """The scheduler half's single measurements since the last call (lookup latency per
        tier, transfer sizes: scheduler/decisions.py), for histograms."""
        return self.scheduler_half.observations.take()

    def take_events(self) -> list[KVCacheEvent]:
        return self.scheduler_half.take_events()

    def has_pending_work(self) -> bool:
        return self.scheduler_half.has_pending_work()

    def reset_cache(self) -> bool | None:
        """Drops the host tier, not disk or Redis (other engines may share them).
        False while host blocks are being read or written."""
        return self.scheduler_half.reset_cache()

    def get_metrics(self) -> ConnectorMetrics:
        """Cumulative counters per tier."""
        return self.scheduler_half.metrics()

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        config = self._rank_config(spec)
        self.worker_half.register_kv_caches(kv_cache, OffloadGeometry.build(config, spec),
                                            spec.engine)

    def handle_preemptions(self, metadata: Any) -> None:
        self.worker_half.handle_preemptions(_checked(metadata))

    def start_load_kv(self, ctx: ForwardContext) -> None:
        self.worker_half.start_load_kv(_checked(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: a load completes before its request is scheduled (all loads are async)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """No-op: stores copy whole blocks (every layer at once) after the forward."""

    def wait_for_save(self) -> None:
        """No-op: stores are queued in get_finished, which runs every step."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self.worker_half.get_finished(_checked(meta) if meta is not None else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.get_block_ids_with_load_errors()

    def get_failed_load_req_ids(self) -> set[str]:
        return self.worker_half.get_failed_load_req_ids()

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        return self.worker_half.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()


def _checked(metadata: Any) -> OffloadingConnectorMetadata:
    if not isinstance(metadata, OffloadingConnectorMetadata):
        raise TypeError(f"OffloadingConnector: expected OffloadingConnectorMetadata, got "
                        f"{type(metadata).__name__}")
    return metadata
