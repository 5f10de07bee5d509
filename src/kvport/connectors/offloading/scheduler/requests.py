"""What the scheduler half keeps per request: its view of the block table and its jobs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvport.connectors.offloading.scheduler.counters import SchedulerCounters
from kvport.connectors.transfer_params import NO_LIMITS, NOTHING, TransferLimits

if TYPE_CHECKING:
    from kvport.connectors.views import RequestView

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    request: RequestView | None = None  # None once finished (kept until its jobs report)
    # The request's block table per KV cache group, as the scheduler output and
    # update_state_after_alloc show it.
    tables: tuple[list[int], ...] = field(default_factory=lambda: ([],))
    next_store_idx: int = 0  # offload blocks below this were offered to the host tier
    store_jobs: set[int] = field(default_factory=set)
    load_job: int | None = None
    load_sync: bool = False  # load_job is a synchronous load (its late parts write our blocks)
    # A load of this request failed: it is not offered another one (the engine recomputes the
    # blocks; offering them again could fail the same way, forever).
    load_failed: bool = False
    hashes_ok: bool = True  # one block hash per engine block (SchedulerCounters)
    # Store jobs in flight that read sliding-window blocks: job id -> (group, its first block
    # the job reads). The engine frees such a block when the window moves past it, while the
    # request runs: the job is then flushed before anything can write the block.
    sliding_reads: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # A boundary (in blocks) where this prompt met a stored prefix (group_hits.py, junction):
    # its sliding windows are stored there too.
    junction: int | None = None
    limits: TransferLimits = NO_LIMITS  # the request's own (kv_transfer_params)

    def engine_jobs(self) -> set[int]:
        """Jobs in flight that read or write the request's engine blocks: its stores until their
        copy ended, a synchronous load until its last part ended. (An async load's blocks are
        the engine's to hold: it keeps a request that finishes while loading.)"""
        jobs = set(self.store_jobs)
        if self.load_job is not None and self.load_sync:
            jobs.add(self.load_job)
        return jobs

    def reset_tables(self, num_groups: int) -> None:
        """The engine freed the request's blocks (preempted, finished)."""
        self.tables = tuple([] for _ in range(num_groups))
        self.next_store_idx = 0

    @property
    def idle(self) -> bool:
        """No job of this request is in flight."""
        return not self.store_jobs and self.load_job is None


def as_tables(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> tuple[list[int], ...]:
    """A block table per KV cache group from what the engine hands a connector: a tuple of
    tables (SupportsHMA), or one table (an engine or adapter that knows one group)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return tuple(list(table) for table in block_ids)  # type: ignore[arg-type]
    return (list(block_ids),)  # type: ignore[arg-type]


class RequestLimits:
    """Each request's own limits (kv_transfer_params), read once per request. Unreadable ones
    cannot fail the request in the scheduler (the engine would stop): it runs with no load and
    no store, logged and counted (num_bad_transfer_params)."""

    def __init__(self, counters: SchedulerCounters) -> None:
        self.counters = counters
        self._limits: dict[str, TransferLimits] = {}

    def of(self, request: RequestView) -> TransferLimits:
        rid = request.request_id
        limits = self._limits.get(rid)
        if limits is None:
            try:
                limits = TransferLimits.parse(request.kv_transfer_params)
            except ValueError as exc:
                logger.warning("OffloadingConnector: request %s: %s; it neither loads nor "
                               "stores", rid, exc)
                self.counters.num_bad_transfer_params += 1
                limits = NOTHING
            self._limits[rid] = limits
        return limits

    def forget(self, req_id: str) -> None:
        self._limits.pop(req_id, None)
