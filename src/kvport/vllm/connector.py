"""kvport's connectors as vLLM KV connectors: one vLLM class that holds a kvport connector of its
role and translates vLLM's objects, so every kvport connector runs inside vLLM.

    {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm", ...}
    (or ExampleConnector, MultiConnector, NoOpConnector: `kv_connector_extra_config` is the
    kvport connector's own, docs/offloading.md and docs/connectors.md)

What is translated, and where:
- requests and scheduler output into kvport's views (objects.py); a resumed request counts as
  new, with its whole block table, as in kvport's engine;
- vLLM's layer-major KV caches into kvport's pool layout, a strided view of the same memory
  (objects.kvport_view), and vLLM's layer names into kvport's ("layers.<i>");
- the per-step metadata and worker metadata into vLLM's classes (metadata.py), carrying the
  step's facts the worker's ForwardContext needs;
- the KVCacheSpec (storage.py): vLLM's geometry, tensor parallelism, and vLLM's habits (it stops
  stepping when idle; it keeps a failed synchronous load's blocks cached), from which a kvport
  connector decides its own behaviour; a hash root that names the model where stored KV is
  shared with other engines (vLLM's block hashes do not), and with it vLLM's load-failure
  policy set to "recompute";
- events into vLLM's BlockStored / BlockRemoved, hit sources into CacheHitSource, the
  OffloadingConnector's metrics into vLLM's stats (stats.py).

`requires_kv_delivery` is False: a lost store is a later miss, not an error.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from kvport.config import KVTransferConfig
from kvport.connectors import base
from kvport.connectors.factory import create_connector
from kvport.vllm.compat import refuse_device, require_vllm
from kvport.vllm.events import group_kinds, hit_sources, vllm_events
from kvport.vllm.metadata import VllmMetadata, VllmWorkerMetadata, inner_metadata
from kvport.connectors.hma import SupportsHMA as SupportsHMAKvport
from kvport.connectors.hma import supports_hma
from kvport.vllm.groups import vllm_groups
from kvport.vllm.objects import (
    RequestAdapter, adapt_scheduler_output, hashes_are_stable, kvport_view, tables,
)
from kvport.vllm.stats import (
    KvportPromMetrics, KvportStats, StatsDelta, flatten, offloading_metrics, with_observations,
)
from kvport.vllm.storage import kvport_spec, recompute_failed_loads
from kvport.vllm.versions import CacheHitSource

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults,
    SupportsHMA,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
REQUIRED_LAYOUT = "LBHNC"  # vLLM's KVCacheLayout name (vllm/v1/kv_cache_layout.py)


class KvportConnector(KVConnectorBase_V1):
    """A kvport connector (`kvport_name`) inside vLLM; subclasses name one."""

    kvport_name: ClassVar[str] = ""
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        where = f"kvport.vllm {self.kvport_name}"
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None and self.kvport_name, "the base class checked the config"
        extra = dict(ktc.kv_connector_extra_config or {})
        if "record_trace" in extra:  # kvport's engine records it; inside vLLM, the wrapper does
            raise ValueError(
                f"{where}: kv_connector_extra_config key 'record_trace' is kvport's engine's "
                f"call recorder, which does not run inside vLLM; remove it, and record with "
                f"kvport.vllm's RecordingConnector around this connector: "
                f'{{"kv_connector": "RecordingConnector", "kv_connector_module_path": '
                f'"kvport.vllm", "kv_role": ..., "kv_connector_extra_config": {{"record_trace": '
                f'"trace.jsonl", "connector": {{"kv_connector": "{self.kvport_name}", '
                f'"kv_connector_module_path": "kvport.vllm", "kv_connector_extra_config": '
                f'{{...without record_trace...}}}}}}}}')
        refuse_device(str(getattr(vllm_config.device_config, "device_type", None) or "cpu"), where)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(f"{where}: pipeline parallelism (pipeline_parallel_size="
                             f"{parallel.pipeline_parallel_size}) is not supported; use tensor "
                             f"parallelism")
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self.inner = create_connector(
            KVTransferConfig(self.kvport_name, kv_role=ktc.kv_role,
                             kv_connector_extra_config=extra),
            base.KVConnectorRole.SCHEDULER if is_scheduler else base.KVConnectorRole.WORKER)
        num_groups = len(kv_cache_config.kv_cache_groups)
        if num_groups != 1 and not (isinstance(self, SupportsHMA) and supports_hma(self.inner)):
            raise ValueError(f"{where}: the model has {num_groups} KV cache groups (a hybrid "
                             f"model) and this connector handles one; run vLLM with "
                             f"--disable-hybrid-kv-cache-manager")
        self._groups = vllm_groups(kv_cache_config, where)
        self._block_size = self._groups.block_size
        self._group_kinds = group_kinds(kv_cache_config) if is_scheduler else []
        shares = self.inner.shares_storage()
        if shares:
            algo = vllm_config.cache_config.prefix_caching_hash_algo
            if not hashes_are_stable(algo):
                raise ValueError(
                    f"{where}: its stored KV is shared with other processes, but vLLM's "
                    f"prefix_caching_hash_algo={algo!r} seeds block hashes at random in every "
                    f"process, so no other process would ever hit its entries; use "
                    f"--prefix-caching-hash-algo sha256 (vLLM's default) or set PYTHONHASHSEED")
            if is_scheduler:  # vLLM reads the policy right after this
                recompute_failed_loads(ktc, where)
        self._spec = kvport_spec(vllm_config, kv_cache_config, self._groups,
                                 0 if is_scheduler else _tp_rank(),
                                 self.inner.storage_namespace(), shares, where)
        if is_scheduler:
            self.inner.set_kv_cache_spec(self._spec)
        self._layers = self._groups.layer_index
        self._kv_view: torch.Tensor | None = None  # set by register_kv_caches
        self._layer_views: list[torch.Tensor] = []
        self._ctx: base.ForwardContext | None = None  # the bound step's
        self._step = 0
        self._stats_delta = StatsDelta()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: False. A worker keeps views of the KV caches and copies from them on
        its own threads; following a remap of their memory is not implemented."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LBHNC, as vLLM's own OffloadingConnector asks: each layer's pages one run per
        block. On vLLM's CPU build it is the only layout the backend supports, so nothing
        changes there; the layout vLLM resolved names the disk namespace (storage.py)."""
        return REQUIRED_LAYOUT

    def may_load_async(self, request: Request) -> bool:
        """vLLM >= 0.34 (with --max-num-inflight-kv-loads): False. Whether a hit loads
        asynchronously is known only from the lookup (host hits load synchronously; a disk or
        Redis run asynchronously), too costly for every enqueue, and a wrong True holds back
        other requests' async loads; the base's answer is a prefill/decode flag
        (do_remote_prefill) kvport's connectors do not serve."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache, not a hand-off; a store lost to a preemption is a later miss."""
        return False

    def _view(self, request: Request) -> RequestAdapter:
        return RequestAdapter(request, self._block_size)

    # ---- scheduler side --------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self.inner.on_new_request(self._view(request))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.inner.get_num_new_matched_tokens(self._view(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(
            self._view(request), tables(blocks.get_block_ids(), self._groups.num_groups),
            num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The kvport connector's sources: host hits as HOST, disk as DISK, Redis as
        EXTERNAL_UNSPECIFIED (vLLM has no source for a remote store)."""
        sources = hit_sources(self.inner.get_external_cache_hit_sources(
            self._view(request), num_external_tokens))
        if sum(sources.values()) != num_external_tokens:  # vLLM then reports it unspecified
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> VllmMetadata:
        view = adapt_scheduler_output(scheduler_output, self._step, self._groups.num_groups)
        self._step += 1
        return VllmMetadata(self.inner.build_connector_meta(view), view.step,
                            view.num_scheduled_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        assert meta is None or isinstance(meta, VllmWorkerMetadata), \
            f"not kvport's worker metadata: {meta!r}"
        self.inner.update_connector_output(base.KVConnectorOutput(
            finished_sending=set(connector_output.finished_sending or ()),
            finished_recving=set(connector_output.finished_recving or ()),
            invalid_block_ids=set(connector_output.invalid_block_ids or ()),
            worker_meta=meta.inner if meta is not None else None))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.inner.request_finished(self._view(request), list(block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call for a SupportsHMA connector (a subclass declares it where its kvport
        connector does)."""
        inner = cast(SupportsHMAKvport, self.inner)
        return inner.request_finished_all_groups(self._view(request),
                                                 tuple(list(ids) for ids in block_ids))

    def take_events(self) -> Iterable[KVCacheEvent]:
        return vllm_events(self.inner.take_events(), self._group_kinds)

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM's engine-core loop stepping while the connector has work in flight."""
        return self.inner.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self.inner.reset_cache()

    # ---- stats (vLLM calls get_kv_connector_stats on both sides, every step) -----------------

    def get_kv_connector_stats(self) -> KvportStats | None:
        """Scheduler side: the increase of the OffloadingConnector's counters since the last
        call (the workers' tier counters included: they arrive with the worker metadata); None
        for a connector without them, and on the worker side."""
        if self.role != KVConnectorRole.SCHEDULER:
            return None
        metrics = offloading_metrics(self.inner.get_metrics())
        if metrics is None:
            return None
        data: dict[str, Any] = self._stats_delta.take(flatten(metrics))
        take = getattr(self.inner, "take_observations", None)  # the OffloadingConnector's
        if take is not None:
            data = with_observations(data, take())
        stats = KvportStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvportStats:
        return KvportStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvportPromMetrics:
        return KvportPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for device in sorted({t.device.type for t in kv_caches.values()}):
            refuse_device(device, f"kvport.vllm {self.kvport_name}")
        view = kvport_view(kv_caches, self._groups.slot_layers, self._spec.num_blocks)
        self._kv_view = view
        self._layer_views = [view[:, self._spec.layer_slot(i)]
                             for i in range(self._spec.num_layers)]
        self.inner.register_kv_caches(view, self._spec)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.inner.handle_preemptions(inner_metadata(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, VllmMetadata), connector_metadata
        assert self._kv_view is not None, "kvport.vllm: register_kv_caches was not called"
        self._ctx = base.ForwardContext(self._kv_view, connector_metadata.num_scheduled_tokens,
                                        connector_metadata.step)
        self.inner.bind_connector_metadata(connector_metadata.inner)

    def clear_connector_metadata(self) -> None:
        self.inner.clear_connector_metadata()
        self._ctx = None
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.inner.start_load_kv(self._bound_ctx())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(base.layer_name(self._layers[layer_name]))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        i = self._layers[layer_name]
        self.inner.save_kv_layer(base.layer_name(i), self._layer_views[i], self._bound_ctx())

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished, and with several KV cache groups the requests whose load failed
        (vLLM 0.32 takes those per request only: it recomputes or fails the whole request)."""
        sending, recving = self.inner.get_finished(finished_req_ids)
        per_request = self._spec.engine.load_failures_per_request
        failed = self.inner.get_failed_load_req_ids() if per_request else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.inner.get_block_ids_with_load_errors()
        # With several groups the failures went out per request (get_transfer_results).
        return set() if self._spec.engine.load_failures_per_request else errors

    def build_connector_worker_meta(self) -> VllmWorkerMetadata | None:
        meta = self.inner.build_connector_worker_meta()
        return VllmWorkerMetadata(meta) if meta is not None else None

    def shutdown(self) -> None:
        self.inner.shutdown()

    def _bound_ctx(self) -> base.ForwardContext:
        assert self._ctx is not None, "kvport.vllm: no connector metadata bound in this step"
        return self._ctx


class OffloadingConnector(KvportConnector, SupportsHMA):
    """kvport's OffloadingConnector (docs/offloading.md). SupportsHMA: vLLM keeps a hybrid
    model's KV cache groups, and each is offloaded (docs/offloading.md, "KV cache groups")."""

    kvport_name = "OffloadingConnector"

    @property
    def scheduler_half(self) -> Any:
        return self.inner.scheduler_half  # type: ignore[attr-defined]

    @property
    def worker_half(self) -> Any:
        return self.inner.worker_half  # type: ignore[attr-defined]


class ExampleConnector(KvportConnector, SupportsHMA):
    """kvport's ExampleConnector: each prompt's KV in files (docs/connectors.md). SupportsHMA:
    a sliding layer's file holds its window (connectors/example_layout.py)."""

    kvport_name = "ExampleConnector"


class MultiConnector(KvportConnector):
    """kvport's MultiConnector over kvport connectors (docs/connectors.md)."""

    kvport_name = "MultiConnector"


class NoOpConnector(KvportConnector):
    """kvport's NoOpConnector: the framework's own cost."""

    kvport_name = "NoOpConnector"


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except AssertionError:  # no tensor-parallel group: a single worker
        return 0

