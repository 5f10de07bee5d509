"""vLLM V1-style scheduler: one token budget per step shared by decodes and (chunked) prefills.

Each request only has `num_computed_tokens` and `num_tokens`; a step schedules
`num_tokens - num_computed_tokens` more tokens for it (capped by the budget), whether that is a
prefill chunk, a whole prompt or one decode token. Running requests go first, in arrival order;
when one cannot get blocks, the newest running request is preempted (its blocks freed, recomputed
later, with prefix-cache hits). Waiting requests are admitted only in steps without preemption.
"""

from __future__ import annotations

import random
import time
from collections import deque

from kvport.config import EngineConfig
from kvport.engine.kv_cache_manager import KVCacheManager
from kvport.engine.outputs import (
    CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput,
)
from kvport.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self._seen_by_runner: set[str] = set()  # request ids the runner holds state for
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

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Abort (or fail) requests from outside the step loop."""
        assert status.is_finished, f"{status} is not a finished status"
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free_request(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[Request] = []
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = self.kv.allocate_slots(req, num_new)
            while new_blocks is None:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, num_new)
            if new_blocks is None:
                break
            cached_reqs.append(CachedRequestData(
                req.request_id, [b.block_id for b in new_blocks], req.num_computed_tokens))
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
                req.first_scheduled_time = now
            new_reqs.append(NewRequestData(
                req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                req.sampling_params, self._seeds[req.request_id],
                self.kv.get_block_ids(req.request_id), req.num_computed_tokens))
            self._seen_by_runner.add(req.request_id)
            num_scheduled[req.request_id] = num_new
            budget -= num_new

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids={r.request_id for r in preempted},
            finished_req_ids=self.finished_req_ids,
            step=self.step_id,
        )
        # Advance progress now: the next schedule() treats this step's tokens as computed.
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        self.finished_req_ids = set()
        self.step_id += 1
        return out

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
        finished: list[Request] = []
        now = time.monotonic()
        for rid, error in runner_out.failed_req_ids.items():
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                req.error = error
                self.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                finished.append(req)
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished:  # aborted while the step ran
                continue
            token_logprobs = runner_out.logprobs.get(rid)
            for j, token in enumerate(runner_out.sampled_token_ids.get(rid, ())):
                req.append_output_token(token, token_logprobs[j] if token_logprobs else None)
                if req.first_token_time is None:
                    req.first_token_time = now
                if req.check_stop(self.config.max_model_len):
                    self.running.remove(req)
                    self._free_request(req)
                    finished.append(req)
                    break
        return finished

    def _free_request(self, req: Request) -> None:
        assert req.is_finished, f"freeing unfinished {req}"
        req.finished_time = time.monotonic()
        self.kv.free(req)
        del self.requests[req.request_id]
        self._seeds.pop(req.request_id, None)
        if req.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
