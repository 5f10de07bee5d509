"""The OffloadingConnector's worker half: runs the jobs the scheduler half planned.

Every step, in the driver's order:
    handle_preemptions  submit the stores queued last step, then this step's write-throughs, then
                        wait for `jobs_to_flush` (stores reading blocks handed out again now)
    start_load_kv       submit this step's loads (a promotion DISK->HOST first when needed)
    get_finished        queue this step's stores (the forward has written their blocks), poll
                        completions: a promotion that finished starts its HOST->ENGINE copy;
                        a finished load reports its request in finished_recving and its failed
                        engine blocks as load errors
Nothing is left to wait_for_save, which no-forward steps skip.

Job ids come from the scheduler half. Transfers are submitted under a `TransferKey` (job id,
stage): a load with disk-only blocks runs its PROMOTION (DISK->HOST) first, then its COPY.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import DISK, HOST, EngineBlocks, HostBlocks, LoadStoreSpec
from kvport.connectors.offloading.metadata import (
    JobResult, LoadJob, OffloadingConnectorMetadata, OffloadingWorkerMetadata, StoreJob,
)
from kvport.connectors.offloading.tiers.disk import DiskTier
from kvport.connectors.offloading.tiers.host import HostTier
from kvport.connectors.offloading.transfers import (
    OffloadingWorker, TransferResult, build_tier_worker,
)

logger = logging.getLogger(__name__)

TransfersFactory = Callable[[HostTier, "DiskTier | None"], OffloadingWorker]
IDLE_WAIT_S = 0.002  # a step with no forward waits this long for a transfer, instead of spinning


class Stage(enum.Enum):
    COPY = "copy"  # a store, a write-through, or a load's HOST->ENGINE copy
    PROMOTION = "promotion"  # a load's DISK->HOST stage, run before its copy


@dataclass(frozen=True)
class TransferKey:
    """The id a transfer is submitted under: the scheduler half's job id and the job's stage."""

    job_id: int
    stage: Stage = Stage.COPY


@dataclass
class _Load:
    job: LoadJob
    engine_failed: list[int]  # engine block ids left without valid KV
    promote_failed: list[int] = field(default_factory=list)  # positions in job.promote_dst
    copy_dst: list[int] = field(default_factory=list)  # engine blocks of the HOST->ENGINE copy


class OffloadingConnectorWorker:
    def __init__(self, config: OffloadingConfig,
                 make_transfers: TransfersFactory = build_tier_worker) -> None:
        self.config = config
        self._make_transfers = make_transfers
        self.geometry: OffloadGeometry | None = None  # set by register_kv_caches
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.transfers: OffloadingWorker | None = None
        self._queued: list[StoreJob] = []  # planned last step, submitted at the start of this one
        self._loads: dict[int, _Load] = {}  # job id -> load in flight
        self._in_flight: set[TransferKey] = set()  # submitted to the transfers, not reported
        self._ready: list[_Load] = []  # loads done, to report in this step's get_finished
        self._results: list[JobResult] = []  # for the next worker metadata
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_cache: torch.Tensor, geometry: OffloadGeometry) -> None:
        self.geometry = geometry
        self.host = HostTier.for_pool(kv_cache, geometry.num_slots, geometry.block_factor)
        assert self.host.slot_bytes == geometry.slot_bytes, \
            f"host slots of {self.host.slot_bytes} bytes, geometry says {geometry.slot_bytes}"
        disk = self.config.disk_tier
        if disk is not None:
            self.disk = DiskTier(disk.root_dir, disk.max_bytes, geometry.disk_namespace)
        self.transfers = self._make_transfers(self.host, self.disk)

    def handle_preemptions(self, meta: OffloadingConnectorMetadata) -> None:
        queued, self._queued = self._queued, []
        for job in queued:
            self._submit(TransferKey(job.job_id), job.src, job.dst)
        for write in meta.writes:
            self._submit(TransferKey(write.job_id), write.src, write.dst)
        if meta.jobs_to_flush:
            # NOTE: no timeout: the stores copy memory into host slots, which cannot hang, and
            # returning early would let this step's forward overwrite what they still read.
            self._transfers().wait([TransferKey(j) for j in meta.jobs_to_flush])

    def start_load_kv(self, meta: OffloadingConnectorMetadata) -> None:
        for job in meta.loads:
            load = _Load(job, engine_failed=list(job.unloadable))
            self._loads[job.job_id] = load
            if job.promote_src is not None:
                assert job.promote_dst is not None, f"load {job.job_id}: promotion without slots"
                self._submit(TransferKey(job.job_id, Stage.PROMOTION), job.promote_src,
                             job.promote_dst)
            else:
                self._start_copy(load, job.src, job.dst)

    def get_finished(self, meta: OffloadingConnectorMetadata | None,
                     did_forward: bool) -> set[str]:
        """Queues this step's stores; returns the requests whose load finished."""
        if meta is not None:
            self._queued.extend(meta.stores)
        transfers = self._transfers()
        done = transfers.get_finished()
        if not done and not did_forward and self._in_flight:
            transfers.wait(self._in_flight, timeout=IDLE_WAIT_S)
            done = transfers.get_finished()
        for result in done:
            key = result.job_id
            assert isinstance(key, TransferKey), f"not a transfer of this worker: {key!r}"
            self._in_flight.discard(key)
            load = self._loads.get(key.job_id)
            if load is not None and key.stage is Stage.PROMOTION:
                self._on_promoted(load, result)
            elif load is not None:
                load.engine_failed += [load.copy_dst[i] for i in result.failed_indices]
                self._ready.append(load)
            else:
                self._results.append(JobResult(key.job_id, result.success,
                                               list(result.failed_indices)))
        ready, self._ready = self._ready, []
        return {self._finish_load(load) for load in ready}

    def _on_promoted(self, load: _Load, result: TransferResult) -> None:
        """The promotion finished: copy every block that is in host memory now to the engine."""
        job = load.job
        assert job.promote_dst is not None
        load.promote_failed = list(result.failed_indices)
        num_host = len(job.src.slot_ids) - len(job.promote_dst.slot_ids)
        bad = {num_host + p for p in load.promote_failed}  # offload block positions in src
        f, skip = self._factor(), job.dst.skip
        slots: list[int] = []
        dst: list[int] = []
        for j, slot in enumerate(job.src.slot_ids):
            blocks = job.dst.block_ids[max(0, j * f - skip):(j + 1) * f - skip]
            if j in bad:
                load.engine_failed += blocks
            else:
                slots.append(slot)
                dst += blocks
        self._start_copy(load, HostBlocks(slots), EngineBlocks(dst, 0 if 0 in bad else skip))

    def _start_copy(self, load: _Load, src: HostBlocks, dst: EngineBlocks) -> None:
        if src.slot_ids:
            load.copy_dst = dst.block_ids
            self._submit(TransferKey(load.job.job_id), src, dst)
        else:  # nothing to copy: reported by this step's get_finished
            self._ready.append(load)

    def _finish_load(self, load: _Load) -> str:
        job = load.job
        del self._loads[job.job_id]
        self._load_errors.update(load.engine_failed)
        self._results.append(JobResult(job.job_id, not load.engine_failed,
                                       sorted(load.engine_failed), load.promote_failed))
        return job.req_id

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> OffloadingWorkerMetadata | None:
        if not self._results:
            return None
        results, self._results = self._results, []
        stats = {HOST: self.host.stats.snapshot()} if self.host is not None else {}
        if self.disk is not None:
            stats[DISK] = self.disk.stats.snapshot()
        return OffloadingWorkerMetadata(results, stats)

    shutdown_timeout_s = 5.0  # how long shutdown waits for running transfers

    def shutdown(self) -> None:
        """Cancels queued transfers and waits a bounded time for running ones."""
        if self.transfers is not None:
            self.transfers.shutdown(self.shutdown_timeout_s)

    def _submit(self, key: TransferKey, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self._in_flight.add(key)
        self._transfers().submit(key, src, dst)

    def _transfers(self) -> OffloadingWorker:
        assert self.transfers is not None, "OffloadingConnector: register_kv_caches was not called"
        return self.transfers

    def _factor(self) -> int:
        assert self.geometry is not None, "OffloadingConnector: register_kv_caches was not called"
        return self.geometry.block_factor

