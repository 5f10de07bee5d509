"""CallRecorder: a vLLM connector's calls as trace records, with the steps vLLM never names.

vLLM never tells a connector its step, and kvport's checker needs `trace_step` markers.

Scheduler side: a step opens at the first scheduling call after the previous
`build_connector_meta` (get_num_new_matched_tokens, update_state_after_alloc, ..., or that build
itself); `request_finished`, `update_connector_output` and `take_events` of update_from_output
keep the step they follow. vLLM's Scheduler is not patched (that would announce steps exactly,
but changes vLLM's class for every engine in the process and breaks with its internals). The
cost: S1 (one build per step) and S2 (allocations before the build) hold by construction, except
for a step that never built its metadata; and under async scheduling (step N+1 scheduled before
step N's output is processed) update_from_output's records carry step N+1. Per-request rules
(S3-S7) do not depend on steps.

Worker side: the step travels inside the metadata. `build` wraps the inner connector's metadata
in a RecordingMetadata (the step, its has_sync_kv_loads, the scheduled request ids, the blocks
to fingerprint for rule C3: recording_kv.py); the worker
enters the step when the metadata first arrives (handle_preemptions, else bind: `received`) and
hands the inner connector only the inner metadata.

Without a writer (recording off) every call only runs, and no metadata is wrapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvport.trace.fields import schedule_fields, sorted_ids
from kvport.trace.identity import BLOCKS_MARKER
from kvport.trace.writer import Record, TraceWriter
from kvport.vllm.compat import require_vllm
from kvport.vllm.recording_kv import KvPlan

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

# Scheduler calls that belong to schedule(): the first one after a build opens the next step.
SCHEDULE_CALLS = frozenset({
    "get_num_new_matched_tokens", "get_loaded_kv_cache_group_ids", "update_state_after_alloc",
    "get_external_cache_hit_sources", "has_pending_block_frees", "build_connector_meta",
})


class RecordingMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the inner connector's metadata and what the worker records with it."""

    def __init__(self, inner: KVConnectorMetadata, step: int, has_sync_kv_loads: bool,
                 req_ids: list[str], kv_plan: KvPlan | None = None) -> None:
        self.inner = inner
        self.step = step
        self.has_sync_kv_loads = has_sync_kv_loads
        self.req_ids = req_ids  # scheduled in the step, sorted
        self.kv_plan = kv_plan  # what the worker fingerprints for rule C3 (recording_kv.py)

    def __repr__(self) -> str:
        return (f"RecordingMetadata(step={self.step}, sync={self.has_sync_kv_loads}, "
                f"inner={self.inner!r})")


def unwrap(meta: Any) -> Any:
    """The inner connector's part of the metadata."""
    return meta.inner if isinstance(meta, RecordingMetadata) else meta


class CallRecorder:
    def __init__(self, writer: TraceWriter | None) -> None:
        self.writer = writer
        self._after_build = True  # scheduler: the next scheduling call opens a step
        self._next_step = 0

    def call(self, method: str, fn: Callable[..., Any], /, *args: Any,
             fields: Record | None = None, summary: Callable[[Any], Any] | None = None,
             **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, recorded as `method` with `fields` (TraceWriter.call)."""
        writer = self.writer
        if writer is None:
            return fn(*args, **kwargs)
        self._enter(method, writer)
        return writer.call(method, fn, *args, fields=fields, summary=summary, **kwargs)

    def _enter(self, method: str, writer: TraceWriter) -> None:
        """A scheduling call after a build opens the next step."""
        if method in SCHEDULE_CALLS and self._after_build:
            self._after_build = False
            self._next_step += 1
            writer.start_step(self._next_step - 1)

    def blocks(self, before: str, records: Iterable[Record]) -> None:
        """`trace_blocks` records (kvport.trace.identity), written ahead of the call `before`
        (in its step)."""
        writer = self.writer
        if writer is None:
            return
        for fields in records:
            self._enter(before, writer)
            writer.note(BLOCKS_MARKER, fields)

    def note(self, method: str, records: Iterable[Record]) -> None:
        """Marker records of the worker's current step."""
        if self.writer is not None:
            for fields in records:
                self.writer.note(method, fields)

    def build(self, fn: Callable[[SchedulerOutput], KVConnectorMetadata],
              scheduler_output: SchedulerOutput,
              plan: Callable[[SchedulerOutput, dict[str, int]], KvPlan | None] | None = None,
              ) -> KVConnectorMetadata:
        """build_connector_meta: it ends the step; the metadata is wrapped for the worker, with
        `plan`'s KvPlan when given."""
        if self.writer is None:
            return fn(scheduler_output)
        before = computed_before(scheduler_output)
        fields = schedule_fields(scheduler_output.num_scheduled_tokens,
                                 scheduler_output.total_num_scheduled_tokens, before)
        try:
            inner = self.call("build_connector_meta", fn, scheduler_output, fields=fields)
        finally:
            self._after_build = True
        step = self.writer.step
        assert step is not None  # the build opened it, if no call before it did
        return RecordingMetadata(inner, step,
                                 bool(getattr(scheduler_output, "has_sync_kv_loads", False)),
                                 fields["req_ids"],
                                 plan(scheduler_output, before) if plan is not None else None)

    def received(self, meta: Any) -> Any:
        """Worker: the step's metadata arrived; enters its step (once). Returns the inner
        connector's part."""
        writer = self.writer
        if writer is not None and isinstance(meta, RecordingMetadata) and meta.step != writer.step:
            writer.start_step(meta.step)
        return unwrap(meta)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def computed_before(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's tokens computed before the step (vLLM's new and cached
    requests' num_computed_tokens)."""
    before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    return before


def load_fields(meta: Any) -> Record | None:
    """start_load_kv's record fields, from the bound metadata: the step's scheduled requests and
    whether it has synchronous loads (where start_load_kv belongs under vllm-0.32)."""
    if not isinstance(meta, RecordingMetadata):
        return None
    return {"req_ids": meta.req_ids, "ints": [1 if meta.has_sync_kv_loads else 0]}


def group_tables(blocks: Any) -> Any:
    """KVCacheBlocks' blocks: one tuple of blocks per KV cache group (None if it has none)."""
    return getattr(blocks, "blocks", None) or None


def transfer_result(out: Any) -> list[list[str]]:
    """get_transfer_results' answer as get_finished's, plus the failed loads when any."""
    result = [sorted_ids(out.finished_sending), sorted_ids(out.finished_recving)]
    failed = getattr(out, "failed_recving", None)
    return [*result, sorted_ids(failed)] if failed else result
