"""The block-reuse fence: no job reads or writes an engine block after it was handed out again.

`request_finished` returns False, so a finished or preempted request's blocks go back to the
pool at once, while its store jobs may not have read them yet. Every step, the pending jobs
that read a block handed out again in this step go into `jobs_to_flush`, with every store job of
a preempted request; the worker finishes them in handle_preemptions, before anything writes KV.

A block is handed out to a request when its block table grows: update_state_after_alloc (an
admitted request: the blocks after its local hit, or those after the table the scheduler half
knew, for a request resumed after its load) and the step's scheduler output (a new request's
table past what was known; a running request's new blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvport.connectors.offloading.metadata import LoadJob
from kvport.connectors.offloading.scheduler.jobs import JobTable


class BlockFence:
    def __init__(self, jobs: JobTable) -> None:
        self.jobs = jobs
        self._fresh: set[int] = set()  # handed out in this step
        # Synchronous loads in flight: job id -> engine blocks it writes (fenced once planned).
        self._sync_loads: dict[int, list[int]] = {}

    def allocated(self, known: Sequence[int], block_ids: Sequence[int],
                  num_local_blocks: int) -> None:
        """update_state_after_alloc: `known` is the table the half knew of the request (empty
        for a new one), `num_local_blocks` its local hit."""
        if known and list(known) == list(block_ids[:len(known)]):
            self._fresh.update(block_ids[len(known):])  # resumed after a load
        else:
            self._fresh.update(block_ids[num_local_blocks:])

    def scheduled(self, known: Sequence[int], block_ids: Sequence[int],
                  num_computed_blocks: int) -> None:
        """A request scheduled with its whole table (new, or resent in full)."""
        if list(known) != list(block_ids[:len(known)]):
            self._fresh.update(block_ids[num_computed_blocks:])
        else:  # admitted (known in full already), or running and sent in full again
            self._fresh.update(block_ids[len(known):])

    def grown(self, new_block_ids: Iterable[int]) -> None:
        """A running request's table grew by these blocks."""
        self._fresh.update(new_block_ids)

    def sync_load(self, load: LoadJob) -> None:
        """A synchronous load was planned: its engine blocks are fenced from the step's end."""
        self._sync_loads[load.job_id] = load.dst.block_ids

    def jobs_to_flush(self, planned: Iterable[LoadJob]) -> set[int]:
        """At the end of the step's schedule: the jobs that read blocks handed out in it. This
        step's synchronous loads write blocks handed out now: fenced from here on. A part that
        outlived its step (its blocks recomputed by their request) does not start after its
        deadline (EngineBlocks.deadline), and one already copying ends within ms; the fence
        makes sure even that one ends before another request gets the blocks."""
        fresh, self._fresh = self._fresh, set()
        flush = self.jobs.readers_of(fresh)
        for load in planned:
            if load.job_id in self._sync_loads:
                self.jobs.fence(load.job_id, self._sync_loads[load.job_id])
        return flush

    def load_ended(self, job_id: int) -> None:
        self._sync_loads.pop(job_id, None)
