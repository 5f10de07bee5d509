"""The scheduler half's jobs in flight: what each one holds, and the per-worker results of each
of its stages.

A job is planned by the scheduler half and run by every worker (one per tensor-parallel rank:
each moves its own shard of the same blocks). A stage of a job is done when every worker has
reported it; the results are merged (a block failed if it failed on any worker). Stages:

    store   COPY (ENGINE -> HOST), then, with a disk tier, WRITE (HOST -> DISK, started by the
            worker itself as soon as its copy finished)
    load    COPY (HOST -> ENGINE; the worker runs a DISK -> HOST promotion before it); a
            synchronous load (host hits only) is copied in start_load_kv, before the forward
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvport.connectors.offloading.metadata import JobResult, Stage

STORE, LOAD = "store", "load"


@dataclass
class Job:
    kind: str  # STORE or LOAD
    req_id: str
    keys: list[bytes]  # STORE: the slots' keys; LOAD: the host hits
    promoted: list[bytes] = field(default_factory=list)  # LOAD: keys promoted from disk
    # Host keys this job pinned (prepare_load), unpinned when it ends: a LOAD's host hits, a
    # STORE's stored keys while its write-through reads their slots.
    pinned: list[bytes] = field(default_factory=list)
    # STORE with a write-through: keys whose copy failed, freed only when every worker's write
    # has ended (a worker whose own copy succeeded may still be writing that slot to disk).
    failed_keys: list[bytes] = field(default_factory=list)
    writes_through: bool = False  # STORE: a WRITE stage follows the COPY


class JobTable:
    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._jobs: dict[int, Job] = {}
        self._partial: dict[tuple[int, Stage], tuple[int, JobResult]] = {}  # seen, merged
        self._next_id = 0

    def add(self, job: Job) -> int:
        self._next_id += 1
        self._jobs[self._next_id] = job
        return self._next_id

    def get(self, job_id: int) -> Job | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: int) -> Job:
        return self._jobs.pop(job_id)

    def complete(self, result: JobResult) -> JobResult | None:
        """Records one worker's result; the merged result once every worker reported this
        stage of the job, else None."""
        if self.num_workers == 1:
            return result
        key = (result.job_id, result.stage)
        seen, merged = self._partial.get(key, (0, None))
        merged = result if merged is None else merged.merged(result)
        if seen + 1 < self.num_workers:
            self._partial[key] = (seen + 1, merged)
            return None
        self._partial.pop(key, None)
        return merged

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._jobs

    def check(self) -> list[str]:
        """Problems with the bookkeeping (the leak check wants none when no job is in flight)."""
        problems = []
        if not self._jobs and self._partial:
            problems.append(f"no job in flight but {len(self._partial)} partial results")
        return problems
