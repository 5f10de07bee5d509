"""The scheduler's KV-connector bookkeeping: it calls the connector's scheduler half and keeps
what the connector protocol needs between calls (async loads in flight, held blocks, events).

It never changes a request's status, a queue or a block table: each method returns an outcome
(a `Match`, an error message, the requests whose blocks may now be freed) and the scheduler acts
on it. Request states this bookkeeping follows:

    WAITING --Match(n, async)--> WAITING_FOR_REMOTE_KVS --finished_recving--> WAITING (resumed
        with num_computed_tokens = the tokens the load delivered, capped at num_tokens - 1)
    finished --request_finished True--> held ("send") --finished_sending--> blocks freed
    aborted while loading ---------> held ("recv") --finished_recving--> blocks freed

Connector hooks that raise fail the request they were called for (the scheduler does that with
the message returned here); the engine goes on. Answers outside the contract are corrected and
counted; late, duplicate or unknown completions are ignored and counted.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvport.connectors.base import (
    KVCacheEvent, KVConnectorBase, KVConnectorMetadata, KVConnectorOutput,
)
from kvport.connectors.hma import SupportsHMA, supports_hma
from kvport.connectors.views import CachedRequestRecord, NewRequestRecord, SchedulerOutputRecord

if TYPE_CHECKING:
    from kvport.engine.request import Request
    from kvport.engine.step import SchedulerOutput

logger = logging.getLogger(__name__)

SEND, RECV = "send", "recv"
MAX_EVENTS = 10_000  # events kept for LLM.take_kv_events(); older ones are dropped and counted


@dataclass
class KVTransferCounters:
    num_queried_tokens: int = 0  # prompt tokens asked of the connector (beyond local hits)
    num_hit_tokens: int = 0  # tokens the connector said it could load
    num_invalid_blocks: int = 0  # pool blocks a load failed to fill
    num_ignored_completions: int = 0  # late, duplicate or unknown finished_sending/recving
    num_bad_answers: int = 0  # answers outside the contract, corrected (e.g. (0, True))
    num_hook_errors: int = 0  # scheduler-side hooks that raised
    num_events: int = 0  # KV cache events the connector reported
    num_dropped_events: int = 0  # events dropped because nobody took them (MAX_EVENTS)


class MatchKind(enum.Enum):
    MATCHED = "matched"  # num_external_tokens (maybe 0) and load_async are the answer
    ASK_AGAIN = "ask_again"  # the connector cannot answer yet: leave the request waiting
    FAILED = "failed"  # the hook raised: fail the request with `error`


@dataclass(frozen=True)
class Match:
    """The connector's (corrected) answer for a waiting request with no computed tokens."""

    kind: MatchKind
    num_local_tokens: int = 0  # the engine's own prefix hit the connector was told about
    num_external_tokens: int = 0
    load_async: bool = False
    error: str | None = None


class KVTransferTracker:
    def __init__(self, connector: KVConnectorBase | None, block_size: int,
                 max_events: int = MAX_EVENTS) -> None:
        self.connector = connector
        self.block_size = block_size
        # A SupportsHMA connector gets a block table per KV cache group; others get the one.
        self.hma = connector is not None and supports_hma(connector)
        self._finished_recving: set[str] = set()  # async loads done; resume at next schedule()
        self._async_load_tokens: dict[str, int] = {}  # loading req_id -> tokens valid once loaded
        self._no_external: set[str] = set()  # req_ids whose load delivered nothing: never again
        self._held: dict[str, tuple[Request, set[str]]] = {}  # req_id -> (request, hold reasons)
        self._events: deque[KVCacheEvent] = deque(maxlen=max_events)
        self.stats = KVTransferCounters()

    def trace_step(self, step: int) -> None:
        if self.connector is not None:
            self.connector.trace_step(step)

    # ---- admission ---------------------------------------------------------------------------

    def on_new_request(self, req: Request) -> str | None:
        """on_new_request; an error message if the hook raised (the request must fail)."""
        if self.connector is None:
            return None
        try:
            self.connector.on_new_request(req)
        except Exception as exc:
            return self._hook_failed("on_new_request", req, exc)
        return None

    def match(self, req: Request, num_local: int) -> Match:
        """get_num_new_matched_tokens for a request taken off the waiting queue. May be asked
        again for the same request (ask-again answers, no room in the pool): counts nothing."""
        if self.connector is None or req.request_id in self._no_external:
            return Match(MatchKind.MATCHED, num_local)
        try:
            num_external, is_async = self.connector.get_num_new_matched_tokens(req, num_local)
        except Exception as exc:
            return Match(MatchKind.FAILED, num_local,
                         error=self._hook_failed("get_num_new_matched_tokens", req, exc))
        if num_external is None:
            return Match(MatchKind.ASK_AGAIN, num_local)
        if not isinstance(num_external, int) or isinstance(num_external, bool) or num_external < 0:
            self._bad_answer(req, f"matched tokens {num_external!r}")
            return Match(MatchKind.MATCHED, num_local)
        if num_external == 0 and is_async:
            self._bad_answer(req, "(0, True): an async load of nothing")
            is_async = False
        if not is_async and num_local + num_external >= req.num_tokens:
            # A sync load must leave a token to compute (its logits give the next token).
            self._bad_answer(req, f"sync load of {num_external} tokens covers the whole prompt")
            # Keep it block-aligned: the connector loads whole blocks of what it is granted.
            bs = self.block_size
            num_external = max(0, (req.num_tokens - 1) // bs * bs - num_local)
        return Match(MatchKind.MATCHED, num_local, num_external, bool(is_async))

    def after_alloc(self, req: Request, block_ids: tuple[list[int], ...],
                    match: Match | None) -> str | None:
        """update_state_after_alloc, after the request got its blocks (`match` None: resumed after
        an async load). Counts the admission once. An error message if the hook raised."""
        num_external = match.num_external_tokens if match is not None else 0
        if match is not None and self.connector is not None:
            self.stats.num_queried_tokens += req.num_tokens - match.num_local_tokens
            self.stats.num_hit_tokens += num_external
        if self.connector is not None:
            try:
                self.connector.update_state_after_alloc(
                    req, block_ids if self.hma else one_group(block_ids),  # type: ignore[arg-type]
                    num_external)
            except Exception as exc:
                return self._hook_failed("update_state_after_alloc", req, exc)
        if match is not None and match.load_async:
            self._async_load_tokens[req.request_id] = match.num_local_tokens + num_external
        return None

    def take_finished_load(self, req: Request) -> int | None:
        """For a request in WAITING_FOR_REMOTE_KVS: None while its load runs; once it has been
        reported finished, the tokens it made valid (0: nothing usable, and the connector is
        not asked about this request again)."""
        rid = req.request_id
        if rid not in self._finished_recving:
            return None
        self._finished_recving.discard(rid)
        num_valid = max(0, min(self._async_load_tokens.pop(rid), req.num_tokens - 1))
        if num_valid == 0:
            self._no_external.add(rid)
        return num_valid

    def limit_async_load(self, req_id: str, num_tokens: int) -> None:
        """A load in flight reported failed blocks: at most `num_tokens` will be valid."""
        if req_id in self._async_load_tokens:
            self._async_load_tokens[req_id] = min(self._async_load_tokens[req_id], num_tokens)

    def build_connector_meta(self, out: SchedulerOutput) -> KVConnectorMetadata | None:
        if self.connector is None:
            return None
        return self.connector.build_connector_meta(connector_view(out, self.hma))

    # ---- completion --------------------------------------------------------------------------

    def request_finished(self, req: Request, block_ids: tuple[list[int], ...],
                         was_loading: bool) -> bool:
        """request_finished for a request leaving the scheduler. True: keep its blocks (the
        connector still reads them, or a load still writes them) until after_step returns it."""
        rid = req.request_id
        reasons: set[str] = set()
        if self.connector is not None:
            try:
                if self.hma:
                    delay, _params = cast(SupportsHMA, self.connector).request_finished_all_groups(
                        req, block_ids)
                else:
                    delay, _params = self.connector.request_finished(req, one_group(block_ids))
            except Exception as exc:
                self._hook_failed("request_finished", req, exc)
                delay = False
            if delay:
                reasons.add(SEND)
        if was_loading and rid not in self._finished_recving:
            reasons.add(RECV)
        self._finished_recving.discard(rid)
        self._async_load_tokens.pop(rid, None)
        self._no_external.discard(rid)
        if reasons:
            self._held[rid] = (req, reasons)
            return True
        return False

    def count_invalid_blocks(self, num_blocks: int) -> None:
        self.stats.num_invalid_blocks += num_blocks

    def after_step(self, kv_out: KVConnectorOutput | None) -> list[Request]:
        """update_connector_output, then finished_recving / finished_sending, then take_events.
        Returns the held requests whose blocks may now be freed."""
        if self.connector is None:
            return []
        released: list[Request] = []
        if kv_out is not None:
            try:
                self.connector.update_connector_output(kv_out)
            except Exception:
                self.stats.num_hook_errors += 1
                logger.exception("KV connector update_connector_output failed")
            for rid in sorted(kv_out.finished_recving):
                released += self._on_completion(rid, RECV)
            for rid in sorted(kv_out.finished_sending):
                released += self._on_completion(rid, SEND)
        try:
            events = self.connector.take_events()
        except Exception:
            self.stats.num_hook_errors += 1
            logger.exception("KV connector take_events failed")
            events = []
        self._keep_events(events)
        return released

    def _on_completion(self, rid: str, kind: str) -> list[Request]:
        if kind == RECV and rid in self._async_load_tokens and rid not in self._finished_recving:
            self._finished_recving.add(rid)  # the request resumes at the next schedule()
            return []
        held = self._held.get(rid)
        if held is not None and kind in held[1]:
            held[1].discard(kind)
            if not held[1]:
                del self._held[rid]
                return [held[0]]
            return []
        self.stats.num_ignored_completions += 1
        logger.debug("ignored finished_%s for request %s (late, duplicate or unknown)", kind, rid)
        return []

    def _keep_events(self, events: list[KVCacheEvent]) -> None:
        self.stats.num_events += len(events)
        overflow = len(self._events) + len(events) - (self._events.maxlen or 0)
        if overflow > 0:
            self.stats.num_dropped_events += overflow
        self._events.extend(events)

    def take_events(self) -> list[KVCacheEvent]:
        """The connector's KV cache events (blocks stored or removed) since the last call, oldest
        first; at most `max_events` (older ones were dropped and counted)."""
        events = list(self._events)
        self._events.clear()
        return events

    def has_pending_work(self) -> bool:
        if self._held:
            return True
        return self.connector is not None and self.connector.has_pending_work()

    @property
    def held_request_ids(self) -> list[str]:
        return list(self._held)

    def _hook_failed(self, hook: str, req: Request, exc: Exception) -> str:
        self.stats.num_hook_errors += 1
        error = f"KV connector {hook} failed: {type(exc).__name__}: {exc}"
        logger.warning("request %s: %s", req.request_id, error)
        return error

    def _bad_answer(self, req: Request, what: str) -> None:
        self.stats.num_bad_answers += 1
        logger.warning("request %s: KV connector answered %s; corrected", req.request_id, what)


def one_group(block_ids: tuple[list[int], ...]) -> list[int]:
    """The block table a connector reads: a connector runs with one KV cache group (EngineCore
    forms one when a connector is configured)."""
    assert len(block_ids) == 1, f"a connector sees one KV cache group, not {len(block_ids)}"
    return block_ids[0]


def connector_view(out: SchedulerOutput, all_groups: bool = False) -> SchedulerOutputRecord:
    """The step as a connector reads it (SchedulerOutputView): one block table per request, or
    with `all_groups` (a SupportsHMA connector) a tuple of them, one per KV cache group."""
    def tables(block_ids: tuple[list[int], ...]) -> Any:
        return block_ids if all_groups else one_group(block_ids)

    return SchedulerOutputRecord(
        [NewRequestRecord(n.req_id, tables(n.block_ids), n.num_computed_tokens)
         for n in out.scheduled_new_reqs],
        [CachedRequestRecord(c.req_id, tables(c.new_block_ids), c.num_computed_tokens)
         for c in out.scheduled_cached_reqs],
        out.num_scheduled_tokens, out.total_num_scheduled_tokens, out.preempted_req_ids,
        out.finished_req_ids, out.step, out.has_sync_kv_loads)
