"""Drives the worker half of a KV connector through every step, in DESIGN.md's order.

    pre_forward:   handle_preemptions(meta) -> bind_connector_metadata(meta) -> start_load_kv(ctx)
    forward:       per attention layer: wait_for_layer_load(layer) ... save_kv_layer(layer, ...)
    post_forward:  wait_for_save() -> get_finished(finished_req_ids)
                   -> get_block_ids_with_load_errors() -> build_connector_worker_meta()
                   -> get_kv_connector_stats() -> clear_connector_metadata()
    no_forward:    pre_forward, then post_forward WITHOUT wait_for_save

NOTE: handle_preemptions comes before bind and before anything writes KV: blocks of requests
preempted in this step are already free on the scheduler side and may be reused in this very step.

A hook that raises does not stop the step: the error is recorded, the remaining hooks still run
(so metadata is always cleared and completions are never lost), and the scheduler fails the
step's requests. One driver exists per worker; it is also the `LayerHooks` of the attention.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvport.connectors.base import (
    ForwardContext, KVCacheSpec, KVConnectorBase, KVConnectorOutput, KVConnectorRequestError,
    layer_name,
)
from kvport.connectors.views import SchedulerOutputView

logger = logging.getLogger(__name__)


class KVConnectorDriver:
    def __init__(self, connector: KVConnectorBase, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self.connector = connector
        self._ctx: ForwardContext | None = None
        self._errors: dict[str, str] = {}  # hook name -> message, for the current step
        self._error_req_ids: set[str] | None = set()  # None: a failure not tied to requests
        connector.register_kv_caches(kv_cache, spec)
        self._layer_names = [layer_name(i) for i in range(spec.num_layers)]
        # The pool never moves: make each layer's view once, not twice per layer per step.
        self._layer_views = [kv_cache[:, i] for i in range(spec.num_layers)]

    def pre_forward(self, sched_out: SchedulerOutputView, ctx: ForwardContext) -> None:
        self._ctx = ctx
        self._errors = {}
        self._error_req_ids = set()
        self._call("trace_step", sched_out.step)
        meta = sched_out.kv_connector_metadata
        self._call("handle_preemptions", meta)
        self._call("bind_connector_metadata", meta)
        self._call("start_load_kv", ctx)

    # LayerHooks: called by PagedAttention around each layer's attention.
    def before_attention(self, layer_idx: int) -> None:
        try:
            self.connector.wait_for_layer_load(self._layer_names[layer_idx])
        except Exception as exc:
            self._record_error("wait_for_layer_load", exc)

    def after_attention(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        try:
            self.connector.save_kv_layer(self._layer_names[layer_idx], self._layer_views[layer_idx],
                                         self._ctx)
        except Exception as exc:
            self._record_error("save_kv_layer", exc)

    def post_forward(self, sched_out: SchedulerOutputView, did_forward: bool) -> KVConnectorOutput:
        if did_forward:
            self._call("wait_for_save")
        finished = self._call("get_finished", set(sched_out.finished_req_ids))
        sending, recving = finished if finished is not None else (None, None)
        invalid = self._call("get_block_ids_with_load_errors")
        worker_meta = self._call("build_connector_worker_meta")
        stats = self._call("get_kv_connector_stats")
        self._call("clear_connector_metadata")
        self._ctx = None
        return KVConnectorOutput(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            invalid_block_ids=set(invalid or ()), worker_meta=worker_meta,
            stats=dict(stats or {}), errors=self._errors,
            error_req_ids=self._error_req_ids if self._errors else set())

    def _call(self, hook: str, *args: Any) -> Any:
        try:
            return getattr(self.connector, hook)(*args)
        except Exception as exc:
            self._record_error(hook, exc)
            return None

    def _record_error(self, hook: str, exc: Exception) -> None:
        if isinstance(exc, KVConnectorRequestError):
            if self._error_req_ids is not None:
                self._error_req_ids |= exc.request_ids
        else:
            self._error_req_ids = None
        if hook not in self._errors:  # per-layer hooks: keep the first failure
            logger.error("KV connector worker hook %s failed", hook, exc_info=exc)
            self._errors[hook] = f"{type(exc).__name__}: {exc}"

    def shutdown(self) -> None:
        self.connector.shutdown()
