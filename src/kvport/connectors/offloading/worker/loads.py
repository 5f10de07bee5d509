"""The worker half's loads: host hits and promoted blocks copied into the engine's pool.

    synchronous (host hits only)  copied in start_load_kv, before the step's forward reads them,
                                  in parts, bounded (sync_parts.py): parts not done in time fail
                                  their blocks, which the engine recomputes; a request whose
                                  synchronous load failed stores nothing of that step (its
                                  forward read bad blocks: `take_tainted`)
    asynchronous                  a PROMOTION per lower tier (DISK->HOST, REDIS->HOST) first,
                                  under `load_timeout_s`, then the HOST->ENGINE copy of every
                                  block that is in host memory now; the request is reported in
                                  finished_recving, its failed engine blocks as load errors

`wait_sync_loads` (vLLM) waits for synchronous loads, unbounded (why: docs/vllm.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.metadata import JobResult, LoadJob, Promotion, Stage
from kvport.connectors.offloading.worker.deadlines import Deadlines
from kvport.connectors.offloading.worker.jobs import Load, Submitter, TransferKey
from kvport.connectors.offloading.worker.sync_parts import SYNC_GRACE_S, split_parts, sync_timeout
from kvport.connectors.offloading.worker.transfers import TransferResult
from kvport.connectors.offloading.worker.wiring import LowerTier

logger = logging.getLogger(__name__)


class LoadRunner:
    def __init__(self, config: OffloadingConfig, geometry: OffloadGeometry, submitter: Submitter,
                 deadlines: Deadlines, lower: Mapping[str, LowerTier], wait_sync_loads: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.geometry = geometry
        self.submitter = submitter
        self.deadlines = deadlines
        self.lower = lower
        self.wait_sync_loads = wait_sync_loads
        self._clock = clock
        self.loads: dict[int, Load] = {}  # job id -> load in flight
        self._ready: list[Load] = []  # loads done, to report in this step's get_finished
        self._errors: set[int] = set()  # engine blocks without valid KV, for this step
        self._tainted: set[str] = set()  # a sync load failed this step: its forward read them
        self._failed_reqs: set[str] = set()  # requests of this step's load errors

    def start(self, jobs: Iterable[LoadJob]) -> list[Load]:
        """start_load_kv: submits the step's loads; returns the synchronous ones, which the
        caller waits for (`wait_sync`), then settles (`settle_sync`) once their transfers'
        results were handed to `on_finished`."""
        sync: list[Load] = []
        for job in jobs:
            load = Load(job, engine_failed=list(job.unloadable),
                        promotions_left=len(job.promotions))
            self.loads[job.job_id] = load
            if job.sync:
                sync.append(load)
                continue
            if job.promotions:
                self.deadlines.start(job.job_id, self.config.load_timeout_s)
            for promotion in job.promotions:
                self._keep_entries(promotion, True)
                self.submitter.submit(
                    TransferKey(job.job_id, Stage.PROMOTION, promotion.src.medium()),
                    promotion.src, promotion.dst)
            if not job.promotions:
                self._start_copy(load, job.src, job.dst)
        return sync

    def wait_sync(self, loads: list[Load]) -> None:
        """Copy the step's synchronous loads now, before its forward reads them, all submitted
        at once (the copy threads take them back to back). Bounded: parts not done in time are
        cancelled (or given a short grace while they run); settle_sync fails their blocks."""
        router, g = self.submitter.router, self.geometry
        parts = [(load, part) for load in loads
                 for part in split_parts(load.job, g.block_factor, g.slot_bytes)]
        num_bytes = sum(len(src.slot_ids) for _, (src, _) in parts) * g.slot_bytes
        timeout = None if self.wait_sync_loads else sync_timeout(num_bytes)
        deadline = None if timeout is None else self._clock() + timeout
        for i, (load, (src, dst)) in enumerate(parts):
            key = TransferKey(load.job.job_id, part=i)
            load.parts[key] = dst.block_ids
            self.submitter.submit(key, src, EngineBlocks(dst.block_ids, dst.skip, deadline))
        keys = [key for load in loads for key in load.parts]
        if not router.wait(keys, timeout):
            logger.warning("OffloadingConnector: synchronous loads of %d bytes are late; the "
                           "blocks not copied yet are recomputed", num_bytes)
            router.cancel(keys)
            router.wait(keys, SYNC_GRACE_S)

    def settle_sync(self, loads: list[Load]) -> None:
        """After wait_sync and the results handed over: the parts still running fail their
        blocks (this step's forward cannot wait for them)."""
        for load in loads:
            if load.parts:  # still running: this step's forward cannot wait for it
                load.engine_failed += [b for blocks in load.parts.values() for b in blocks]
                load.reported = True
                self._report(load)
            else:
                self._finish_sync(load)
            if load.engine_failed:
                self._tainted.add(load.job.req_id)

    def owns(self, key: TransferKey) -> bool:
        return key.job_id in self.loads

    def on_finished(self, result: TransferResult) -> None:
        """A transfer of a load ended (owns(key) is true)."""
        key: TransferKey = result.job_id  # type: ignore[assignment]
        load = self.loads[key.job_id]
        if key in load.parts:
            self._on_sync_part(load, key, result)
        elif key.stage is Stage.PROMOTION:
            self._on_promoted(load, key.medium, result)
        else:
            load.engine_failed += [load.copy_dst[i] for i in result.failed_indices]
            self._ready.append(load)

    def _on_sync_part(self, load: Load, key: TransferKey, result: TransferResult) -> None:
        blocks = load.parts.pop(key)
        if not load.reported:
            load.engine_failed += [blocks[i] for i in result.failed_indices]
        elif not load.parts:  # the last late part ended: the job's slots may be reused
            del self.loads[load.job.job_id]
            self.submitter.results.append(JobResult(load.job.job_id, False,
                                                    sorted(load.engine_failed)))

    def _finish_sync(self, load: Load) -> None:
        """Every part ended in time: the failed blocks are this step's load errors (the engine
        recomputes them); a synchronous load reports no finished_recving."""
        job = load.job
        del self.loads[job.job_id]
        self._report(load)
        self.submitter.results.append(JobResult(job.job_id, not load.engine_failed,
                                                sorted(load.engine_failed)))

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
        self.deadlines.end(job.job_id)
        if load.late:  # its request was reported already; its slots are free to reuse now
            del self.loads[job.job_id]
            self.submitter.results.append(JobResult(job.job_id, False, load.engine_failed,
                                                    list(range(job.num_promoted))))
            return
        load.promote_failed.sort()
        bad = {num_host + p for p in load.promote_failed}  # offload block positions in src
        skip = job.dst.skip
        slots: list[int] = []
        dst: list[int] = []
        for j, slot in enumerate(job.src.slot_ids):
            blocks = self.geometry.blocks_of(job.dst.block_ids, j, skip)
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
            self.submitter.submit(TransferKey(load.job.job_id), src, dst)
        else:  # nothing to copy: reported by this step's get_finished
            self._ready.append(load)

    def give_up(self, job_id: int) -> str:
        """The load's promotions passed their deadline: its request is reported now, every
        engine block a load error; its slots stay pinned until the promotions end."""
        load = self.loads[job_id]
        load.late = True
        load.engine_failed = sorted(set(load.engine_failed) | set(load.job.dst.block_ids))
        self._report(load)
        logger.warning("OffloadingConnector: a load from a lower tier is late (%.1f s, "
                       "load_timeout_s): recomputed", self.config.load_timeout_s)
        return load.job.req_id

    def in_flight(self) -> list[TransferKey]:
        """Transfers of async loads the engine waits for (not late, not a sync load's parts)."""
        return [k for k in self.submitter.in_flight if (load := self.loads.get(k.job_id))
                is not None and not load.parts and not load.late]

    def sync_in_flight(self) -> set[int]:
        """Synchronous loads whose parts may still write engine blocks."""
        return {job_id for job_id, load in self.loads.items() if load.job.sync}

    @property
    def num_errors(self) -> int:
        """Engine blocks reported as load errors by the next get_block_ids_with_load_errors."""
        return len(self._errors)

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    def take_finished(self) -> set[str]:
        """The requests whose async load finished, for finished_recving."""
        ready, self._ready = self._ready, []
        return {self._finish(load) for load in ready}

    def _finish(self, load: Load) -> str:
        job = load.job
        del self.loads[job.job_id]
        self._report(load)
        self.submitter.results.append(JobResult(job.job_id, not load.engine_failed,
                                                sorted(load.engine_failed), load.promote_failed))
        return job.req_id

    def take_tainted(self) -> set[str]:
        """Requests whose synchronous load failed in this step (their forward read bad KV)."""
        tainted, self._tainted = self._tainted, set()
        return tainted

    def _report(self, load: Load) -> None:
        """The load's failed engine blocks are this step's load errors."""
        self._errors.update(load.engine_failed)
        if load.engine_failed:
            self._failed_reqs.add(load.job.req_id)

    def take_failed_requests(self) -> set[str]:
        """The requests of this step's load errors (for an engine that takes them per
        request)."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
