"""What the scheduler half keeps per request: its view of the block table and its jobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvport.connectors.views import RequestView


@dataclass
class ReqState:
    request: RequestView | None = None  # None once finished (kept until its jobs report)
    # The request's block table, as the scheduler output and update_state_after_alloc show it.
    block_ids: list[int] = field(default_factory=list)
    next_store_idx: int = 0  # offload blocks below this were offered to the host tier
    store_jobs: set[int] = field(default_factory=set)
    load_job: int | None = None
    load_sync: bool = False  # load_job is a synchronous load (its late parts write our blocks)
    # A load of this request failed: it is not offered another one (the engine recomputes the
    # blocks; offering them again could fail the same way, forever).
    load_failed: bool = False
    hashes_ok: bool = True  # one block hash per engine block (SchedulerCounters)

    def engine_jobs(self) -> set[int]:
        """Jobs in flight that read or write the request's engine blocks: its stores until their
        copy ended, a synchronous load until its last part ended. (An async load's blocks are
        the engine's to hold: it keeps a request that finishes while loading.)"""
        jobs = set(self.store_jobs)
        if self.load_job is not None and self.load_sync:
            jobs.add(self.load_job)
        return jobs

    @property
    def idle(self) -> bool:
        """No job of this request is in flight."""
        return not self.store_jobs and self.load_job is None
