"""vLLM V1-style scheduler: one token budget per step shared by decodes and (chunked) prefills.

Each request only has `num_computed_tokens` and `num_tokens`; a step schedules
`num_tokens - num_computed_tokens` more tokens for it (capped by the budget), whether that is a
prefill chunk, a whole prompt or one decode token. Running requests go first, in arrival order;
when one cannot get blocks, the newest running request is preempted (its blocks freed, recomputed
later, with prefix-cache hits). Waiting requests are admitted only in steps without preemption.

With a KV connector, admission also asks it for tokens beyond the local prefix hit (sync loads run
in the step, async loads park the request in WAITING_FOR_REMOTE_KVS), and finished requests may
keep their blocks while the connector still reads them. kvport.engine.kv_transfer holds that
bookkeeping; this module calls the connector's scheduler half in the order DESIGN.md gives.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque

from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorBase
from kvport.engine.kv_cache_manager import KVCacheManager
from kvport.engine.kv_transfer import KVTransferTracker
from kvport.engine.outputs import (
    CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput,
)
from kvport.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv_cache_manager: KVCacheManager,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector
        self.requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.failed_in_schedule: list[Request] = []  # failed by a connector hook during schedule()
        self.xfer = KVTransferTracker(self, connector)
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
        self.xfer.on_new_request(request)

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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        # Finished ids not yet delivered to the worker count too: one more step delivers them.
        return bool(self.requests or self.finished_req_ids) or self.xfer.has_pending_work()

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.xfer.trace_step(self.step_id)
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[Request] = []
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
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
                preempted.append(victim)
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, num_new)
            if new_blocks is None:
                break
            if self.xfer.take_resend(req.request_id):
                new_reqs.append(self._new_request_data(req))
            else:
                cached_reqs.append(CachedRequestData(
                    req.request_id, [b.block_id for b in new_blocks], req.num_computed_tokens))
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        skipped: list[Request] = []  # stay at the head of the queue, in order
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.popleft()
            if req.num_output_placeholders:  # preempted while a step for it is in flight
                skipped.append(req)
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self.xfer.resume_after_load(req):
                skipped.append(req)
                continue
            if req.num_computed_tokens == 0:
                hits, num_local = self.kv.get_computed_blocks(req)
                match = self.xfer.match(req, num_local)
                if match is None:  # the connector cannot answer yet, or the request failed
                    if not req.is_finished:
                        skipped.append(req)
                    continue
                num_external, load_async = match
            else:  # resumed after an async load: its blocks are allocated already
                hits, num_local, num_external, load_async = [], req.num_computed_tokens, 0, False
            num_computed = num_local + num_external
            num_new = 0 if load_async else req.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                self.waiting.appendleft(req)
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits, num_external,
                                      delay_cache_blocks=load_async) is None:
                self.waiting.appendleft(req)
                if self._reclaim_from_waiting(skipped + list(self.waiting), keep=req):
                    continue  # try the same request again
                break
            if req.num_computed_tokens == 0:
                self.kv.count_prefix_lookup(req, len(hits))
            if not self.xfer.after_alloc(req, num_external, load_async, num_computed):
                continue  # the connector failed the request
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(req)
                continue
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
                req.first_scheduled_time = now
            new_reqs.append(self._new_request_data(req))
            num_scheduled[req.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids={r.request_id for r in preempted},
            finished_req_ids=self.finished_req_ids,
            step=self.step_id,
        )
        # The connector sees num_computed_tokens before this step's advance.
        out.kv_connector_metadata = self.xfer.build_connector_meta(out)
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # this step samples a token for it
        self.finished_req_ids = set()
        self.step_id += 1
        return out

    def _reclaim_from_waiting(self, candidates: list[Request], keep: Request | None) -> bool:
        """Free the blocks of the newest waiting request that holds some (resumed after an async
        load) and that no transfer still writes. Without this, blocks held in the waiting queue
        could leave the head of the queue, or a lone running request, unable ever to allocate.
        Its KV stays in the prefix cache where published. Returns whether anything was freed."""
        for req in reversed(candidates):
            if req is keep or not self.kv.get_block_ids(req.request_id):
                continue
            if not self.xfer.release_blocks_of_waiting(req):
                continue  # an async load still writes into them
            self.kv.free(req)
            req.num_computed_tokens = 0
            return True
        return False

    def _reaches_limit_in_flight(self, req: Request) -> bool:
        """Under async scheduling: tokens in flight already reach max_tokens / max_model_len."""
        n = req.num_output_placeholders
        return n > 0 and (req.num_output_tokens + n >= req.sampling_params.max_tokens
                          or req.num_tokens + n >= self.config.max_model_len)

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

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[Request]:
        """Append sampled tokens, stop finished requests and free them. Returns those finished."""
        self.xfer.trace_step(sched_out.step)
        now = time.monotonic()
        kv_out = runner_out.kv_connector_output
        finished, self.failed_in_schedule = self.failed_in_schedule, []
        failed = dict(runner_out.failed_req_ids)
        if kv_out is not None and kv_out.errors:
            message = "KV connector failed: " + "; ".join(f"{k}: {v}" for k, v in kv_out.errors.items())
            targets = kv_out.error_req_ids
            failed.update({rid: message for rid in (
                sched_out.num_scheduled_tokens if targets is None else targets)})
        for rid, error in failed.items():
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self.xfer.distrust_step_blocks(req, sched_out)
                finished += self.finish_requests([rid], RequestStatus.FINISHED_ERROR, error)
        skip = self.xfer.handle_invalid_blocks(kv_out.invalid_block_ids if kv_out else set())
        for rid in skip:
            if rid in self.requests and self.xfer.failure_policy == "fail":
                finished += self.finish_requests([rid], RequestStatus.FINISHED_ERROR,
                                                 "KV load failed (kv_load_failure_policy=fail)")
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if (req is None or req.is_finished or rid in skip  # aborted, failed, recomputing
                    or sched_out.step < req.discard_outputs_before_step):
                continue
            tokens = runner_out.sampled_token_ids.get(rid, ())
            if tokens:
                req.num_output_placeholders = max(0, req.num_output_placeholders - 1)
            token_logprobs = runner_out.logprobs.get(rid)
            for j, token in enumerate(tokens):
                req.append_output_token(token, token_logprobs[j] if token_logprobs else None)
                if req.first_token_time is None:
                    req.first_token_time = now
                if req.check_stop(self.config.max_model_len):
                    # Usually running; under async scheduling it may have been preempted since.
                    (self.running if req in self.running else self.waiting).remove(req)
                    self._free_request(req, was_loading=False)
                    finished.append(req)
                    break
        self.xfer.after_step(kv_out)
        return finished

    def fail_detached(self, req: Request, error: str) -> None:
        """Fail a request that schedule() has taken off the waiting queue."""
        req.status = RequestStatus.FINISHED_ERROR
        req.error = error
        self._free_request(req, was_loading=False)
        self.failed_in_schedule.append(req)

    def _free_request(self, req: Request, was_loading: bool) -> None:
        """A finished request leaves the scheduler; its blocks go back to the pool unless the
        connector still reads them (async save) or writes them (a load still in flight)."""
        assert req.is_finished, f"freeing unfinished {req}"
        req.finished_time = time.monotonic()
        del self.requests[req.request_id]
        self._seeds.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        if not self.xfer.hold_blocks_after_finish(req, was_loading):
            self.kv.free(req)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
