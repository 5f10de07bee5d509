"""The scheduler's KV-connector bookkeeping: async loads, held blocks, failed loads.

Request states this adds, and who moves them:

    WAITING --match (n, async)--> WAITING_FOR_REMOTE_KVS --finished_recving--> WAITING (resumed
        with num_computed_tokens = the tokens the load delivered, capped at num_tokens - 1)
    finished --request_finished True--> held ("send") --finished_sending--> blocks freed
    aborted while loading ---------> held ("recv") --finished_recving--> blocks freed

A failed load (`invalid_block_ids`) truncates every request whose block table holds a failed
block to the last good block before it; those blocks and all after them leave the prefix cache,
and the request recomputes them (or fails, with kv_load_failure_policy="fail").

Connector hooks that raise fail the request they were called for; the engine goes on. Late,
duplicate or unknown completions are ignored and counted.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvport.connectors.base import KVCacheEvent, KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from kvport.engine.outputs import SchedulerOutput
from kvport.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvport.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

SEND, RECV = "send", "recv"


@dataclass
class KVTransferStats:
    num_queried_tokens: int = 0  # prompt tokens asked of the connector (beyond local hits)
    num_hit_tokens: int = 0  # tokens the connector said it could load
    num_invalid_blocks: int = 0  # pool blocks a load failed to fill
    num_ignored_completions: int = 0  # late, duplicate or unknown finished_sending/recving
    num_bad_answers: int = 0  # answers outside the contract, corrected (e.g. (0, True))
    num_hook_errors: int = 0  # scheduler-side hooks that raised


class KVTransferTracker:
    def __init__(self, scheduler: Scheduler, connector: KVConnectorBase | None) -> None:
        self.s = scheduler
        self.connector = connector
        ktc = scheduler.config.kv_transfer_config
        self.failure_policy = ktc.kv_load_failure_policy if ktc is not None else "recompute"
        self._finished_recving: set[str] = set()  # async loads done; resume at next schedule()
        self._async_load_tokens: dict[str, int] = {}  # req_id -> tokens valid once loaded
        self._no_external: set[str] = set()  # req_ids whose load failed: never load them again
        self._held: dict[str, tuple[Request, set[str]]] = {}  # req_id -> (request, hold reasons)
        self._resend: set[str] = set()  # req_ids whose runner state must be sent again in full
        self.events: deque[KVCacheEvent] = deque(maxlen=10_000)
        self._trace_step = getattr(connector, "trace_step", None)  # only a recorder has it
        self.stats = KVTransferStats()

    # ---- admission ---------------------------------------------------------------------------

    def trace_step(self, step: int) -> None:
        if self._trace_step is not None:
            self._trace_step(step)

    def on_new_request(self, req: Request) -> None:
        if self.connector is not None:
            try:
                self.connector.on_new_request(req)
            except Exception as exc:
                self._hook_failed("on_new_request", req, exc)
                self.s.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR, req.error)

    def match(self, req: Request, num_local: int) -> tuple[int, bool] | None:
        """The connector's answer for a request taken off the waiting queue (None: skip it now;
        the request may have failed). Answers outside the contract are corrected and counted."""
        if self.connector is None or req.request_id in self._no_external:
            return 0, False
        try:
            num_external, is_async = self.connector.get_num_new_matched_tokens(req, num_local)
        except Exception as exc:
            self._hook_failed("get_num_new_matched_tokens", req, exc)
            self.s.fail_detached(req, req.error or "")
            return None
        if num_external is None:
            return None
        if not isinstance(num_external, int) or num_external < 0:
            self._bad_answer(req, f"matched tokens {num_external!r}")
            return 0, False
        if num_external == 0 and is_async:
            self._bad_answer(req, "(0, True): an async load of nothing")
            is_async = False
        if not is_async and num_local + num_external >= req.num_tokens:
            # A sync load must leave a token to compute (its logits give the next token).
            self._bad_answer(req, f"sync load of {num_external} tokens covers the whole prompt")
            # Keep it block-aligned: the connector loads whole blocks of what it is granted.
            bs = self.s.kv.block_size
            num_external = max(0, (req.num_tokens - 1) // bs * bs - num_local)
        self.stats.num_queried_tokens += req.num_tokens - num_local
        self.stats.num_hit_tokens += num_external
        return num_external, bool(is_async)

    def after_alloc(self, req: Request, num_external: int, load_async: bool, num_computed: int) -> bool:
        """update_state_after_alloc; False if the connector failed the request."""
        if self.connector is not None:
            try:
                block_ids = self.s.kv.get_block_ids(req.request_id)
                self.connector.update_state_after_alloc(req, block_ids, num_external)
            except Exception as exc:
                self._hook_failed("update_state_after_alloc", req, exc)
                self.s.fail_detached(req, req.error or "")
                return False
        req.num_external_computed_tokens = num_external
        if load_async:
            self._async_load_tokens[req.request_id] = num_computed
        return True

    def resume_after_load(self, req: Request) -> bool:
        """For a request in WAITING_FOR_REMOTE_KVS: True (and ready to schedule) once its load
        has been reported finished."""
        rid = req.request_id
        if rid not in self._finished_recving:
            return False
        self._finished_recving.discard(rid)
        num_valid = min(self._async_load_tokens.pop(rid), req.num_tokens - 1)
        if num_valid <= 0:  # nothing usable arrived: start over, without the connector
            self.s.kv.free(req)
            self._no_external.add(rid)
            num_valid = 0
        else:
            self.s.kv.cache_blocks(req, num_valid)
        req.num_computed_tokens = num_valid
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    def release_blocks_of_waiting(self, req: Request) -> bool:
        """Whether a waiting request's blocks may be freed; publishes what an async load has
        already delivered, so a later admission finds it in the prefix cache."""
        rid = req.request_id
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return True
        if rid not in self._finished_recving:
            return False
        self._finished_recving.discard(rid)
        num_valid = min(self._async_load_tokens.pop(rid), req.num_tokens - 1)
        if num_valid > 0:
            self.s.kv.cache_blocks(req, num_valid)
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata | None:
        if self.connector is None:
            return None
        return self.connector.build_connector_meta(out)

    def take_resend(self, rid: str) -> bool:
        if rid in self._resend:
            self._resend.discard(rid)
            return True
        return False

    # ---- completion --------------------------------------------------------------------------

    def hold_blocks_after_finish(self, req: Request, was_loading: bool) -> bool:
        """request_finished for a request leaving the scheduler. True: keep its blocks (the
        connector still reads them, or a load still writes them) until the worker reports."""
        rid = req.request_id
        reasons: set[str] = set()
        if self.connector is not None:
            try:
                delay, _params = self.connector.request_finished(req, self.s.kv.get_block_ids(rid))
            except Exception as exc:
                self._hook_failed("request_finished", req, exc)
                delay = False
            if delay:
                reasons.add(SEND)
        if was_loading and rid not in self._finished_recving:
            reasons.add(RECV)
        self._finished_recving.discard(rid)
        self._async_load_tokens.pop(rid, None)
        self._resend.discard(rid)
        self._no_external.discard(rid)
        if reasons:
            self._held[rid] = (req, reasons)
            return True
        return False

    def handle_invalid_blocks(self, invalid: set[int]) -> set[str]:
        """Truncate every request holding a block that a load failed to fill. Returns their ids
        (their sampled tokens of this step are discarded)."""
        if not invalid:
            return set()
        self.stats.num_invalid_blocks += len(invalid)
        kv, bs = self.s.kv, self.s.kv.block_size
        affected: set[str] = set()
        loading = [r for r in self.s.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        for req in self.s.running + loading:
            table = kv.get_block_ids(req.request_id)
            first = next((i for i, b in enumerate(table) if b in invalid), None)
            if first is None:
                continue
            affected.add(req.request_id)
            kv.uncache_blocks_from(req, first)
            good = first * bs
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._async_load_tokens[req.request_id] = min(
                    self._async_load_tokens.get(req.request_id, 0), good)
            else:
                req.num_computed_tokens = min(req.num_computed_tokens, good)
                req.num_cached_tokens = min(req.num_cached_tokens, good)
                req.num_external_computed_tokens = 0
                # Steps already scheduled for it (async scheduling) computed from bad KV.
                req.num_output_placeholders = 0
                req.discard_outputs_before_step = self.s.step_id
                self._resend.add(req.request_id)
        for block_id in invalid:
            if 0 <= block_id < kv.pool.num_blocks:
                kv.pool.uncache_block(kv.pool.blocks[block_id])
        return affected

    def distrust_step_blocks(self, req: Request, out: SchedulerOutput) -> None:
        """A step failed: withdraw from the prefix cache every block it computed or loaded."""
        first_token = req.num_computed_tokens - out.num_scheduled_tokens.get(req.request_id, 0)
        if any(n.req_id == req.request_id for n in out.scheduled_new_reqs):
            first_token -= req.num_external_computed_tokens
        self.s.kv.uncache_blocks_from(req, max(0, first_token) // self.s.kv.block_size)

    def after_step(self, kv_out: KVConnectorOutput | None) -> None:
        """update_connector_output, then finished_recving / finished_sending, then events."""
        if self.connector is None:
            return
        if kv_out is not None:
            try:
                self.connector.update_connector_output(kv_out)
            except Exception:
                self.stats.num_hook_errors += 1
                logger.exception("KV connector update_connector_output failed")
            for rid in sorted(kv_out.finished_recving):
                self._on_completion(rid, RECV)
            for rid in sorted(kv_out.finished_sending):
                self._on_completion(rid, SEND)
        try:
            self.events.extend(self.connector.take_events())
        except Exception:
            self.stats.num_hook_errors += 1
            logger.exception("KV connector take_events failed")

    def _on_completion(self, rid: str, kind: str) -> None:
        req = self.s.requests.get(rid)
        if (kind == RECV and req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and rid not in self._finished_recving):
            self._finished_recving.add(rid)
            return
        held = self._held.get(rid)
        if held is not None and kind in held[1]:
            held[1].discard(kind)
            if not held[1]:
                del self._held[rid]
                self.s.kv.free(held[0])
            return
        self.stats.num_ignored_completions += 1
        logger.debug("ignored finished_%s for request %s (late, duplicate or unknown)", kind, rid)

    def has_pending_work(self) -> bool:
        if self._held:
            return True
        return self.connector is not None and self.connector.has_pending_work()

    @property
    def held_request_ids(self) -> list[str]:
        return list(self._held)

    def _hook_failed(self, hook: str, req: Request, exc: Exception) -> None:
        self.stats.num_hook_errors += 1
        req.error = f"KV connector {hook} failed: {type(exc).__name__}: {exc}"
        logger.warning("request %s: %s", req.request_id, req.error)

    def _bad_answer(self, req: Request, what: str) -> None:
        self.stats.num_bad_answers += 1
        logger.warning("request %s: KV connector answered %s; corrected", req.request_id, what)
