"""What the OffloadingConnector's halves send each other: transfer jobs (scheduler -> worker) and
job results (worker -> scheduler). Plain data, picklable: the worker may run in another process.

Jobs, and the stages a worker reports for each:
    store      COPY: ENGINE -> HOST, full offload blocks a step computed, into slots the manager
               reserved; then, with tiers below host (disk, Redis), WRITE: HOST -> each of them,
               of the slots it filled, which the worker starts itself (no step of the scheduler
               is needed in between) and reports once every tier's write ended
    load       PROMOTION: DISK -> HOST and REDIS -> HOST of the hit's blocks that are not in
               host memory (when any), then COPY: HOST -> ENGINE; one job id, reported once
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvport.connectors.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks, KeyedBlocks
from kvport.connectors.offloading.metrics import TierMetrics, WorkerMetrics


class Stage(enum.Enum):
    COPY = "copy"  # a store's ENGINE -> HOST or a load's HOST -> ENGINE copy
    PROMOTION = "promotion"  # a load's (DISK|REDIS) -> HOST stage, before its copy (not reported)
    WRITE = "write"  # a store's HOST -> (DISK, REDIS) write-through, run after its copy


@dataclass
class StoreJob:
    job_id: int
    src: EngineBlocks  # f engine blocks per offload block, in key order
    dst: HostBlocks
    # One per tier below host (disk, Redis): the keys of dst's slots, written through to that
    # tier once the copy is done. Empty: host memory only.
    writes: list[KeyedBlocks] = field(default_factory=list)
    req_id: str = ""  # whose blocks: none of a step whose synchronous load for it failed is kept


@dataclass
class Promotion:
    """Blocks of one lower tier copied into host slots before a load's copy: entry i of `src`
    fills slot `dst.slot_ids[i]`."""

    src: KeyedBlocks
    dst: HostBlocks


@dataclass
class LoadJob:
    job_id: int
    req_id: str
    # Every offload block of the hit, in token order: the host hits, then the promoted blocks
    # (src's last `num_promoted` slots), which the promotions fill before the copy.
    src: HostBlocks
    dst: EngineBlocks
    # One per lower tier the hit reaches (disk, Redis): each fills some of the promoted slots.
    promotions: list[Promotion] = field(default_factory=list)
    # Engine blocks that cannot be loaded at all (no host slot for their promotion): reported
    # as load errors when the job finishes, so the engine recomputes them.
    unloadable: list[int] = field(default_factory=list)
    # A synchronous load (host hits only, answered is_async=False): the worker copies it in
    # start_load_kv, before the step's forward reads it, and reports no finished_recving.
    sync: bool = False

    @property
    def num_promoted(self) -> int:
        return sum(len(p.dst) for p in self.promotions)


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    # Stores of this step's computed blocks: submitted by get_finished, after the forward
    # wrote them.
    stores: list[StoreJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)  # submitted in start_load_kv
    # Jobs that must finish before this step writes KV: the stores and late synchronous-load
    # parts of requests preempted in this step, whose blocks are free already.
    jobs_to_flush: set[int] = field(default_factory=set)
    # Finished requests whose blocks the engine holds (request_finished answered True) until
    # these jobs stopped reading or writing them: req_id -> job ids. The worker reports each
    # request in finished_sending once its jobs' engine copies ended.
    held: dict[str, list[int]] = field(default_factory=dict)
    # The step computes tokens: without a forward, the worker waits a little for loads in
    # flight instead of returning at once (a no-forward step comes right after).
    did_forward: bool = True


@dataclass
class JobResult:
    """One worker's result for one stage of a job."""

    job_id: int
    success: bool
    # Loads: engine blocks that hold no valid data. Stores (COPY and WRITE): positions (offload
    # blocks, in the job's key order) that were not written.
    failed_indices: list[int] = field(default_factory=list)
    # Loads: positions among the promoted slots (src's last ones) whose promotion failed.
    promote_failed: list[int] = field(default_factory=list)
    stage: Stage = Stage.COPY

    def merged(self, other: JobResult) -> JobResult:
        """The result of a stage that two workers ran (each on its shard): whatever failed on
        either failed."""
        assert (other.job_id, other.stage) == (self.job_id, self.stage), (self, other)
        return JobResult(self.job_id, self.success and other.success,
                         sorted(set(self.failed_indices) | set(other.failed_indices)),
                         sorted(set(self.promote_failed) | set(other.promote_failed)),
                         self.stage)


@dataclass(frozen=True)
class TierChange:
    """What a lower tier (disk, Redis) now holds or no longer holds, by key: written through
    (or found there already) by a store, or dropped by the tier itself (evicted, found gone,
    deleted as bad). The scheduler half announces them as KV cache events."""

    medium: str
    keys: tuple[bytes, ...]
    removed: bool


@dataclass
class OffloadingWorkerMetadata(KVConnectorWorkerMetadata):
    results: list[JobResult] = field(default_factory=list)
    tiers: dict[str, TierMetrics] = field(default_factory=dict)  # medium -> cumulative
    # Jobs whose lower-tier stage passed its deadline this step (deadlines.py): still unreported,
    # but no longer a reason to keep the engine stepping.
    late_jobs: list[int] = field(default_factory=list)
    worker: WorkerMetrics = field(default_factory=WorkerMetrics)  # cumulative
    changes: list[TierChange] = field(default_factory=list)  # in the order they happened

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadingWorkerMetadata:
        """Two workers' metadata of one step: results, late jobs and tier changes together;
        tier snapshots (each tier is shared by the workers' shards) the later one; worker
        counters added."""
        assert isinstance(other, OffloadingWorkerMetadata), f"cannot aggregate {other!r}"
        return OffloadingWorkerMetadata(self.results + other.results,
                                        {**self.tiers, **other.tiers},  # the later snapshot wins
                                        sorted(set(self.late_jobs) | set(other.late_jobs)),
                                        self.worker.plus(other.worker),
                                        self.changes + other.changes)
