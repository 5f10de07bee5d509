"""RecordingConnector: a transparent wrapper that appends one trace line per connector call.

Switched on by `"kv_connector_extra_config": {"record_trace": PATH}` (see connectors.factory).
Every public method of KVConnectorBase is forwarded to the wrapped connector and recorded after it
returns (with its result) or raises (with an "error" field, then the exception propagates).
Any other attribute is forwarded unrecorded by __getattr__. Return values are never changed.
kvport.trace.writer writes the lines (the file, the header, errors); this module says which calls
are recorded, with which fields.

Steps: the engine calls `trace_step(step)` on every connector (scheduler side at the start of
schedule() and of update_from_output, worker side before handle_preemptions; a no-op in the base
class). The recorder stamps that step on every following line, writes a marker line, and passes
the call on to the inner connector (so nested recorders under a MultiConnector see it).

Header: the engine that builds the connector hands its TraceHeader (which engine made the calls,
its worker call order) to connectors.factory.create_connector, which gives it to the recorder
(and a MultiConnector to its children's). A recorder given none writes none: the checker then
applies the legacy order.

Sync loads: start_load_kv's record has `ints: [1]` if the step has synchronous loads, `[0]` if
not (from the worker driver's StepContext; a plain ForwardContext counts as none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from kvport.connectors.base import (
    ForwardContext,
    KVCacheEvent,
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from kvport.connectors.factory import connector_class_for
from kvport.connectors.hma import SupportsHMA, supports_hma
from kvport.connectors.views import RequestView, SchedulerOutputView
from kvport.trace.fields import (
    finished_result,
    kept_result,
    matched_result,
    output_fields,
    request_fields,
    schedule_fields,
    sorted_ids,
)
from kvport.trace.identity import BLOCKS_MARKER, BlockLog
from kvport.trace.writer import Record, TraceWriter

if TYPE_CHECKING:
    import torch

    from kvport.config import KVTransferConfig
    from kvport.trace.events import TraceHeader


class RecordingConnector(KVConnectorBase):
    # NOTE: KVConnectorBase.__init__ is not called on purpose: the wrapper keeps no metadata of its
    # own, so _connector_metadata, _config and the like resolve to the inner connector's.
    def __init__(self, inner: KVConnectorBase, path: str, header: TraceHeader | None = None
                 ) -> None:
        self._inner = inner
        extra = inner.kv_transfer_config.kv_connector_extra_config
        if header is not None and (inner.holds_only_what_it_was_handed()
                                   or extra.get("sees_all_stores") is True):
            # a private store (or one its user declares so) holds only what it was handed here
            header = dataclasses.replace(header, sees_all_stores=True)
        self._writer = TraceWriter(path, inner.role.value,
                                   str(extra.get("name") or type(inner).__name__), header)
        self._blocks = BlockLog(_describe)  # the requests' blocks, for the claim rules

    def _note_blocks(self, records: Iterable[Record]) -> None:
        for fields in records:
            self._writer.note(BLOCKS_MARKER, fields)

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: connector-specific attributes of the inner one.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"RecordingConnector({self._inner!r}, {self._writer.path!r})"

    @classmethod
    def class_for_config(cls, config: KVTransferConfig) -> type[KVConnectorBase]:
        """Not a call on a connector, so not recorded: the factory asks the class it builds for
        `config` and wraps the connector built; that class is the answer here too."""
        return connector_class_for(config)

    @property
    def inner(self) -> KVConnectorBase:
        return self._inner

    @property
    def role(self) -> KVConnectorRole:
        return self._inner.role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        return self._inner.kv_transfer_config

    def trace_step(self, step: int) -> None:
        """Engine hook: the calls that follow belong to `step`."""
        self._writer.start_step(step)
        self._inner.trace_step(step)

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self._writer.call("register_kv_caches", self._inner.register_kv_caches, kv_cache, spec,
                          fields={"ints": [spec.num_blocks, spec.block_size, spec.num_layers]})

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        self._writer.call("handle_preemptions", self._inner.handle_preemptions, metadata)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._writer.call("bind_connector_metadata", self._inner.bind_connector_metadata, metadata)

    def clear_connector_metadata(self) -> None:
        self._writer.call("clear_connector_metadata", self._inner.clear_connector_metadata)

    def has_connector_metadata(self) -> bool:
        return self._writer.call("has_connector_metadata", self._inner.has_connector_metadata,
                                 summary=bool)

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        return self._inner._get_connector_metadata()

    def start_load_kv(self, ctx: ForwardContext) -> None:
        # Where start_load_kv belongs under vllm-0.32 depends on it (trace.events.CALL_ORDERS).
        sync = int(bool(getattr(ctx, "has_sync_kv_loads", False)))
        self._writer.call("start_load_kv", self._inner.start_load_kv, ctx,
                          fields={"req_ids": sorted(ctx.num_scheduled_tokens), "ints": [sync]})

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._writer.call("wait_for_layer_load", self._inner.wait_for_layer_load, layer_name,
                          fields={"layer": layer_name})

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        self._writer.call("save_kv_layer", self._inner.save_kv_layer, layer_name, kv_layer, ctx,
                          fields={"layer": layer_name})

    def finish_forward(self) -> None:
        self._writer.call("finish_forward", self._inner.finish_forward)

    def wait_for_save(self) -> None:
        self._writer.call("wait_for_save", self._inner.wait_for_save)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._writer.call("get_finished", self._inner.get_finished, finished_req_ids,
                                 fields={"req_ids": sorted_ids(finished_req_ids)},
                                 summary=finished_result)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._writer.call("get_block_ids_with_load_errors",
                                 self._inner.get_block_ids_with_load_errors, summary=sorted)

    def get_failed_load_req_ids(self) -> set[str]:
        # the requests of the blocks get_block_ids_with_load_errors reported: unrecorded
        return self._inner.get_failed_load_req_ids()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._writer.call("build_connector_worker_meta",
                                 self._inner.build_connector_worker_meta)

    def get_kv_connector_stats(self) -> dict[str, Any]:
        return self._writer.call("get_kv_connector_stats", self._inner.get_kv_connector_stats)

    # ---- scheduler side -------------------------------------------------------------------------

    def set_kv_cache_spec(self, spec: KVCacheSpec) -> None:
        self._inner.set_kv_cache_spec(spec)  # configuration, not a contract call: unrecorded

    def get_metrics(self) -> Any:
        return self._inner.get_metrics()  # a read-only view: unrecorded

    def get_external_cache_hit_sources(self, request: RequestView,
                                       num_external_tokens: int) -> dict[str, int]:
        # a read-only view (vLLM's metrics), not a contract call: unrecorded
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def shares_storage(self) -> bool:
        return self._inner.shares_storage()  # configuration: unrecorded

    def holds_only_what_it_was_handed(self) -> bool:
        return self._inner.holds_only_what_it_was_handed()  # configuration: unrecorded

    def storage_namespace(self) -> str | None:
        return self._inner.storage_namespace()  # configuration: unrecorded

    def on_new_request(self, request: RequestView) -> None:
        self._writer.call("on_new_request", self._inner.on_new_request, request,
                          fields=request_fields(request.request_id))

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._note_blocks(self._blocks.seen(request.request_id, request))
        return self._writer.call("get_num_new_matched_tokens",
                                 self._inner.get_num_new_matched_tokens, request,
                                 num_computed_tokens,
                                 fields=request_fields(request.request_id, [num_computed_tokens]),
                                 summary=matched_result)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int] | tuple[list[int], ...],
        num_external_tokens: int,
    ) -> None:
        self._writer.call("update_state_after_alloc", self._inner.update_state_after_alloc,
                          request, block_ids, num_external_tokens,
                          fields=request_fields(request.request_id, [num_external_tokens],
                                                block_ids=block_ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for rid in sorted(scheduled):
            self._note_blocks(self._blocks.new_blocks(rid))
        before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        before.update((r.req_id, r.num_computed_tokens)
                      for r in scheduler_output.scheduled_cached_reqs)
        fields = schedule_fields(scheduled, scheduler_output.total_num_scheduled_tokens, before)
        return self._writer.call("build_connector_meta", self._inner.build_connector_meta,
                                 scheduler_output, fields=fields)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._writer.call("update_connector_output", self._inner.update_connector_output,
                          connector_output,
                          fields=output_fields(connector_output.finished_sending,
                                               connector_output.finished_recving,
                                               connector_output.invalid_block_ids))

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._blocks.forget(request.request_id)
        return self._writer.call("request_finished", self._inner.request_finished, request,
                                 block_ids,
                                 fields=request_fields(request.request_id, block_ids=block_ids),
                                 summary=kept_result)

    def take_events(self) -> list[KVCacheEvent]:
        return self._writer.call("take_events", self._inner.take_events)

    def has_pending_work(self) -> bool:
        return self._writer.call("has_pending_work", self._inner.has_pending_work, summary=bool)

    def reset_cache(self) -> bool | None:
        return self._writer.call("reset_cache", self._inner.reset_cache)

    def shutdown(self) -> None:
        try:
            self._writer.call("shutdown", self._inner.shutdown)
        finally:
            self._writer.close()


class HMARecordingConnector(RecordingConnector, SupportsHMA):
    """The recorder of a SupportsHMA connector: SupportsHMA too, so the engine keeps the model's
    KV cache groups for it; block tables are recorded per group (`group_blocks`)."""

    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        inner = cast(SupportsHMA, self._inner)
        self._blocks.forget(request.request_id)
        return self._writer.call("request_finished_all_groups",
                                 inner.request_finished_all_groups, request, block_ids,
                                 fields=request_fields(request.request_id, block_ids=block_ids),
                                 summary=kept_result)


def _describe(request: RequestView) -> tuple[Any, Any, str | None, str | None, int]:
    """What trace_blocks records of a kvport request (kvport's engine has no cache_salt)."""
    return (request.block_hashes, request.all_token_ids, getattr(request, "cache_salt", None),
            getattr(request, "lora_name", None), request.block_size)


def recorder_for(inner: KVConnectorBase, path: str,
                 header: TraceHeader | None = None) -> RecordingConnector:
    """The recorder of `inner`: SupportsHMA exactly when `inner` is."""
    cls = HMARecordingConnector if supports_hma(inner) else RecordingConnector
    return cls(inner, path, header)
