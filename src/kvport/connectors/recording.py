"""RecordingConnector: a transparent wrapper that appends one trace line per connector call.

Switched on by `"kv_connector_extra_config": {"record_trace": PATH}` (see connectors.factory).
Every public method of KVConnectorBase is forwarded to the wrapped connector and recorded after it
returns (with its result) or raises (with an "error" field, then the exception propagates).
Any other attribute is forwarded unrecorded by __getattr__. Return values are never changed.

Steps: the engine calls `trace_step(step)` on every connector (scheduler side at the start of
schedule() and of update_from_output, worker side before handle_preemptions; a no-op in the base
class). The recorder stamps that step on every following line, writes a marker line, and passes
the call on to the inner connector (so nested recorders under a MultiConnector see it).

Header: the first record of each (pid, role, connector) group is a `trace_header` record (step
None) whose result is a kvport.trace.events.TraceHeader: which engine made the calls and its
worker call order, so the checker applies that order's contract. A recorder learns it from the
engine that builds it, never by importing the engine: the engine builds its connector halves
inside `engine_header(TraceHeader(...))` (kvport.engine.connector_setup does), and every recorder
made in that block, a MultiConnector's children included, takes the header from it. A recorder
made outside such a block writes no header; the checker then applies the legacy order. A forked
child writes the header again before its first record (its lines carry its own pid).

Sync loads: start_load_kv's record has `ints: [1]` if the step has synchronous loads, `[0]` if
not (from the worker driver's StepContext; a plain ForwardContext counts as none).

Writes: every recorder of a run appends to the same file, possibly from several processes. Each
line is one os.write on an O_APPEND descriptor, so lines never interleave, and nothing is buffered
(a killed worker loses no line). `kvport trace check` reads the file back (trace.checker).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

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
from kvport.connectors.views import RequestView, SchedulerOutputView
from kvport.trace.events import HEADER, STEP_MARKER, TraceHeader, encode_line
from kvport.trace.process import TraceProcess, unique_label

if TYPE_CHECKING:
    import torch

    from kvport.config import KVTransferConfig

_MAX_ERROR_CHARS = 300  # keeps an error line well under the 4 KiB atomic-append size




# The header of the engine building connectors right now (see engine_header).
_ENGINE_HEADER: contextvars.ContextVar[TraceHeader | None] = contextvars.ContextVar(
    "kvport_trace_engine_header", default=None)


@contextlib.contextmanager
def engine_header(header: TraceHeader) -> Iterator[None]:
    """Recorders created inside this block write `header` as their first record. An engine wraps
    the creation of its connector halves in it, so the recorder (and a MultiConnector's recording
    children, created in their parent's constructor) knows the engine without importing it."""
    token = _ENGINE_HEADER.set(header)
    try:
        yield
    finally:
        _ENGINE_HEADER.reset(token)


def _label(inner: KVConnectorBase, path: str, role: str) -> str:
    extra = inner.kv_transfer_config.kv_connector_extra_config
    base = str(extra.get("name") or type(inner).__name__)
    return unique_label(base, path, role)


def _sorted_ids(ids: set[str] | None) -> list[str]:
    return sorted(ids) if ids else []


class RecordingConnector(KVConnectorBase):
    # NOTE: KVConnectorBase.__init__ is not called on purpose: the wrapper keeps no metadata of its
    # own, so _connector_metadata, _config and the like resolve to the inner connector's.
    def __init__(self, inner: KVConnectorBase, path: str) -> None:
        self._inner = inner
        self._path = path
        self._role_name = inner.role.value
        self._name = _label(inner, path, self._role_name)
        self._step: int | None = None
        self._header = _ENGINE_HEADER.get()
        self._header_pid: int | None = None  # the process whose lines start with the header
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._close_fd = weakref.finalize(self, os.close, self._fd)

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: connector-specific attributes of the inner one.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"RecordingConnector({self._inner!r}, {self._path!r})"

    @property
    def inner(self) -> KVConnectorBase:
        return self._inner

    @property
    def role(self) -> KVConnectorRole:
        return self._inner.role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        return self._inner.kv_transfer_config

    # ---- recording ------------------------------------------------------------------------------

    def _head(self, method: str) -> dict[str, Any]:
        if self._header is not None and self._header_pid != TraceProcess.pid:
            # The group's first record; written now, so its seq precedes the record's.
            self._header_pid = TraceProcess.pid
            header = self._new_record(HEADER, step=None)
            header["result"] = self._header.to_result()
            self._write(header)
        return self._new_record(method, self._step)

    def _new_record(self, method: str, step: int | None) -> dict[str, Any]:
        return {"seq": next(TraceProcess.seq), "pid": TraceProcess.pid, "role": self._role_name,
                "connector": self._name, "step": step, "method": method}

    def _write(self, rec: dict[str, Any]) -> None:
        if self._fd < 0:  # after shutdown: the call is still forwarded, just not recorded
            return
        line = encode_line(rec)
        while line:  # a regular-file write is whole in practice; loop in case it is not
            line = line[os.write(self._fd, line):]

    def _call(self, rec: dict[str, Any], fn: Callable[..., Any], *args: Any,
              summary: Callable[[Any], Any] | None = None) -> Any:
        try:
            out = fn(*args)
        except BaseException as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
            self._write(rec)
            raise
        if summary is not None:
            try:
                rec["result"] = summary(out)
            except Exception:  # noqa: BLE001  # a malformed answer is the checker's business, not the caller's
                rec["result"] = repr(out)[:_MAX_ERROR_CHARS]
        self._write(rec)
        return out

    def trace_step(self, step: int) -> None:
        """Engine hook: the calls that follow belong to `step`."""
        self._step = step
        self._write(self._head(STEP_MARKER))
        self._inner.trace_step(step)

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        rec = self._head("register_kv_caches")
        rec["ints"] = [spec.num_blocks, spec.block_size, spec.num_layers]
        self._call(rec, self._inner.register_kv_caches, kv_cache, spec)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        self._call(self._head("handle_preemptions"), self._inner.handle_preemptions, metadata)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._call(self._head("bind_connector_metadata"), self._inner.bind_connector_metadata,
                   metadata)

    def clear_connector_metadata(self) -> None:
        self._call(self._head("clear_connector_metadata"), self._inner.clear_connector_metadata)

    def has_connector_metadata(self) -> bool:
        return self._call(self._head("has_connector_metadata"),
                          self._inner.has_connector_metadata, summary=bool)

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        return self._inner._get_connector_metadata()

    def start_load_kv(self, ctx: ForwardContext) -> None:
        rec = self._head("start_load_kv")
        rec["req_ids"] = sorted(ctx.num_scheduled_tokens)
        # Where start_load_kv belongs under vllm-0.32 depends on it (trace.events.CALL_ORDERS).
        rec["ints"] = [int(bool(getattr(ctx, "has_sync_kv_loads", False)))]
        self._call(rec, self._inner.start_load_kv, ctx)

    def wait_for_layer_load(self, layer_name: str) -> None:
        rec = self._head("wait_for_layer_load")
        rec["layer"] = layer_name
        self._call(rec, self._inner.wait_for_layer_load, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        rec = self._head("save_kv_layer")
        rec["layer"] = layer_name
        self._call(rec, self._inner.save_kv_layer, layer_name, kv_layer, ctx)

    def wait_for_save(self) -> None:
        self._call(self._head("wait_for_save"), self._inner.wait_for_save)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        rec = self._head("get_finished")
        rec["req_ids"] = _sorted_ids(finished_req_ids)
        return self._call(rec, self._inner.get_finished, finished_req_ids,
                          summary=lambda out: [_sorted_ids(out[0]), _sorted_ids(out[1])])

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._call(self._head("get_block_ids_with_load_errors"),
                          self._inner.get_block_ids_with_load_errors, summary=sorted)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._call(self._head("build_connector_worker_meta"),
                          self._inner.build_connector_worker_meta)

    def get_kv_connector_stats(self) -> dict[str, Any]:
        return self._call(self._head("get_kv_connector_stats"),
                          self._inner.get_kv_connector_stats)

    # ---- scheduler side -------------------------------------------------------------------------

    def set_kv_cache_spec(self, spec: KVCacheSpec) -> None:
        self._inner.set_kv_cache_spec(spec)  # configuration, not a contract call: unrecorded

    def get_metrics(self) -> dict[str, Any]:
        return self._inner.get_metrics()  # a read-only view: unrecorded

    def on_new_request(self, request: RequestView) -> None:
        rec = self._head("on_new_request")
        rec["req_ids"] = [request.request_id]
        self._call(rec, self._inner.on_new_request, request)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rec = self._head("get_num_new_matched_tokens")
        rec["req_ids"] = [request.request_id]
        rec["ints"] = [num_computed_tokens]
        return self._call(rec, self._inner.get_num_new_matched_tokens, request,
                          num_computed_tokens, summary=lambda out: [out[0], bool(out[1])])

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rec = self._head("update_state_after_alloc")
        rec["req_ids"] = [request.request_id]
        rec["ints"] = [num_external_tokens]
        rec["num_blocks"] = len(block_ids)
        self._call(rec, self._inner.update_state_after_alloc, request, block_ids,
                   num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> KVConnectorMetadata:
        rec = self._head("build_connector_meta")
        rec["req_ids"] = sorted(scheduler_output.num_scheduled_tokens)
        rec["ints"] = [scheduler_output.total_num_scheduled_tokens]
        return self._call(rec, self._inner.build_connector_meta, scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        rec = self._head("update_connector_output")
        sending = _sorted_ids(connector_output.finished_sending)
        recving = _sorted_ids(connector_output.finished_recving)
        rec["req_ids"] = sorted(set(sending) | set(recving))
        rec["finished_sending"] = sending
        rec["finished_recving"] = recving
        rec["invalid_block_ids"] = sorted(connector_output.invalid_block_ids)
        self._call(rec, self._inner.update_connector_output, connector_output)

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rec = self._head("request_finished")
        rec["req_ids"] = [request.request_id]
        rec["num_blocks"] = len(block_ids)
        return self._call(rec, self._inner.request_finished, request, block_ids,
                          summary=lambda out: bool(out[0]))

    def take_events(self) -> list[KVCacheEvent]:
        return self._call(self._head("take_events"), self._inner.take_events)

    def has_pending_work(self) -> bool:
        return self._call(self._head("has_pending_work"), self._inner.has_pending_work,
                          summary=bool)

    def reset_cache(self) -> bool | None:
        return self._call(self._head("reset_cache"), self._inner.reset_cache)

    def shutdown(self) -> None:
        try:
            self._call(self._head("shutdown"), self._inner.shutdown)
        finally:
            self._fd = -1
            self._close_fd()
