"""RecordingConnector: any vLLM KV connector, wrapped; every call vLLM makes on it is recorded in
kvport's trace format (kvport.trace.events) and forwarded unchanged.

    kv_transfer_config={"kv_connector": "RecordingConnector",
                        "kv_connector_module_path": "kvport.vllm", "kv_role": "kv_both",
                        "kv_connector_extra_config": {
                            "record_trace": "trace.jsonl",
                            "connector": {"kv_connector": "ExampleConnector",
                                          "kv_connector_extra_config": {...}}}}

`connector` is the recorded connector's own kv_transfer_config; it is built with vLLM's connector
factory (recording_config.py: which fields it inherits). Without `record_trace` the wrapper only
forwards: the per-layer hooks are then the inner connector's own bound methods, and the metadata
is not wrapped.

Steps. vLLM never tells a connector its step, and kvport's checker needs `trace_step` markers.
The scheduler side numbers steps itself: a step opens at the first scheduling call after the
previous `build_connector_meta` (get_num_new_matched_tokens, update_state_after_alloc, ...,
or that build itself) and a marker line is written then; `request_finished`,
`update_connector_output` and `take_events` of update_from_output keep the step they follow.
vLLM's Scheduler is not patched (that would announce steps exactly, but changes vLLM's class for
every engine in the process and breaks with its internals). The cost: S1 (one build per step) and
S2 (allocations before the build) hold by construction, except for a step that never built its
metadata; and under async scheduling (step N+1 scheduled before step N's output is processed)
update_from_output's records carry step N+1. Per-request rules (S3-S7) do not depend on steps.

The step reaches the worker inside the metadata: `build_connector_meta` wraps the inner
connector's metadata in a RecordingMetadata (step, the step's has_sync_kv_loads, the scheduled
request ids); the worker side announces the step when the metadata first arrives
(handle_preemptions, else bind), and unwraps it before any inner call. The wrapper also binds the
wrapped metadata on itself, as vLLM expects of the connector it holds.

Class-level hooks vLLM calls on the class named in the config (get_required_kvcache_layout,
requires_piecewise_for_cudagraph, build_prom_metrics, supports_sleep_mode) resolve the inner
connector's class from the config they are given and ask it. build_kv_connector_stats is given
only a stats dict, in vLLM's front-end process, where no connector exists: the wrapper's stats
(RecordingStats) therefore carry the inner connector's name in their dict, and the class method
rebuilds the inner connector's stats from it.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvport.trace.events import HEADER, STEP_MARKER, VLLM_0_32, TraceHeader, encode_line
from kvport.trace.process import TraceProcess, unique_label
from kvport.vllm.compat import require_vllm
from kvport.vllm.recording_config import INHERITED, WRAPPER, RecordingSpec, parse_recording_config

vllm = require_vllm()

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

CALL_ORDER = VLLM_0_32  # vLLM 0.32 and 0.33 drive the worker in the same order
STATS_KEY = "kvport_recorded_connector"  # RecordingStats.to_dict(): the inner connector's name
_MAX_ERROR_CHARS = 300
# Scheduler calls that belong to schedule(): the first one after a build opens the next step.
_SCHEDULE_CALLS = frozenset({
    "get_num_new_matched_tokens", "get_loaded_kv_cache_group_ids", "update_state_after_alloc",
    "get_external_cache_hit_sources", "has_pending_block_frees", "build_connector_meta",
})
# Hooks vLLM calls per layer (or that are plain reads): without recording, the wrapper's
# attribute is the inner connector's bound method, so forwarding them costs no call at all.
_DIRECT_WHEN_OFF = ("has_connector_metadata", "wait_for_layer_load", "save_kv_layer",
                    "start_load_kv", "wait_for_save", "get_block_ids_with_load_errors",
                    "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
                    "get_num_new_matched_tokens", "update_state_after_alloc",
                    "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
                    "request_finished", "update_connector_output", "take_events",
                    "has_pending_push_work", "has_pending_block_frees", "on_new_request",
                    "get_transfer_results", "get_finished", "handle_preemptions")


# ---- configuration -------------------------------------------------------------------------------


def _outer_fields(ktc: Any) -> dict[str, Any]:
    return {name: getattr(ktc, name) for name in INHERITED if hasattr(ktc, name)}


def _spec(ktc: Any) -> RecordingSpec:
    if ktc is None:
        raise ValueError(f"{WRAPPER}: vLLM passed no kv_transfer_config")
    return parse_recording_config(ktc.kv_connector_extra_config, _outer_fields(ktc))


def _inner_config(spec: RecordingSpec) -> KVTransferConfig:
    try:
        return KVTransferConfig(**spec.inner)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{WRAPPER}: 'connector' is not a valid kv_transfer_config "
                         f"({exc}): {spec.inner!r}") from None


def _inner_class(ktc: KVTransferConfig) -> type[KVConnectorBase_V1]:
    try:
        cls = KVConnectorFactory.get_connector_class(ktc)
    except (ValueError, AttributeError, ImportError) as exc:
        where = (f"module {ktc.kv_connector_module_path!r}" if ktc.kv_connector_module_path
                 else "vLLM's connector registry")
        known = sorted(KVConnectorFactory._registry)  # for the error message only
        raise ValueError(f"{WRAPPER}: cannot load the connector to record, "
                         f"kv_connector={ktc.kv_connector!r} from {where} ({exc}); pass a "
                         f"registered name ({', '.join(known)}) or a class name with its "
                         f"kv_connector_module_path") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ValueError(  # noqa: TRY004  # a bad config value, like the others
            f"{WRAPPER}: kv_connector={ktc.kv_connector!r} is {cls!r}, not a vLLM "
            f"KVConnectorBase_V1 subclass")
    return cls


def _resolve(ktc: Any) -> tuple[type[KVConnectorBase_V1], KVTransferConfig, RecordingSpec]:
    spec = _spec(ktc)
    inner = _inner_config(spec)
    return _inner_class(inner), inner, spec


def _inner_vllm_config(vllm_config: VllmConfig, inner: KVTransferConfig) -> VllmConfig:
    config = copy.copy(vllm_config)  # shallow: only kv_transfer_config differs
    config.kv_transfer_config = inner
    return config


def _stats_ref(ktc: KVTransferConfig) -> dict[str, Any]:
    return {"kv_connector": ktc.kv_connector,
            "kv_connector_module_path": ktc.kv_connector_module_path}


# ---- what crosses processes ----------------------------------------------------------------------


class RecordingMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the inner connector's metadata and what the worker records with it."""

    def __init__(self, inner: KVConnectorMetadata, step: int, has_sync_kv_loads: bool,
                 req_ids: list[str]) -> None:
        self.inner = inner
        self.step = step
        self.has_sync_kv_loads = has_sync_kv_loads
        self.req_ids = req_ids  # scheduled in the step, sorted

    def __repr__(self) -> str:
        return (f"RecordingMetadata(step={self.step}, sync={self.has_sync_kv_loads}, "
                f"inner={self.inner!r})")


def _unwrap(meta: Any) -> Any:
    return meta.inner if isinstance(meta, RecordingMetadata) else meta


class RecordingStats(KVConnectorStats):
    """The inner connector's stats, whose dict also names the inner connector, so that vLLM's
    front end (which calls build_kv_connector_stats on the class named in the outer config, with
    that dict only) can rebuild them. Everything else is the inner stats' own."""

    def __init__(self, inner: KVConnectorStats, ref: dict[str, Any]) -> None:
        super().__init__(data={})
        self.inner = inner
        self.ref = ref

    def to_dict(self) -> dict[str, Any]:
        return {STATS_KEY: self.ref, "stats": self.inner.to_dict()}

    def reset(self) -> None:
        self.inner.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return RecordingStats(self.inner.aggregate(_unwrap_stats(other)), self.ref)

    def reduce(self) -> dict[str, int | float]:
        return self.inner.reduce()

    def is_empty(self) -> bool:
        return self.inner.is_empty()


def _unwrap_stats(stats: KVConnectorStats) -> KVConnectorStats:
    return stats.inner if isinstance(stats, RecordingStats) else stats


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


# ---- the trace file ------------------------------------------------------------------------------




class _Trace:
    """Appends one line per call to the trace file: one os.write on an O_APPEND descriptor per
    line, so lines of several processes never interleave and nothing is buffered."""

    def __init__(self, path: str, role: str, label: str) -> None:
        self.path = path
        self.role = role
        self.label = label
        self.step: int | None = None
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._close = weakref.finalize(self, os.close, self.fd)
        header = self.head(HEADER)
        header["result"] = TraceHeader("vllm", str(vllm.__version__), CALL_ORDER).to_result()
        self.write(header)

    def head(self, method: str) -> dict[str, Any]:
        return {"seq": next(TraceProcess.seq), "pid": TraceProcess.pid, "role": self.role,
                "connector": self.label, "step": self.step, "method": method}

    def write(self, rec: dict[str, Any]) -> None:
        if self.fd < 0:  # after shutdown: calls are still forwarded, not recorded
            return
        line = encode_line(rec)
        while line:
            line = line[os.write(self.fd, line):]

    def enter(self, step: int) -> None:
        self.step = step
        self.write(self.head(STEP_MARKER))

    def call(self, rec: dict[str, Any], fn: Callable[..., Any], *args: Any,
             summary: Callable[[Any], Any] | None = None, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
            self.write(rec)
            raise
        if summary is not None:
            try:
                rec["result"] = summary(out)
            except Exception:  # noqa: BLE001  # a malformed answer is the checker's business
                rec["result"] = repr(out)[:_MAX_ERROR_CHARS]
        self.write(rec)
        return out

    def close(self) -> None:
        self.fd = -1
        self._close()


def _ids(ids: Iterable[str] | None) -> list[str]:
    return sorted(ids) if ids else []


def _pair(out: tuple[Any, Any]) -> list[Any]:
    return [out[0], bool(out[1])]


def _kind(out: Any) -> str | None:
    return None if out is None else type(out).__name__


def _num_blocks(blocks: Any) -> int | None:
    groups = getattr(blocks, "blocks", None)  # KVCacheBlocks: one tuple of blocks per group
    return len(groups[0]) if groups else None


# ---- the connector -------------------------------------------------------------------------------


class RecordingConnector(KVConnectorBase_V1):
    """`{"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvport.vllm",
    "kv_connector_extra_config": {"record_trace": PATH, "connector": {...}}}`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cls, inner_ktc, spec = _resolve(vllm_config.kv_transfer_config)
        del cls  # resolved for its error message; the factory loads it again
        self._inner_ktc = inner_ktc
        self._stats_ref = _stats_ref(inner_ktc)
        self._inner: KVConnectorBase_V1 = KVConnectorFactory.create_connector(
            _inner_vllm_config(vllm_config, inner_ktc), role, kv_cache_config)
        outer = vllm_config.kv_transfer_config
        if outer.kv_load_failure_policy != inner_ktc.kv_load_failure_policy:
            # The inner connector set its policy (kvport's, with shared tiers: "recompute");
            # vLLM's scheduler reads the outer config's, right after this returns.
            outer.kv_load_failure_policy = inner_ktc.kv_load_failure_policy
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._after_build = True  # scheduler: the next scheduling call opens a step
        self._next_step = 0
        self._trace: _Trace | None = None
        if spec.record_trace is not None:
            role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
            base = spec.name or type(self._inner).__name__
            self._trace = _Trace(spec.record_trace, role_name,
                                 unique_label(base, spec.record_trace, role_name))
        else:
            for name in _DIRECT_WHEN_OFF:
                setattr(self, name, getattr(self._inner, name))

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the inner connector's own attributes
        # (MultiConnector's sub_connectors, kvport's scheduler_half, ...).
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        path = self._trace.path if self._trace is not None else None
        return f"RecordingConnector({self._inner!r}, record_trace={path!r})"

    @property
    def inner(self) -> KVConnectorBase_V1:
        return self._inner

    @property
    def recording(self) -> bool:
        return self._trace is not None

    # ---- properties and class-level hooks: the inner connector's ------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner_cls, inner, _ = _resolve(vllm_config.kv_transfer_config)
        return inner_cls.get_required_kvcache_layout(_inner_vllm_config(vllm_config, inner))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        spec = parse_recording_config(extra_config)
        inner_cls = _inner_class(_inner_config(_with_role(spec)))
        return bool(inner_cls.requires_piecewise_for_cudagraph(
            dict(spec.inner.get("kv_connector_extra_config") or {})))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33 asks the class named in the config; the inner class answers (the base
        class's default, True, where it has no such hook)."""
        inner_cls, inner, _ = _resolve(kv_transfer_config)
        hook = getattr(inner_cls, "supports_sleep_mode", None)
        return True if hook is None else bool(hook(inner))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        """The inner connector's stats rebuilt from a RecordingStats dict; None without one
        (the dict alone cannot say whose stats they are)."""
        ref, inner_data = _split_stats_dict(data)
        if ref is None:
            return None
        inner_cls = _inner_class(KVTransferConfig(kv_role="kv_both", **ref))
        return inner_cls.build_kv_connector_stats(inner_data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        inner_cls, inner, _ = _resolve(vllm_config.kv_transfer_config)
        metrics = inner_cls.build_prom_metrics(_inner_vllm_config(vllm_config, inner),
                                               metric_types, labelnames, per_engine_labelvalues)
        if metrics is None:
            return None
        return RecordingPromMetrics(metrics, vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

    # ---- recording helpers --------------------------------------------------------------------

    def _rec(self, method: str) -> dict[str, Any]:
        trace = self._trace
        assert trace is not None
        if method in _SCHEDULE_CALLS and self._after_build:
            self._after_build = False
            trace.enter(self._next_step)
            self._next_step += 1
        return trace.head(method)

    def _plain(self, method: str, fn: Callable[..., Any], *args: Any,
               summary: Callable[[Any], Any] | None = None) -> Any:
        if self._trace is None:
            return fn(*args)
        return self._trace.call(self._rec(method), fn, *args, summary=summary)

    def _enter_worker_step(self, meta: Any) -> None:
        trace = self._trace
        if trace is not None and isinstance(meta, RecordingMetadata) and meta.step != trace.step:
            trace.enter(meta.step)

    # ---- worker side --------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        return self._plain("get_mem_pool_context", self._inner.get_mem_pool_context,
                           summary=_kind)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._trace is None:
            return self._inner.register_kv_caches(kv_caches)
        rec = self._rec("register_kv_caches")
        rec["ints"] = [self._num_blocks, self._block_size, len(kv_caches)]
        return self._trace.call(rec, self._inner.register_kv_caches, kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        return self._plain("set_host_xfer_buffer_ops", self._inner.set_host_xfer_buffer_ops,
                           copy_operation)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._trace is None:
            return self._inner.handle_preemptions(_unwrap(kv_connector_metadata))
        self._enter_worker_step(kv_connector_metadata)
        return self._trace.call(self._rec("handle_preemptions"), self._inner.handle_preemptions,
                                _unwrap(kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Bound on the wrapper too: vLLM asks the connector it holds (has_connector_metadata
        # gates the per-layer hooks), and start_load_kv reads the step's facts from it.
        super().bind_connector_metadata(connector_metadata)
        if self._trace is None:
            return self._inner.bind_connector_metadata(connector_metadata)
        self._enter_worker_step(connector_metadata)
        return self._trace.call(self._rec("bind_connector_metadata"),
                                self._inner.bind_connector_metadata, _unwrap(connector_metadata))

    def clear_connector_metadata(self) -> None:
        try:
            return self._plain("clear_connector_metadata", self._inner.clear_connector_metadata)
        finally:
            super().clear_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return self._plain("has_connector_metadata", self._inner.has_connector_metadata,
                           summary=bool)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._trace is None:
            return self._inner.start_load_kv(forward_context, **kwargs)
        rec = self._rec("start_load_kv")
        meta = self._connector_metadata
        if isinstance(meta, RecordingMetadata):
            rec["req_ids"] = meta.req_ids
            rec["ints"] = [1 if meta.has_sync_kv_loads else 0]
        return self._trace.call(rec, self._inner.start_load_kv, forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._trace is None:
            return self._inner.wait_for_layer_load(layer_name)
        rec = self._rec("wait_for_layer_load")
        rec["layer"] = layer_name
        return self._trace.call(rec, self._inner.wait_for_layer_load, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._trace is None:
            return self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        rec = self._rec("save_kv_layer")
        rec["layer"] = layer_name
        return self._trace.call(rec, self._inner.save_kv_layer, layer_name, kv_layer,
                                attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        return self._plain("wait_for_save", self._inner.wait_for_save)

    def finish_forward(self) -> None:
        return self._plain("finish_forward", self._inner.finish_forward)

    def reset_capture_state(self) -> None:
        return self._plain("reset_capture_state", self._inner.reset_capture_state)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._trace is None:
            return self._inner.get_finished(finished_req_ids)
        rec = self._rec("get_finished")
        rec["req_ids"] = _ids(finished_req_ids)
        return self._trace.call(rec, self._inner.get_finished, finished_req_ids,
                                summary=lambda out: [_ids(out[0]), _ids(out[1])])

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Recorded as kvport's get_finished: result [sending, recving], and a third list of
        failed loads when there are any."""
        if self._trace is None:
            return self._inner.get_transfer_results(finished_req_ids)
        rec = self._rec("get_finished")
        rec["req_ids"] = _ids(finished_req_ids)

        def summary(out: Any) -> list[list[str]]:
            result = [_ids(out.finished_sending), _ids(out.finished_recving)]
            failed = getattr(out, "failed_recving", None)
            return [*result, _ids(failed)] if failed else result

        return self._trace.call(rec, self._inner.get_transfer_results, finished_req_ids,
                                summary=summary)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._plain("get_block_ids_with_load_errors",
                           self._inner.get_block_ids_with_load_errors, summary=sorted)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self._plain("get_kv_connector_stats", self._inner.get_kv_connector_stats)
        return None if stats is None else RecordingStats(stats, self._stats_ref)

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self._plain("get_kv_connector_kv_cache_events",
                           self._inner.get_kv_connector_kv_cache_events)

    def get_handshake_metadata(self) -> Any:
        return self._plain("get_handshake_metadata", self._inner.get_handshake_metadata,
                           summary=_kind)

    def build_connector_worker_meta(self) -> Any:
        return self._plain("build_connector_worker_meta",
                           self._inner.build_connector_worker_meta)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33 (sleep mode)."""
        return self._plain("unregister_kv_caches", self._inner.unregister_kv_caches)

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33 (sleep mode)."""
        return self._plain("restore_kv_caches", self._inner.restore_kv_caches)

    def shutdown(self) -> None:
        try:
            return self._plain("shutdown", self._inner.shutdown)
        finally:
            if self._trace is not None:
                self._trace.close()

    # ---- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # Not the base's: it would bind the block pool through the wrapper a second time.
        self._kv_cache_manager = kv_cache_manager
        return self._plain("bind_kv_cache_manager", self._inner.bind_kv_cache_manager,
                           kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        return self._plain("bind_gpu_block_pool", self._inner.bind_gpu_block_pool,
                           gpu_block_pool)

    def get_finished_count(self) -> int | None:
        return self._plain("get_finished_count", self._inner.get_finished_count,
                           summary=lambda out: out)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        return self._plain("set_xfer_handshake_metadata",
                           self._inner.set_xfer_handshake_metadata, metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        return self._plain("set_xfer_handshake_metadata_pp_aware",
                           self._inner.set_xfer_handshake_metadata_pp_aware, metadata)

    def on_new_request(self, request: Request) -> None:
        if self._trace is None:
            return self._inner.on_new_request(request)
        rec = self._rec("on_new_request")
        rec["req_ids"] = [request.request_id]
        return self._trace.call(rec, self._inner.on_new_request, request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._trace is None:
            return self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        rec = self._rec("get_num_new_matched_tokens")
        rec["req_ids"] = [request.request_id]
        rec["ints"] = [num_computed_tokens]
        return self._trace.call(rec, self._inner.get_num_new_matched_tokens, request,
                                num_computed_tokens, summary=_pair)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        if self._trace is None:
            return self._inner.get_loaded_kv_cache_group_ids(request)
        rec = self._rec("get_loaded_kv_cache_group_ids")
        rec["req_ids"] = [request.request_id]
        return self._trace.call(rec, self._inner.get_loaded_kv_cache_group_ids, request,
                                summary=list)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self._trace is None:
            return self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        rec = self._rec("update_state_after_alloc")
        rec["req_ids"] = [request.request_id]
        rec["ints"] = [num_external_tokens]
        rec["num_blocks"] = _num_blocks(blocks)
        return self._trace.call(rec, self._inner.update_state_after_alloc, request, blocks,
                                num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[Any, int]:
        if self._trace is None:
            return self._inner.get_external_cache_hit_sources(request, num_external_tokens)
        rec = self._rec("get_external_cache_hit_sources")
        rec["req_ids"] = [request.request_id]
        rec["ints"] = [num_external_tokens]
        return self._trace.call(rec, self._inner.get_external_cache_hit_sources, request,
                                num_external_tokens,
                                summary=lambda out: {getattr(k, "name", str(k)): v
                                                     for k, v in out.items()})

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._trace is None:
            return self._inner.build_connector_meta(scheduler_output)
        rec = self._rec("build_connector_meta")
        step = self._trace.step
        assert step is not None  # _rec opened it
        scheduled = sorted(scheduler_output.num_scheduled_tokens)
        rec["req_ids"] = scheduled
        rec["ints"] = [scheduler_output.total_num_scheduled_tokens]
        try:
            inner = self._trace.call(rec, self._inner.build_connector_meta, scheduler_output)
        finally:
            self._after_build = True
        return RecordingMetadata(inner, step,
                                 bool(getattr(scheduler_output, "has_sync_kv_loads", False)),
                                 scheduled)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._trace is None:
            return self._inner.update_connector_output(connector_output)
        rec = self._rec("update_connector_output")
        sending = _ids(connector_output.finished_sending)
        recving = _ids(connector_output.finished_recving)
        rec["req_ids"] = sorted(set(sending) | set(recving))
        rec["finished_sending"] = sending
        rec["finished_recving"] = recving
        rec["invalid_block_ids"] = sorted(connector_output.invalid_block_ids or ())
        return self._trace.call(rec, self._inner.update_connector_output, connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._trace is None:
            return self._inner.request_finished(request, block_ids)
        rec = self._rec("request_finished")
        rec["req_ids"] = [request.request_id]
        rec["num_blocks"] = len(block_ids)
        return self._trace.call(rec, self._inner.request_finished, request, block_ids,
                                summary=lambda out: bool(out[0]))

    def register_finished_partial_tail(self, request: Request, block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]) -> bool:
        if self._trace is None:
            return self._inner.register_finished_partial_tail(request, block_ids,
                                                              partial_tail_offloads)
        rec = self._rec("register_finished_partial_tail")
        rec["req_ids"] = [request.request_id]
        rec["num_blocks"] = len(block_ids[0]) if block_ids else 0
        return self._trace.call(rec, self._inner.register_finished_partial_tail, request,
                                block_ids, partial_tail_offloads, summary=bool)

    def take_events(self) -> Iterable[KVCacheEvent]:
        # The inner connector's iterable as is (a generator stays a generator: vLLM tests it
        # for truth), so nothing about the events is recorded but the call.
        return self._plain("take_events", self._inner.take_events)

    def has_pending_block_frees(self) -> bool:
        return self._plain("has_pending_block_frees", self._inner.has_pending_block_frees,
                           summary=bool)

    def has_pending_push_work(self) -> bool:
        return self._plain("has_pending_push_work", self._inner.has_pending_push_work,
                           summary=bool)

    def reset_cache(self) -> bool | None:
        return self._plain("reset_cache", self._inner.reset_cache, summary=lambda out: out)


def _with_role(spec: RecordingSpec) -> RecordingSpec:
    """A spec whose inner config can be built without the outer one (kv_role is required by
    vLLM's KVTransferConfig; only the class is looked up with it)."""
    if "kv_role" in spec.inner:
        return spec
    return RecordingSpec({**spec.inner, "kv_role": "kv_both"}, spec.record_trace, spec.name)
