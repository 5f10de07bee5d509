"""The OffloadingConnector's worker half: runs the jobs the scheduler half planned.

Every step, in the driver's order:
    handle_preemptions  wait for `jobs_to_flush` (stores reading blocks handed out again now)
    start_load_kv       copy this step's synchronous loads (host hits) now, before the forward,
                        bounded (late parts fail their blocks); submit its async loads (a
                        promotion DISK->HOST first when needed)
    get_finished        submit this step's stores (the forward has written their blocks; none
                        of a request whose synchronous load failed: it read bad blocks); with
                        `sync_stores`, wait for them, so they report in this very step; poll
                        completions: a store whose copy finished starts its write-through to
                        each lower tier (disk, Redis); a load whose promotions all finished
                        starts its HOST->ENGINE copy; a finished load reports its request in
                        finished_recving and its failed engine blocks as load errors; a
                        step without a forward waits (bounded) for every async load in flight
Nothing is left to wait_for_save (no-forward steps skip it under the legacy call order).
`sync_stores` is for engines that may stop stepping as soon as no request is left (vLLM's
in-process LLM): the last step's stores must be in the host tier, and the scheduler half must
know it, when generate() returns; their write-through then runs with no further step.
`wait_sync_loads` (vLLM) waits for synchronous loads, unbounded (why: docs/vllm.md). Stages
and the keys transfers run under: worker_jobs.py.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
import torch

from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.deadlines import Deadlines, WorkerStats
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import (
    DISK, ENGINE, HOST, REDIS, EngineBlocks, HostBlocks, LoadStoreSpec,
)
from kvport.connectors.offloading.metadata import (
    JobResult, OffloadingConnectorMetadata, OffloadingWorkerMetadata, Promotion, Stage, StoreJob,
)
from kvport.connectors.offloading.tiers.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host import HostTier
from kvport.connectors.offloading.tier_wiring import (
    LowerTier, build_tier_worker, make_lower_tiers,
)
from kvport.connectors.offloading.sync_parts import SYNC_GRACE_S, split_parts, sync_timeout
from kvport.connectors.offloading.transfers import (
    OffloadingWorker, TransferResult, failed_result,
)
from kvport.connectors.offloading.worker_jobs import Load, TransferKey
from kvport.connectors.offloading.write_throughs import WriteThroughs

logger = logging.getLogger(__name__)

TransfersFactory = Callable[[HostTier, Mapping[str, LowerTier]], OffloadingWorker]
IDLE_WAIT_S = 0.002  # a step with no forward and no load in flight waits this long, not spinning
# A step with no forward and loads in flight waits for all of them, at most this long: requests
# whose loads end together are then scheduled together, and prefill in one batched step.
LOAD_WAIT_S = 0.05
__all__ = ["OffloadingConnectorWorker", "Stage", "TransferKey"]


class OffloadingConnectorWorker:
    def __init__(self, config: OffloadingConfig,
                 make_transfers: TransfersFactory = build_tier_worker,
                 sync_stores: bool = False, wait_sync_loads: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock  # deadlines' time (tests/sim moves it; its own HOST->ENGINE route)
        self._make_transfers = make_transfers
        self.sync_stores, self.wait_sync_loads = sync_stores, wait_sync_loads
        self.geometry: OffloadGeometry | None = None  # set by register_kv_caches
        self.host: HostTier | None = None
        self.lower: dict[str, LowerTier] = {}  # medium -> tier below host, top down
        self.transfers: OffloadingWorker | None = None
        self._stores: dict[int, StoreJob] = {}  # job id -> store whose copy is in flight
        self.writes = WriteThroughs()  # of stores whose copy ended
        self._loads: dict[int, Load] = {}  # job id -> load in flight
        self._in_flight: set[TransferKey] = set()  # submitted to the transfers, not reported
        self._ready: list[Load] = []  # loads done, to report in this step's get_finished
        self._results: list[JobResult] = []  # for the next worker metadata
        self._load_errors: set[int] = set()
        self._deadlines = Deadlines(clock)  # promotions and write-throughs in flight
        self._late: list[int] = []  # job ids given up on, for the next worker metadata
        self._given_up: set[int] = set()  # late write-throughs, until their threads return
        self._tainted: set[str] = set()  # a sync load failed this step: its forward read them
        self.stats = WorkerStats()

    def register_kv_caches(self, kv_cache: torch.Tensor | EnginePool,
                           geometry: OffloadGeometry) -> None:
        self.geometry = geometry
        self.host = HostTier.for_pool(kv_cache, geometry.num_slots, geometry.block_factor)
        assert self.host.slot_bytes == geometry.slot_bytes, \
            f"host slots of {self.host.slot_bytes} bytes, geometry says {geometry.slot_bytes}"
        self.lower = make_lower_tiers(self.config, geometry)
        self.transfers = self._make_transfers(self.host, self.lower)

    def handle_preemptions(self, meta: OffloadingConnectorMetadata) -> None:
        if meta.jobs_to_flush:
            # NOTE: no timeout: these copy memory (stores into host slots, late parts of a
            # synchronous load into engine blocks), which cannot hang, and returning early
            # would let this step's forward write blocks they still read or write.
            self._transfers().wait([k for k in self._in_flight if k.stage is Stage.COPY
                                    and k.job_id in meta.jobs_to_flush])

    def start_load_kv(self, meta: OffloadingConnectorMetadata) -> None:
        sync: list[Load] = []
        for job in meta.loads:
            load = Load(job, engine_failed=list(job.unloadable),
                         promotions_left=len(job.promotions))
            self._loads[job.job_id] = load
            if job.sync:
                sync.append(load)
                continue
            if job.promotions:
                self._deadlines.start(job.job_id, self.config.load_timeout_s)
            for promotion in job.promotions:
                self._keep_entries(promotion, True)
                self._submit(TransferKey(job.job_id, Stage.PROMOTION, promotion.src.medium()),
                             promotion.src, promotion.dst)
            if not job.promotions:
                self._start_copy(load, job.src, job.dst)
        if sync:
            self._run_sync_loads(sync)

    def _run_sync_loads(self, loads: list[Load]) -> None:
        """Copy the step's synchronous loads now, before its forward reads them, all submitted
        at once (the copy threads take them back to back). Bounded: parts not done in time fail
        their blocks, which the engine recomputes."""
        transfers, g = self._transfers(), self._geometry()
        parts = [(load, part) for load in loads
                 for part in split_parts(load.job, g.block_factor, g.slot_bytes)]
        num_bytes = sum(len(src.slot_ids) for _, (src, _) in parts) * g.slot_bytes
        timeout = None if self.wait_sync_loads else sync_timeout(num_bytes)
        deadline = None if timeout is None else self._clock() + timeout
        for i, (load, (src, dst)) in enumerate(parts):
            key = TransferKey(load.job.job_id, part=i)
            load.parts[key] = dst.block_ids
            self._submit(key, src, EngineBlocks(dst.block_ids, dst.skip, deadline))
        keys = [key for load in loads for key in load.parts]
        if not transfers.wait(keys, timeout):
            logger.warning("OffloadingConnector: synchronous loads of %d bytes are late; the "
                           "blocks not copied yet are recomputed", num_bytes)
            transfers.cancel(keys)
            transfers.wait(keys, SYNC_GRACE_S)
        self._on_finished(transfers.get_finished())
        for load in loads:
            if load.parts:  # still running: this step's forward cannot wait for it
                load.engine_failed += [b for blocks in load.parts.values() for b in blocks]
                load.reported = True
                self._load_errors.update(load.engine_failed)
            else:
                self._finish_sync_load(load)
            if load.engine_failed:
                self._tainted.add(load.job.req_id)

    def _on_sync_part(self, load: Load, key: TransferKey, result: TransferResult) -> None:
        blocks = load.parts.pop(key)
        if not load.reported:
            load.engine_failed += [blocks[i] for i in result.failed_indices]
        elif not load.parts:  # the last late part ended: the job's slots may be reused
            del self._loads[load.job.job_id]
            self._results.append(JobResult(load.job.job_id, False, sorted(load.engine_failed)))

    def _finish_sync_load(self, load: Load) -> None:
        """Every part ended in time: the failed blocks are this step's load errors (the engine
        recomputes them); a synchronous load reports no finished_recving."""
        job = load.job
        del self._loads[job.job_id]
        self._load_errors.update(load.engine_failed)
        self._results.append(JobResult(job.job_id, not load.engine_failed,
                                       sorted(load.engine_failed)))

    def get_finished(self, meta: OffloadingConnectorMetadata | None,
                     did_forward: bool) -> set[str]:
        """Submits this step's stores; returns the requests whose load finished."""
        transfers = self._transfers()
        if meta is not None:
            for job in meta.stores:  # the forward has written their blocks
                self._stores[job.job_id] = job
                if job.req_id in self._tainted:  # computed on KV a failed sync load left
                    self._on_finished([failed_result(TransferKey(job.job_id), (ENGINE, HOST),
                                                     len(job.dst))])
                    continue
                self._submit(TransferKey(job.job_id), job.src, job.dst)
            if self.sync_stores and meta.stores:
                # NOTE: no timeout, as for the fence: these copy memory into host slots.
                transfers.wait([TransferKey(job.job_id) for job in meta.stores])
        self._tainted.clear()
        self._on_finished(transfers.get_finished())
        if not did_forward:
            self._wait_without_forward()
        late = self._give_up_late_jobs()
        ready, self._ready = self._ready, []
        return {self._finish_load(load) for load in ready} | late

    def _give_up_late_jobs(self) -> set[str]:
        """Abandon the promotions and write-throughs past their deadline (deadlines.py); the
        requests of late loads, reported loaded with all their blocks failed."""
        late: set[str] = set()
        transfers = self._transfers()
        expired = self._deadlines.take_expired()
        # NOTE: all looked at before any is abandoned: a replacement thread takes a queued job
        started = transfers.started(k for k in self._in_flight if k.job_id in expired)
        for job_id in expired:
            keys = [k for k in self._in_flight if k.job_id == job_id]
            load = self._loads.get(job_id)
            seconds = self.config.load_timeout_s if load else self.config.write_timeout_s
            if started.isdisjoint(keys) and self._deadlines.extend_once(job_id, seconds):
                continue  # only queued behind a stuck job, whose thread is replaced below
            self._late.append(job_id)
            self._deadlines.end(job_id)
            if load is not None:
                load.late = True
                load.engine_failed = sorted(set(load.engine_failed) | set(load.job.dst.block_ids))
                self._load_errors.update(load.engine_failed)
                late.add(load.job.req_id)
                self.stats.add(num_late_loads=1)
                logger.warning("OffloadingConnector: a load from a lower tier is late (%.1f s, "
                               "load_timeout_s): recomputed", self.config.load_timeout_s)
            else:
                self._given_up.add(job_id)
                self.stats.add(num_late_writes=1)
                logger.warning("OffloadingConnector: a write-through is late (%.1f s, "
                               "write_timeout_s): given up", self.config.write_timeout_s)
            self.stats.add(num_replaced_threads=transfers.abandon(keys))
        return late

    def _wait_without_forward(self) -> None:
        """A step with nothing to compute: wait for every asynchronous load in flight (a
        promotion starts its copy on the way), at most LOAD_WAIT_S, so that loads ending close
        together report in one step; with none, wait IDLE_WAIT_S for anything."""
        transfers = self._transfers()
        deadline = self._clock() + LOAD_WAIT_S
        while True:
            loads = [k for k in self._in_flight if (load := self._loads.get(k.job_id))
                     is not None and not load.parts and not load.late]
            if not loads:
                if self._in_flight and not self._ready:
                    transfers.wait(self._in_flight, timeout=IDLE_WAIT_S)
                    self._on_finished(transfers.get_finished())
                return
            left = deadline - self._clock()
            if left <= 0:
                return
            transfers.wait(loads, timeout=left)
            done = transfers.get_finished()
            if not done:  # the wait timed out
                return
            self._on_finished(done)

    def _on_finished(self, done: list[TransferResult]) -> None:
        for result in done:
            key = result.job_id
            assert isinstance(key, TransferKey), f"not a transfer of this worker: {key!r}"
            self._in_flight.discard(key)
            load = self._loads.get(key.job_id)
            if load is not None and key in load.parts:
                self._on_sync_part(load, key, result)
            elif load is not None and key.stage is Stage.PROMOTION:
                self._on_promoted(load, key.medium, result)
            elif load is not None:
                load.engine_failed += [load.copy_dst[i] for i in result.failed_indices]
                self._ready.append(load)
            elif key.stage is Stage.COPY:
                self._on_stored(self._stores.pop(key.job_id), result)
            else:
                self._on_written(key.job_id, result)

    def _on_stored(self, job: StoreJob, result: TransferResult) -> None:
        """The store's copy finished: report it, and write the slots it filled through to each
        lower tier (reported as its WRITE stage once all ended; nothing to write is reported at
        once)."""
        failed = set(result.failed_indices)
        self._results.append(JobResult(job.job_id, result.success, sorted(failed)))
        if not job.writes:
            return
        writes = self.writes.start(job, failed)
        if not writes:
            self._results.append(JobResult(job.job_id, True, stage=Stage.WRITE))
            return
        self._deadlines.start(job.job_id, self.config.write_timeout_s)
        for src, dst in writes:
            self._submit(TransferKey(job.job_id, Stage.WRITE, dst.medium()), src, dst)

    def _on_written(self, job_id: int, result: TransferResult) -> None:
        done = self.writes.ended(job_id, result.failed_indices)
        if done is not None:
            self._deadlines.end(job_id)
            self._given_up.discard(job_id)
            self._results.append(done)

    def _on_promoted(self, load: Load, medium: str, result: TransferResult) -> None:
        """One lower tier's promotion finished; once all have, copy every block that is in host
        memory now to the engine."""
        job = load.job
        (promotion,) = [p for p in job.promotions if p.src.medium() == medium]
        self._keep_entries(promotion, False)
        num_host = len(job.src.slot_ids) - job.num_promoted
        position = {slot: i for i, slot in enumerate(job.src.slot_ids[num_host:])}
        load.promote_failed += [position[promotion.dst.slot_ids[i]]
                                for i in result.failed_indices]
        load.promotions_left -= 1
        if load.promotions_left:
            return
        self._deadlines.end(job.job_id)
        if load.late:  # its request was reported already; its slots are free to reuse now
            del self._loads[job.job_id]
            self._results.append(JobResult(job.job_id, False, load.engine_failed,
                                           list(range(job.num_promoted))))
            return
        load.promote_failed.sort()
        bad = {num_host + p for p in load.promote_failed}  # offload block positions in src
        f, skip = self._geometry().block_factor, job.dst.skip
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

    def _keep_entries(self, promotion: Promotion, keep: bool) -> None:
        """A tier with `protect` (disk) keeps a promotion's entries from eviction by this
        process's own write-throughs until the promotion ended."""
        hook = getattr(self.lower.get(promotion.src.medium()), "protect" if keep else "unprotect",
                       None)
        if hook is not None:
            hook(promotion.src.keys)

    def _start_copy(self, load: Load, src: HostBlocks, dst: EngineBlocks) -> None:
        if src.slot_ids:
            load.copy_dst = dst.block_ids
            self._submit(TransferKey(load.job.job_id), src, dst)
        else:  # nothing to copy: reported by this step's get_finished
            self._ready.append(load)

    def _finish_load(self, load: Load) -> str:
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
        if not self._results and not self._late:
            return None
        results, self._results = self._results, []
        late, self._late = self._late, []
        stats = {HOST: self.host.stats.snapshot()} if self.host is not None else {}
        for medium, tier in self.lower.items():
            stats[medium] = tier.stats.snapshot()
        return OffloadingWorkerMetadata(results, stats, late, self.stats.snapshot())

    def shutdown(self) -> None:
        """Drains what the engine computed into the tiers, stage by stage, within
        `shutdown_timeout_s` in all: each store's copy (engine to host), then the write-through
        that copy starts (host to disk and Redis), so a store whose copy ended after the last
        step still reaches the disk. Loads nobody waits for, and writes already given up, are not
        waited for. What is still running at the deadline is dropped, logged and counted
        (`num_dropped_at_shutdown`); then the transfer threads stop."""
        if self.transfers is None:
            return
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        while True:
            self._on_finished(self.transfers.get_finished())  # a copy that ended starts its writes
            pending = [k for k in self._in_flight if k.job_id not in self._loads
                       and k.job_id not in self._given_up]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            self.transfers.wait(pending, left)
        if pending:
            self.stats.add(num_dropped_at_shutdown=len(pending))
            stages = sorted(f"{k.stage.value}{' to ' + k.medium if k.medium else ''}"
                            for k in pending)
            logger.warning("OffloadingConnector: shutdown dropped %d transfers still running after "
                           "%.1f s (shutdown_timeout_s): %s", len(pending),
                           self.config.shutdown_timeout_s, ", ".join(stages))
        self.transfers.shutdown(0.0)
        for tier in self.lower.values():
            tier.close()

    def _submit(self, key: TransferKey, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self._in_flight.add(key)
        self._transfers().submit(key, src, dst)

    def _transfers(self) -> OffloadingWorker:
        assert self.transfers is not None, "OffloadingConnector: register_kv_caches was not called"
        return self.transfers

    def _geometry(self) -> OffloadGeometry:
        assert self.geometry is not None, "OffloadingConnector: register_kv_caches was not called"
        return self.geometry
