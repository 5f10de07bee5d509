"""What the OffloadingConnector's halves send each other: transfer jobs (scheduler -> worker) and
job results (worker -> scheduler). Plain data, picklable: the worker may run in another process.

Job kinds:
    store      ENGINE -> HOST: full offload blocks a step computed, into slots the manager reserved
    load       [DISK -> HOST promotion, then] HOST -> ENGINE: a request's hit, one job id
    write      HOST -> DISK: write-through of slots a store just filled (the slots stay pinned)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvport.connectors.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from kvport.connectors.offloading.mediums import DiskBlocks, EngineBlocks, HostBlocks

STORE, LOAD, WRITE = "store", "load", "write"


@dataclass
class StoreJob:
    job_id: int
    src: EngineBlocks  # f engine blocks per offload block, in key order
    dst: HostBlocks


@dataclass
class WriteJob:
    job_id: int
    src: HostBlocks
    dst: DiskBlocks


@dataclass
class LoadJob:
    job_id: int
    req_id: str
    src: HostBlocks  # every offload block of the hit, host hits first, then promoted ones
    dst: EngineBlocks
    # Promotion of the hit's disk-only blocks into their host slots, run first: `promote_src`
    # entry i fills `promote_dst` slot i; those slots are the last len(promote_dst) of src.
    promote_src: DiskBlocks | None = None
    promote_dst: HostBlocks | None = None
    # Engine blocks that cannot be loaded at all (no host slot for their promotion): reported
    # as load errors when the job finishes, so the engine recomputes them.
    unloadable: list[int] = field(default_factory=list)


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    # Stores of this step's computed blocks: queued by get_finished (after the forward wrote
    # them) and submitted at the start of the next step.
    stores: list[StoreJob] = field(default_factory=list)
    writes: list[WriteJob] = field(default_factory=list)  # submitted at the start of this step
    loads: list[LoadJob] = field(default_factory=list)  # submitted in start_load_kv
    # Store jobs that must finish before this step writes KV: they read blocks that were freed
    # (preemption, finished request) and are handed out again in this step.
    jobs_to_flush: set[int] = field(default_factory=set)


@dataclass
class JobResult:
    job_id: int
    success: bool
    # For loads: positions in the destination that hold no valid data. For stores and writes:
    # positions (offload blocks) that were not written.
    failed_indices: list[int] = field(default_factory=list)
    promote_failed: list[int] = field(default_factory=list)  # loads: positions in promote_dst


@dataclass
class OffloadingWorkerMetadata(KVConnectorWorkerMetadata):
    results: list[JobResult] = field(default_factory=list)
    tier_stats: dict[str, dict[str, float]] = field(default_factory=dict)  # tier -> cumulative

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadingWorkerMetadata:
        assert isinstance(other, OffloadingWorkerMetadata), f"cannot aggregate {other!r}"
        stats = dict(self.tier_stats)
        for tier, values in other.tier_stats.items():  # cumulative: the later snapshot wins
            stats[tier] = values
        return OffloadingWorkerMetadata(self.results + other.results, stats)
