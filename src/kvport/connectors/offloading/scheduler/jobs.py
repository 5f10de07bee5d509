"""The scheduler half's jobs in flight: what each one holds, which engine blocks its stores read
(the block-reuse fence), and the per-worker results of each of its stages.

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
    # The fence: engine blocks a STORE reads, or a synchronous LOAD writes. None of them is
    # written (handed out again, or computed by its request) before the job ended.
    engine_blocks: list[int] = field(default_factory=list)
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
        self._readers: dict[int, set[int]] = {}  # engine block -> jobs touching it (fence)
        self._partial: dict[tuple[int, Stage], tuple[int, JobResult]] = {}  # seen, merged
        self._next_id = 0

    def add(self, job: Job) -> int:
        self._next_id += 1
        self._jobs[self._next_id] = job
        self.fence(self._next_id, job.engine_blocks)
        return self._next_id

    def fence(self, job_id: int, blocks: list[int]) -> None:
        """Put the job's engine blocks under the fence (until `release_reads`)."""
        job = self._jobs[job_id]
        job.engine_blocks = list(blocks)
        for b in blocks:
            self._readers.setdefault(b, set()).add(job_id)

    def get(self, job_id: int) -> Job | None:
        return self._jobs.get(job_id)

    def pop(self, job_id: int) -> Job:
        return self._jobs.pop(job_id)

    def readers_of(self, blocks: set[int]) -> set[int]:
        """Jobs in flight under the fence for any of these engine blocks."""
        out: set[int] = set()
        for b in blocks:
            out |= self._readers.get(b, set())
        return out

    def release_reads(self, job_id: int, job: Job) -> None:
        """The job's copy is done with its engine blocks: the fence no longer waits for it."""
        for b in job.engine_blocks:
            readers = self._readers.get(b)
            if readers is not None:
                readers.discard(job_id)
                if not readers:
                    del self._readers[b]

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

    @property
    def num_readers(self) -> int:
        return len(self._readers)

    def check(self) -> list[str]:
        """Problems with the bookkeeping (the leak check wants none when no job is in flight)."""
        problems = []
        if not self._jobs and (self._readers or self._partial):
            problems.append(f"no job in flight but {len(self._readers)} blocks with readers and "
                            f"{len(self._partial)} partial results")
        return problems
