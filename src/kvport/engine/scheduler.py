"""vLLM V1-style scheduler: one token budget per step shared by decodes and (chunked) prefills.

Each request only has `num_computed_tokens` and `num_tokens`; a step schedules
`num_tokens - num_computed_tokens` more tokens for it (capped by the budget), whether that is a
prefill chunk, a whole prompt or one decode token. Running requests go first, in arrival order;
when one cannot get blocks, the newest running request is preempted (its blocks freed, recomputed
later, with prefix-cache hits). Waiting requests are admitted only in steps without preemption.

With a KV connector, admission also asks it for tokens beyond the local prefix hit (sync loads run
in the step, async loads park the request in WAITING_FOR_REMOTE_KVS), and finished requests may
keep their blocks while the connector still reads them. kvport.engine.kv_transfer calls the
connector and keeps its bookkeeping; it answers with outcomes, and this module makes every status
change and every free.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorBase, KVConnectorOutput
from kvport.engine.kv_cache_manager import KVCacheManager
from kvport.engine.kv_transfer import KVTransferTracker, Match, MatchKind
from kvport.engine.recovery import distrust_step_blocks, rewind_to_valid_blocks, step_failures
from kvport.engine.request import Request, RequestStatus
from kvport.engine.step import (
    CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput,
)

logger = logging.getLogger(__name__)


class _Admission(enum.Enum):
    """What became of a request taken off the waiting queue."""

    ADMITTED = enum.auto()  # running from this step
    PARKED = enum.auto()  # waits for an async load; stays in the queue, in order
    NOT_READY = enum.auto()  # cannot run yet; stays in the queue, in order
    FAILED = enum.auto()  # a connector hook failed it: it has left the scheduler
    NO_ROOM = enum.auto()  # the pool cannot supply its blocks now
    NO_BUDGET = enum.auto()  # its prompt does not fit the step (chunked prefill off)


@dataclass
class _StepPlan:
    """One schedule() call's decisions, filled by the running and the waiting parts."""

    budget: int
    now: float
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    has_sync_kv_loads: bool = False  # an admitted request loads external tokens synchronously

    def add(self, req_id: str, num_tokens: int) -> None:
        self.num_scheduled[req_id] = num_tokens
        self.budget -= num_tokens


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv_cache_manager: KVCacheManager,
        connector: KVConnectorBase | None = None,
    ) -> None:
        assert config.max_model_len is not None, "the engine core resolves max_model_len first"
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.kv = kv_cache_manager
        self.connector = connector
        self.requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.failed_in_schedule: list[Request] = []  # failed by a connector hook during schedule()
        self.xfer = KVTransferTracker(connector, kv_cache_manager.block_size)
        ktc = config.kv_transfer_config
        self.load_failure_policy = ktc.kv_load_failure_policy if ktc is not None else "recompute"
        self._resend: set[str] = set()  # req_ids whose runner state must be sent again in full
        self._rng = random.Random(config.seed)
        self._seeds: dict[str, int] = {}  # request_id -> seed of its sampling generator
        self.step_id = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request {request.request_id}"
        seed = request.sampling_params.seed
        # Unseeded requests still get their own generator, seeded in arrival order, so that
        # sampling does not depend on how requests are batched.
        self._seeds[request.request_id] = self._rng.getrandbits(63) if seed is None else seed
        self.requests[request.request_id] = request
        self.waiting.append(request)
        error = self.xfer.on_new_request(request)
        if error is not None:
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR, error)

    def finish_requests(self, request_ids: list[str], status: RequestStatus,
                        error: str | None = None) -> list[Request]:
        """Abort (or fail) requests from outside the step loop. Returns those finished."""
        assert status.is_finished, f"{status} is not a finished status"
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            was_loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            req.status = status
            req.error = error if error is not None else req.error
            self._free_request(req, was_loading)
            done.append(req)
        return done

    def has_pending_work(self) -> bool:
        # Finished ids not yet delivered to the worker count too: one more step delivers them.
        return bool(self.requests or self.finished_req_ids) or self.xfer.has_pending_work()

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.xfer.trace_step(self.step_id)
        plan = _StepPlan(self.config.max_num_batched_tokens, time.monotonic())
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        out = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            preempted_req_ids={r.request_id for r in plan.preempted},
            finished_req_ids=self.finished_req_ids,
            step=self.step_id,
            has_sync_kv_loads=plan.has_sync_kv_loads,
        )
        # The connector sees num_computed_tokens before this step's advance.
        out.kv_connector_metadata = self.xfer.build_connector_meta(out)
        for rid, n in plan.num_scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # this step samples a token for it
        self.finished_req_ids = set()
        self.step_id += 1
        return out

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running requests in arrival order; preempts the newest when blocks run out."""
        i = 0
        while i < len(self.running) and plan.budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens,
                          plan.budget)
            if num_new <= 0 or self._reaches_limit_in_flight(req):
                i += 1
                continue
            new_blocks = self.kv.allocate_slots(req, num_new)
            while new_blocks is None:
                if self._reclaim_from_waiting(list(self.waiting), keep=None):
                    new_blocks = self.kv.allocate_slots(req, num_new)
                    continue
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    return
                new_blocks = self.kv.allocate_slots(req, num_new)
            if req.request_id in self._resend:  # rewound by a failed load: full state again
                self._resend.discard(req.request_id)
                plan.new_reqs.append(self._new_request_data(req))
            else:
                plan.cached_reqs.append(CachedRequestData(
                    req.request_id, tuple([b.block_id for b in group] for group in new_blocks),
                    req.num_computed_tokens))
            plan.add(req.request_id, num_new)
            i += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in order while the budget, the pool and max_num_seqs allow."""
        skipped: list[Request] = []  # stay at the head of the queue, in order
        while (self.waiting and plan.budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.popleft()
            admission = self._admit(req, plan)
            if admission in (_Admission.PARKED, _Admission.NOT_READY):
                skipped.append(req)
            elif admission == _Admission.NO_ROOM:
                self.waiting.appendleft(req)
                if not self._reclaim_from_waiting(skipped + list(self.waiting), keep=req):
                    break
            elif admission == _Admission.NO_BUDGET:
                self.waiting.appendleft(req)
                break
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, req: Request, plan: _StepPlan) -> _Admission:
        if req.num_output_placeholders:  # preempted while a step for it is in flight
            return _Admission.NOT_READY
        if (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and not self._finish_async_load(req)):
            return _Admission.NOT_READY
        match: Match | None = None
        if req.num_computed_tokens == 0:
            hits, num_local = self.kv.get_computed_blocks(req)
            match = self.xfer.match(req, num_local)
            if match.kind == MatchKind.ASK_AGAIN:
                return _Admission.NOT_READY
            if match.kind == MatchKind.FAILED:
                self._fail_detached(req, match.error or "KV connector failed")
                return _Admission.FAILED
        else:  # resumed after an async load: its blocks are allocated already
            hits, num_local = None, req.num_computed_tokens
        num_external = match.num_external_tokens if match is not None else 0
        load_async = match is not None and match.load_async
        num_computed = num_local + num_external
        num_new = 0 if load_async else req.num_tokens - num_computed
        if num_new > plan.budget and not self.config.enable_chunked_prefill:
            return _Admission.NO_BUDGET
        num_new = min(num_new, plan.budget)
        if self.kv.allocate_slots(req, num_new, hits, num_external,
                                  delay_cache_blocks=load_async) is None:
            return _Admission.NO_ROOM
        if match is not None:  # counted once per admission, not per retry
            self.kv.count_prefix_lookup(req, num_local // self.kv.block_size)
        error = self.xfer.after_alloc(req, self.kv.get_block_ids(req.request_id), match)
        if error is not None:
            self._fail_detached(req, error)
            return _Admission.FAILED
        req.num_external_computed_tokens = num_external
        if load_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return _Admission.PARKED
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens is None:  # first admission
            req.num_cached_tokens = num_computed
            req.first_scheduled_time = plan.now
        plan.new_reqs.append(self._new_request_data(req))
        plan.add(req.request_id, num_new)
        if num_external > 0:  # a sync load: an async one parked the request above
            plan.has_sync_kv_loads = True  # the forward reads what start_load_kv loads
        return _Admission.ADMITTED

    def _finish_async_load(self, req: Request) -> bool:
        """For a request in WAITING_FOR_REMOTE_KVS: once its load is reported finished, publish
        what it delivered and make it schedulable again. False while the load runs."""
        num_valid = self.xfer.take_finished_load(req)
        if num_valid is None:
            return False
        if num_valid == 0:  # nothing usable arrived: start over, without the connector
            self.kv.free(req)
        else:
            self.kv.cache_blocks(req, num_valid)
        req.num_computed_tokens = num_valid
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    def _reclaim_from_waiting(self, candidates: list[Request], keep: Request | None) -> bool:
        """Free the blocks of the newest waiting request that holds some (resumed after an async
        load) and that no transfer still writes. Without this, blocks held in the waiting queue
        could leave the head of the queue, or a lone running request, unable ever to allocate.
        Its KV stays in the prefix cache where published. Returns whether anything was freed."""
        for req in reversed(candidates):
            if req is keep or not self.kv.holds_blocks(req.request_id):
                continue
            if (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                    and not self._finish_async_load(req)):
                continue  # an async load still writes into them
            self.kv.free(req)
            req.num_computed_tokens = 0
            return True
        return False

    def _reaches_limit_in_flight(self, req: Request) -> bool:
        """Under async scheduling: tokens in flight already reach max_tokens / max_model_len."""
        n = req.num_output_placeholders
        return n > 0 and (req.num_output_tokens + n >= req.sampling_params.max_tokens
                          or req.num_tokens + n >= self.max_model_len)

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req.request_id, req.prompt_token_ids, list(req.output_token_ids), req.sampling_params,
            self._seeds[req.request_id], self.kv.get_block_ids(req.request_id),
            req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- the step's output ---------------------------------------------------------------

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[Request]:
        """Append sampled tokens, stop finished requests and free them. Returns those finished."""
        self.xfer.trace_step(sched_out.step)
        kv_out: KVConnectorOutput | None = runner_out.kv_connector_output
        finished, self.failed_in_schedule = self.failed_in_schedule, []
        for rid, error in step_failures(sched_out, runner_out).items():
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                distrust_step_blocks(self.kv, req, sched_out)
                finished += self.finish_requests([rid], RequestStatus.FINISHED_ERROR, error)
        invalid = kv_out.invalid_block_ids if kv_out else set()
        loading = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        rewound, resend = rewind_to_valid_blocks(self.kv, self.xfer, self.running, loading,
                                                 invalid, self.step_id)
        self._resend |= resend
        if self.load_failure_policy == "fail":
            finished += self.finish_requests(sorted(rewound), RequestStatus.FINISHED_ERROR,
                                             "KV load failed (kv_load_failure_policy=fail)")
        finished += self._append_outputs(sched_out, runner_out)
        for req in self.xfer.after_step(kv_out):
            self.kv.free(req)  # the connector no longer reads or writes its blocks
        return finished

    def _append_outputs(self, sched_out: SchedulerOutput,
                        runner_out: ModelRunnerOutput) -> list[Request]:
        now = time.monotonic()
        finished: list[Request] = []
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished:  # aborted or failed
                continue
            if sched_out.step < req.discard_outputs_before_step:
                continue  # computed from KV that a failed load rewound (this step or later)
            tokens = runner_out.sampled_token_ids.get(rid, ())
            if tokens:
                req.num_output_placeholders = max(0, req.num_output_placeholders - 1)
            token_logprobs = runner_out.logprobs.get(rid)
            for j, token in enumerate(tokens):
                req.append_output_token(token, token_logprobs[j] if token_logprobs else None)
                if req.first_token_time is None:
                    req.first_token_time = now
                if req.check_stop(self.max_model_len):
                    # Usually running; under async scheduling it may have been preempted since.
                    (self.running if req in self.running else self.waiting).remove(req)
                    self._free_request(req, was_loading=False)
                    finished.append(req)
                    break
        return finished

    def _fail_detached(self, req: Request, error: str) -> None:
        """Fail a request that schedule() has taken off the waiting queue."""
        req.status = RequestStatus.FINISHED_ERROR
        req.error = error
        self._free_request(req, was_loading=False)
        self.failed_in_schedule.append(req)

    def _free_request(self, req: Request, was_loading: bool) -> None:
        """A finished request leaves the scheduler; its blocks go back to the pool unless the
        connector still reads them (async save) or writes them (a load still in flight)."""
        assert req.is_finished, f"freeing unfinished {req}"
        rid = req.request_id
        req.finished_time = time.monotonic()
        del self.requests[rid]
        self._seeds.pop(rid, None)
        self._resend.discard(rid)
        self.finished_req_ids.add(rid)
        if not self.xfer.request_finished(req, self.kv.get_block_ids(rid), was_loading):
            self.kv.free(req)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
