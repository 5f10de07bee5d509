"""RecordingConnector: any vLLM KV connector, wrapped; every call vLLM makes on it is recorded in
kvport's trace format (kvport.trace.events) and forwarded unchanged.

    kv_transfer_config={"kv_connector": "RecordingConnector",
                        "kv_connector_module_path": "kvport.vllm", "kv_role": "kv_both",
                        "kv_connector_extra_config": {
                            "record_trace": "trace.jsonl",
                            "connector": {"kv_connector": "ExampleConnector",
                                          "kv_connector_extra_config": {...}}}}

`connector` is the recorded connector's own kv_transfer_config; it is built with vLLM's connector
factory (recording_config.py: which fields it inherits; recording_inner.py: how its class is
found).

Every hook of vLLM's KVConnectorBase_V1 is forwarded to the inner connector, and what it returns
or raises reaches vLLM unchanged, except two wrappers: the stats (RecordingStats,
recording_stats.py) and, when recording, the metadata (RecordingMetadata, recording_steps.py).
Attributes the wrapper lacks are the inner connector's; class-level hooks are answered by the
inner class. Without `record_trace` the wrapper only forwards: the per-layer hooks are then the
inner connector's own bound methods. With it, each call is one record (kvport.trace.writer; the
header names "vllm", vLLM's version and the vllm-0.32 call order; recording_steps.py numbers the
steps); this module holds vLLM's hook list and the fields of each hook's record.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvport.trace.events import SCHEDULER, WORKER, TraceHeader
from kvport.trace.fields import (
    finished_result,
    kept_result,
    matched_result,
    output_fields,
    request_fields,
    sorted_ids,
)
from kvport.trace.identity import BlockLog
from kvport.trace.loaded import LOADED_MARKER
from kvport.trace.writer import TraceWriter
from kvport.vllm.compat import require_vllm
from kvport.vllm.recording_config import worker_call_order
from kvport.vllm.recording_inner import (
    DIRECT_WHEN_OFF,
    create_inner,
    kv_cache_access,
    required_kvcache_layout,
    requires_piecewise_for_cudagraph,
    supports_lookahead_block_hashes,
    supports_sleep_mode,
)
from kvport.vllm.recording_kv import LoadChecks
from kvport.vllm.recording_stats import RecordingStats, prom_metrics, rebuild_stats, stats_ref
from kvport.vllm.recording_steps import CallRecorder, group_tables, load_fields, transfer_result

vllm = require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request



def _kind(out: Any) -> str | None:
    return None if out is None else type(out).__name__


def _as_is(out: Any) -> Any:
    return out


class RecordingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._inner, inner_ktc, spec = create_inner(vllm_config, role, kv_cache_config)
        self._stats_ref = stats_ref(inner_ktc)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._blocks = BlockLog(self._describe)  # the requests' blocks, for the claim rules
        writer = None
        if spec.record_trace is not None:
            writer = TraceWriter(
                spec.record_trace, SCHEDULER if role == KVConnectorRole.SCHEDULER else WORKER,
                spec.name or type(self._inner).__name__,
                TraceHeader("vllm", str(vllm.__version__), worker_call_order(vllm_config),
                            spec.sees_all_stores))
        else:  # a hook this vLLM's base class lacks (0.31 has no get_loaded_kv_cache_group_ids)
            for name in DIRECT_WHEN_OFF:  # stays the wrapper's own, which nothing calls
                if hasattr(self._inner, name):
                    setattr(self, name, getattr(self._inner, name))
        self._rec = CallRecorder(writer)
        one_group = len(kv_cache_config.kv_cache_groups) == 1
        self._loads = LoadChecks(writer is not None and spec.check_loads and one_group,
                                 self._block_size, self._num_blocks, self._blocks.hashes)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the inner connector's own attributes
        # (MultiConnector's sub_connectors, kvport's scheduler_half, ...).
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        path = self._rec.writer.path if self._rec.writer is not None else None
        return f"RecordingConnector({self._inner!r}, record_trace={path!r})"

    @property
    def inner(self) -> KVConnectorBase_V1:
        return self._inner

    @property
    def recording(self) -> bool:
        return self._rec.writer is not None

    def _describe(self, request: Request) -> tuple[Any, Any, str | None, str | None, int]:
        """What trace_blocks records of a vLLM request: its block hashes (vLLM's, over its
        tokens, cache_salt, LoRA and multimodal keys), tokens, salt, LoRA and block size."""
        lora = getattr(request, "lora_request", None)
        return (request.block_hashes, request.all_token_ids,
                getattr(request, "cache_salt", None),
                getattr(lora, "lora_name", None) if lora is not None else None,
                self._block_size)

    # ---- properties and class-level hooks: the inner connector's ------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    # vLLM calls these on the class named in the config: the inner class answers.
    get_required_kvcache_layout = staticmethod(required_kvcache_layout)
    requires_piecewise_for_cudagraph = staticmethod(requires_piecewise_for_cudagraph)
    supports_sleep_mode = staticmethod(supports_sleep_mode)  # vLLM >= 0.33
    kv_cache_access = staticmethod(kv_cache_access)  # vLLM >= 0.34
    supports_lookahead_block_hashes = staticmethod(supports_lookahead_block_hashes)  # >= 0.34
    build_kv_connector_stats = staticmethod(rebuild_stats)
    build_prom_metrics = staticmethod(prom_metrics)

    # ---- worker side --------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        return self._rec.call("get_mem_pool_context", self._inner.get_mem_pool_context,
                              summary=_kind)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._loads.registered(kv_caches)
        return self._rec.call("register_kv_caches", self._inner.register_kv_caches, kv_caches,
                              fields={"ints": [self._num_blocks, self._block_size, len(kv_caches)]})

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        return self._rec.call("set_host_xfer_buffer_ops", self._inner.set_host_xfer_buffer_ops,
                              copy_operation)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        inner = self._rec.received(kv_connector_metadata)
        return self._rec.call("handle_preemptions", self._inner.handle_preemptions, inner)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Bound on the wrapper too: vLLM asks the connector it holds (has_connector_metadata
        # gates the per-layer hooks), and start_load_kv reads the step's facts from it.
        super().bind_connector_metadata(connector_metadata)
        inner = self._rec.received(connector_metadata)
        return self._rec.call("bind_connector_metadata", self._inner.bind_connector_metadata,
                              inner)

    def clear_connector_metadata(self) -> None:
        self._rec.note(LOADED_MARKER, self._loads.records())
        try:
            return self._rec.call("clear_connector_metadata", self._inner.clear_connector_metadata)
        finally:
            super().clear_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return self._rec.call("has_connector_metadata", self._inner.has_connector_metadata,
                              summary=bool)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return self._rec.call("start_load_kv", self._inner.start_load_kv, forward_context,
                              fields=load_fields(self._connector_metadata), **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return self._rec.call("wait_for_layer_load", self._inner.wait_for_layer_load, layer_name,
                              fields={"layer": layer_name})

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return self._rec.call("save_kv_layer", self._inner.save_kv_layer, layer_name, kv_layer,
                              attn_metadata, fields={"layer": layer_name}, **kwargs)

    def wait_for_save(self) -> None:
        return self._rec.call("wait_for_save", self._inner.wait_for_save)

    def finish_forward(self) -> None:
        return self._rec.call("finish_forward", self._inner.finish_forward)

    def reset_capture_state(self) -> None:
        return self._rec.call("reset_capture_state", self._inner.reset_capture_state)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self._rec.call("get_finished", self._inner.get_finished, finished_req_ids,
                              fields={"req_ids": sorted_ids(finished_req_ids)},
                              summary=finished_result)
        self._loads.finished(self._connector_metadata, done[1] if done else None)
        return done

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Recorded as kvport's get_finished (the checker knows that name)."""
        out = self._rec.call("get_finished", self._inner.get_transfer_results, finished_req_ids,
                             fields={"req_ids": sorted_ids(finished_req_ids)},
                             summary=transfer_result)
        self._loads.finished(self._connector_metadata, out.finished_recving)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = self._rec.call("get_block_ids_with_load_errors",
                                self._inner.get_block_ids_with_load_errors, summary=sorted)
        self._loads.load_errors(failed or ())
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self._rec.call("get_kv_connector_stats", self._inner.get_kv_connector_stats)
        return None if stats is None else RecordingStats(stats, self._stats_ref)

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self._rec.call("get_kv_connector_kv_cache_events",
                              self._inner.get_kv_connector_kv_cache_events)

    def get_handshake_metadata(self) -> Any:
        return self._rec.call("get_handshake_metadata", self._inner.get_handshake_metadata,
                              summary=_kind)

    def build_connector_worker_meta(self) -> Any:
        return self._rec.call("build_connector_worker_meta",
                              self._inner.build_connector_worker_meta)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33 (sleep mode)."""
        return self._rec.call("unregister_kv_caches", self._inner.unregister_kv_caches)

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33 (sleep mode)."""
        return self._rec.call("restore_kv_caches", self._inner.restore_kv_caches)

    def shutdown(self) -> None:
        try:
            return self._rec.call("shutdown", self._inner.shutdown)
        finally:
            self._rec.close()

    # ---- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # Not the base's: it would bind the block pool through the wrapper a second time.
        self._kv_cache_manager = kv_cache_manager
        return self._rec.call("bind_kv_cache_manager", self._inner.bind_kv_cache_manager,
                              kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        return self._rec.call("bind_gpu_block_pool", self._inner.bind_gpu_block_pool,
                              gpu_block_pool)

    def get_finished_count(self) -> int | None:
        return self._rec.call("get_finished_count", self._inner.get_finished_count, summary=_as_is)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        return self._rec.call("set_xfer_handshake_metadata",
                              self._inner.set_xfer_handshake_metadata, metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        return self._rec.call("set_xfer_handshake_metadata_pp_aware",
                              self._inner.set_xfer_handshake_metadata_pp_aware, metadata)

    def on_new_request(self, request: Request) -> None:
        return self._rec.call("on_new_request", self._inner.on_new_request, request,
                              fields=request_fields(request.request_id))

    def may_load_async(self, request: Request) -> bool:  # vLLM >= 0.34, at each enqueue
        hook = self._inner.may_load_async  # type: ignore[attr-defined]
        return self._rec.call("may_load_async", hook, request,
                              fields=request_fields(request.request_id), summary=bool)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.recording:
            self._rec.blocks("get_num_new_matched_tokens",
                             self._blocks.seen(request.request_id, request))
        answer = self._rec.call("get_num_new_matched_tokens",
                                self._inner.get_num_new_matched_tokens, request,
                                num_computed_tokens,
                                fields=request_fields(request.request_id, [num_computed_tokens]),
                                summary=matched_result)
        self._loads.asked(request.request_id, num_computed_tokens, answer)
        return answer

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._rec.call("get_loaded_kv_cache_group_ids",
                              self._inner.get_loaded_kv_cache_group_ids, request,
                              fields=request_fields(request.request_id), summary=list)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._loads.allocated(request.request_id, blocks, num_external_tokens)
        return self._rec.call("update_state_after_alloc", self._inner.update_state_after_alloc,
                              request, blocks, num_external_tokens,
                              fields=request_fields(request.request_id, [num_external_tokens],
                                                    block_ids=group_tables(blocks)))

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[Any, int]:
        return self._rec.call("get_external_cache_hit_sources",
                              self._inner.get_external_cache_hit_sources, request,
                              num_external_tokens,
                              fields=request_fields(request.request_id, [num_external_tokens]),
                              summary=lambda out: {getattr(k, "name", str(k)): v
                                                   for k, v in out.items()})

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.recording:
            for rid in sorted(scheduler_output.num_scheduled_tokens):
                self._rec.blocks("build_connector_meta", self._blocks.new_blocks(rid))
        return self._rec.build(self._inner.build_connector_meta, scheduler_output,
                               self._loads.plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return self._rec.call("update_connector_output", self._inner.update_connector_output,
                              connector_output,
                              fields=output_fields(connector_output.finished_sending,
                                                   connector_output.finished_recving,
                                                   connector_output.invalid_block_ids))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._blocks.forget(request.request_id)
        self._loads.forget(request.request_id)
        return self._rec.call("request_finished", self._inner.request_finished, request, block_ids,
                              fields=request_fields(request.request_id, block_ids=block_ids),
                              summary=kept_result)

    def register_finished_partial_tail(self, request: Request, block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]) -> bool:
        return self._rec.call("register_finished_partial_tail",
                              self._inner.register_finished_partial_tail, request, block_ids,
                              partial_tail_offloads,
                              fields=request_fields(request.request_id, block_ids=block_ids),
                              summary=bool)

    def take_events(self) -> Iterable[KVCacheEvent]:
        # The inner connector's iterable as is (a generator stays a generator: vLLM tests it
        # for truth), so nothing about the events is recorded but the call.
        return self._rec.call("take_events", self._inner.take_events)

    def has_pending_block_frees(self) -> bool:
        return self._rec.call("has_pending_block_frees", self._inner.has_pending_block_frees,
                              summary=bool)

    def has_pending_push_work(self) -> bool:
        return self._rec.call("has_pending_push_work", self._inner.has_pending_push_work,
                              summary=bool)

    def reset_cache(self) -> bool | None:
        return self._rec.call("reset_cache", self._inner.reset_cache, summary=_as_is)


class HMARecordingConnector(RecordingConnector, SupportsHMA):
    """The recorder of a connector that declares SupportsHMA, for a hybrid model: vLLM decides
    from the configured class, before any connector exists, whether it keeps the model's KV
    cache groups, so recording such a connector with its groups takes a class that declares it
    too. vLLM's factory then refuses a recorded connector that does not."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        finish = self._inner.request_finished_all_groups  # type: ignore[attr-defined]
        self._blocks.forget(request.request_id)
        self._loads.forget(request.request_id)
        return self._rec.call("request_finished_all_groups", finish, request, block_ids,
                              fields=request_fields(request.request_id, block_ids=block_ids),
                              summary=kept_result)
