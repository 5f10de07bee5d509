"""Drives the worker half of a KV connector through every step, in one of three call orders.

"vllm-0.32" (the default; vLLM 0.32's worker):

    pre_forward:   handle_preemptions(meta) -> bind_connector_metadata(meta)
                   [-> start_load_kv(ctx)        only if the step has synchronous loads]
    forward:       per attention layer: wait_for_layer_load(layer) ... save_kv_layer(layer, ...)
    post_forward:  [start_load_kv(ctx) ->        if it did not run before the forward]
                   wait_for_save() -> get_finished(finished_req_ids)
                   -> get_block_ids_with_load_errors() -> build_connector_worker_meta()
                   -> get_kv_connector_stats() -> clear_connector_metadata()
    no_forward:    the same, without the layer hooks: wait_for_save runs on every step

"vllm-mrv2" (vLLM's Model Runner V2, the GPU runner of vLLM 0.33 and 0.34): "vllm-0.32" with
finish_forward() first in post_forward (the forward has ended), before the deferred
start_load_kv, on no-forward steps too. (With a drafter, MRV2 also defers wait_for_save and
clear_connector_metadata past the draft model's forward; kvport's engine has no drafter.)

"legacy" (vLLM before 0.32):

    pre_forward:   handle_preemptions(meta) -> bind_connector_metadata(meta) -> start_load_kv(ctx)
    forward:       per attention layer: wait_for_layer_load(layer) ... save_kv_layer(layer, ...)
    post_forward:  wait_for_save() -> get_finished(finished_req_ids) -> ... as above
    no_forward:    pre_forward, then post_forward WITHOUT wait_for_save

A step has synchronous loads when a request scheduled in it gets external tokens from a connector
that answered is_async=False (`SchedulerOutputView.has_sync_kv_loads`): the forward reads what
those loads write, so they must start before it. vLLM 0.32 starts every other load after the
forward, off its critical path. A connector must be correct under every order: nothing that must
happen every step may rely on wait_for_save (legacy skips it), on start_load_kv coming before
the layer hooks (vllm-0.32 and vllm-mrv2 do not) or on finish_forward (only vllm-mrv2 calls it).

NOTE: handle_preemptions comes before bind and before anything writes KV, in both orders: blocks
of requests preempted in this step are already free on the scheduler side and may be reused in
this very step.

A hook that raises does not stop the step: the error is recorded, the remaining hooks still run
(so metadata is always cleared and completions are never lost), and the scheduler fails the
step's requests. One driver exists per worker; it is also the `LayerHooks` of the attention.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvport.connectors.base import (
    ForwardContext, KVCacheSpec, KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
    KVConnectorRequestError, KVConnectorWorkerMetadata, layer_name,
)
from kvport.connectors.views import StepView
from kvport.trace.events import CALL_ORDERS, LEGACY, VLLM_0_32, VLLM_MRV2

logger = logging.getLogger(__name__)

T = TypeVar("T")

# get_finished's answer for a step whose get_finished raised: nothing sent, nothing received.
NOTHING_FINISHED: tuple[set[str] | None, set[str] | None] = (None, None)


def check_call_order(call_order: str) -> str:
    if call_order not in CALL_ORDERS:
        raise ValueError(f"kv_connector_call_order must be one of {CALL_ORDERS}, "
                         f"got {call_order!r}")
    return call_order


@dataclasses.dataclass
class StepContext(ForwardContext):
    """The ForwardContext the driver hands the connector in a step: also whether the step has
    synchronous loads, which the call recorder writes into start_load_kv's record (the trace
    checker needs it to know where start_load_kv belongs under vllm-0.32)."""

    has_sync_kv_loads: bool = False


class KVConnectorDriver:
    def __init__(self, connector: KVConnectorBase, kv_cache: torch.Tensor, spec: KVCacheSpec,
                 call_order: str = VLLM_0_32) -> None:
        self.connector = connector
        self.call_order = check_call_order(call_order)
        self._ctx: StepContext | None = None
        self._load_started = False  # start_load_kv ran in the current step
        self._errors: dict[str, str] = {}  # hook name -> message, for the current step
        self._error_req_ids: set[str] | None = set()  # None: a failure not tied to requests
        connector.register_kv_caches(kv_cache, spec)
        self._layer_names = [layer_name(i) for i in range(spec.num_layers)]
        # The pool never moves: make each layer's view once, not twice per layer per step.
        self._layer_views = [kv_cache[:, spec.layer_slot(i)] for i in range(spec.num_layers)]

    def pre_forward(self, sched_out: StepView, ctx: ForwardContext) -> None:
        self._ctx = StepContext(ctx.kv_cache, ctx.num_scheduled_tokens, ctx.step,
                                has_sync_kv_loads=bool(sched_out.has_sync_kv_loads))
        self._load_started = False
        self._errors = {}
        self._error_req_ids = set()
        c = self.connector
        self._guarded("trace_step", lambda: c.trace_step(sched_out.step), None)
        self._preempt_and_bind(sched_out.kv_connector_metadata)
        if self._loads_before_forward(self._ctx):
            self._start_load()

    def _preempt_and_bind(self, meta: KVConnectorMetadata) -> None:
        c = self.connector
        # handle_preemptions first: see the NOTE in the module docstring
        self._guarded("handle_preemptions", lambda: c.handle_preemptions(meta), None)
        self._guarded("bind_connector_metadata", lambda: c.bind_connector_metadata(meta), None)

    def _loads_before_forward(self, ctx: StepContext) -> bool:
        """Legacy: always. vllm-0.32 and vllm-mrv2: only when the forward reads what it loads."""
        return self.call_order == LEGACY or ctx.has_sync_kv_loads

    def _start_load(self) -> None:
        self._load_started = True
        self._guarded("start_load_kv", lambda: self.connector.start_load_kv(self._step_ctx), None)

    @property
    def _step_ctx(self) -> StepContext:
        assert self._ctx is not None, "no step in progress: pre_forward starts one"
        return self._ctx

    # LayerHooks: called by PagedAttention around each layer's attention.
    def before_attention(self, layer_idx: int) -> None:
        try:
            self.connector.wait_for_layer_load(self._layer_names[layer_idx])
        except Exception as exc:
            self._record_error("wait_for_layer_load", exc)

    def after_attention(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        try:
            self.connector.save_kv_layer(self._layer_names[layer_idx], self._layer_views[layer_idx],
                                         self._step_ctx)
        except Exception as exc:
            self._record_error("save_kv_layer", exc)

    def post_forward(self, sched_out: StepView, did_forward: bool) -> KVConnectorOutput:
        c = self.connector
        if self.call_order == VLLM_MRV2:  # the forward (if any) no longer reads the step's KV
            self._guarded("finish_forward", lambda: c.finish_forward(), None)
        if not self._load_started:  # vllm-0.32, no sync loads: loads start after the forward
            self._start_load()
        if did_forward or self.call_order != LEGACY:  # legacy skips it without a forward
            self._guarded("wait_for_save", lambda: c.wait_for_save(), None)
        finished_req_ids = set(sched_out.finished_req_ids)
        sending, recving = self._guarded(
            "get_finished", lambda: c.get_finished(finished_req_ids), NOTHING_FINISHED)
        invalid: set[int] = self._guarded(
            "get_block_ids_with_load_errors", lambda: c.get_block_ids_with_load_errors(), set())
        worker_meta: KVConnectorWorkerMetadata | None = self._guarded(
            "build_connector_worker_meta", lambda: c.build_connector_worker_meta(), None)
        stats: dict[str, Any] = self._guarded(
            "get_kv_connector_stats", lambda: c.get_kv_connector_stats(), {})
        self._guarded("clear_connector_metadata", lambda: c.clear_connector_metadata(), None)
        self._ctx = None
        # Copies (None is nothing): the output must not share the connector's own sets.
        return KVConnectorOutput(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            invalid_block_ids=set(invalid or ()), worker_meta=worker_meta,
            stats=dict(stats or {}), errors=self._errors,
            error_req_ids=self._error_req_ids if self._errors else set())

    def _guarded(self, hook: str, call: Callable[[], T], if_raised: T) -> T:
        """call()'s result; if it raises, the error is recorded under `hook` and `if_raised`
        stands in, so that the step's remaining hooks still run."""
        try:
            return call()
        except Exception as exc:
            self._record_error(hook, exc)
            return if_raised

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
