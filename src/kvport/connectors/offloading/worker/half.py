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
`sync_write_through` (config.py; a kv_producer's default) also waits, bounded, for the
write-throughs of the step's stores, so that the step's answers come after another instance
can find their KV on disk or in Redis.
`wait_sync_loads` (vLLM) waits for synchronous loads, unbounded (why: docs/vllm.md). The work is
done by loads.LoadRunner and stores.StoreRunner over a shared jobs.Submitter (the transfers in
flight and the results for the scheduler half); the transfers run on the router's threads,
wired by wiring.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from kvport.connectors.base import EngineInfo
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import HOST
from kvport.connectors.offloading.metrics import Counters, WorkerMetrics
from kvport.connectors.offloading.metadata import (
    OffloadingConnectorMetadata, OffloadingWorkerMetadata, Stage, TierChange,
)
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.worker.deadlines import Deadlines
from kvport.connectors.offloading.worker.jobs import Submitter, TransferKey, transfer_key
from kvport.connectors.offloading.worker.loads import LoadRunner
from kvport.connectors.offloading.worker.stores import StoreRunner
from kvport.connectors.offloading.worker.transfers import TransferResult, TransferRouter
from kvport.connectors.offloading.worker.wiring import (
    LowerTier, build_tier_worker, make_lower_tiers,
)

logger = logging.getLogger(__name__)

TransfersFactory = Callable[[HostTier, Mapping[str, LowerTier]], TransferRouter]
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
        self.transfers: TransferRouter | None = None
        self._deadlines = Deadlines(clock)  # promotions and write-throughs in flight
        self._submitter: Submitter | None = None
        self._loads: LoadRunner | None = None
        self._stores: StoreRunner | None = None
        self._late: list[int] = []  # job ids given up on, for the next worker metadata
        # Finished requests whose blocks the engine holds until these jobs' engine copies end
        # (OffloadingConnectorMetadata.held); reported in finished_sending then.
        self._held: dict[str, set[int]] = {}
        self.stats = Counters(WorkerMetrics)  # the worker half's own

    def register_kv_caches(self, kv_cache: torch.Tensor | EnginePool, geometry: OffloadGeometry,
                           engine: EngineInfo | None = None) -> None:
        """`kv_cache`: kvport's pool, contiguous, or a strided view of an engine's pages (vLLM),
        whose blocks' pages the host tier copies in their memory order."""
        engine = engine or EngineInfo()
        self.sync_stores = self.sync_stores or engine.stops_when_idle
        self.wait_sync_loads = self.wait_sync_loads or engine.caches_failed_sync_loads
        self.geometry = geometry
        self.host = HostTier.for_pool(kv_cache, geometry.num_slots, geometry.block_factor,
                                      self.config.host_copy)
        assert self.host.slot_bytes == geometry.slot_bytes, \
            f"host slots of {self.host.slot_bytes} bytes, geometry says {geometry.slot_bytes}"
        self.lower = make_lower_tiers(self.config, geometry)
        self.transfers = self._make_transfers(self.host, self.lower)
        self._submitter = Submitter(self.transfers)
        self._loads = LoadRunner(self.config, geometry, self._submitter, self._deadlines,
                                 self.lower, self.wait_sync_loads, self._clock)
        self._stores = StoreRunner(self.config, self._submitter, self._deadlines)

    def handle_preemptions(self, meta: OffloadingConnectorMetadata) -> None:
        if meta.jobs_to_flush:
            # NOTE: no timeout: these copy memory (stores into host slots, late parts of a
            # synchronous load into engine blocks), which cannot hang, and returning early
            # would let this step's forward write blocks they still read or write.
            submitter = self._parts()[0]
            submitter.router.wait([k for k in submitter.in_flight if k.stage is Stage.COPY
                                   and k.job_id in meta.jobs_to_flush])

    def start_load_kv(self, meta: OffloadingConnectorMetadata) -> None:
        submitter, loads, _ = self._parts()
        sync = loads.start(meta.loads)
        if sync:
            loads.wait_sync(sync)
            self._on_finished(submitter.take_finished())
            loads.settle_sync(sync)

    def get_finished(self, meta: OffloadingConnectorMetadata | None,
                     ) -> tuple[set[str], set[str]]:
        """Submits this step's stores; returns (finished_sending: held requests whose jobs no
        longer touch their blocks, finished_recving: requests whose load finished)."""
        submitter, loads, stores = self._parts()
        tainted = loads.take_tainted()
        if meta is not None:
            for rid, jobs in meta.held.items():
                self._held[rid] = set(jobs)
            self._on_finished(stores.submit(meta.stores, tainted))
            if (self.sync_stores or self.config.sync_write_through) and meta.stores:
                # NOTE: no timeout, as for the fence: these copy memory into host slots.
                submitter.router.wait([TransferKey(job.job_id) for job in meta.stores])
        self._on_finished(submitter.take_finished())
        if meta is not None and meta.stores and self.config.sync_write_through:
            self._wait_written({job.job_id for job in meta.stores})
        if meta is None or not meta.did_forward:
            self._wait_without_forward()
        late = self._give_up_late_jobs()
        return self._released(), loads.take_finished() | late

    def _wait_written(self, job_ids: set[int]) -> None:
        """`sync_write_through`: wait for the write-throughs of this step's stores (their copies
        ended and started them), at most `write_timeout_s`; one still running then is left to
        its deadline, as any other (`_give_up_late_jobs`)."""
        submitter = self._parts()[0]
        writes = [k for k in submitter.in_flight if k.job_id in job_ids and k.stage is Stage.WRITE]
        if writes:
            submitter.router.wait(writes, timeout=self.config.write_timeout_s)
            self._on_finished(submitter.take_finished())

    def _released(self) -> set[str]:
        """The held requests whose jobs' engine copies all ended."""
        _, loads, stores = self._parts()
        touching = stores.copies.keys() | loads.sync_in_flight()
        released = {rid for rid, jobs in self._held.items() if touching.isdisjoint(jobs)}
        for rid in released:
            del self._held[rid]
        return released

    def _on_finished(self, done: list[TransferResult]) -> None:
        _, loads, stores = self._parts()
        for result in done:
            if loads.owns(transfer_key(result)):
                loads.on_finished(result)
            else:
                stores.on_finished(result)

    def _give_up_late_jobs(self) -> set[str]:
        """Abandon the promotions and write-throughs past their deadline (deadlines.py); the
        requests of late loads, reported loaded with all their blocks failed."""
        submitter, loads, stores = self._parts()
        late: set[str] = set()
        expired = self._deadlines.take_expired()
        # NOTE: all looked at before any is abandoned: a replacement thread takes a queued job
        started = submitter.router.started(k for k in submitter.in_flight
                                           if k.job_id in expired)
        for job_id in expired:
            keys = [k for k in submitter.in_flight if k.job_id == job_id]
            is_load = loads.owns(TransferKey(job_id))
            seconds = self.config.load_timeout_s if is_load else self.config.write_timeout_s
            if started.isdisjoint(keys) and self._deadlines.extend_once(job_id, seconds):
                continue  # only queued behind a stuck job, whose thread is replaced below
            self._late.append(job_id)
            self._deadlines.end(job_id)
            if is_load:
                late.add(loads.give_up(job_id))
                self.stats.add(num_late_loads=1)
            else:
                stores.give_up(job_id)
                self.stats.add(num_late_writes=1)
            self.stats.add(num_replaced_threads=submitter.router.abandon(keys))
        return late

    def _wait_without_forward(self) -> None:
        """A step with nothing to compute: wait for every asynchronous load in flight (a
        promotion starts its copy on the way), at most LOAD_WAIT_S, so that loads ending close
        together report in one step; with none, wait IDLE_WAIT_S for anything."""
        submitter, loads, _ = self._parts()
        deadline = self._clock() + LOAD_WAIT_S
        while True:
            waiting = loads.in_flight()
            if not waiting:
                if submitter.in_flight and not loads.has_ready:
                    submitter.router.wait(submitter.in_flight, timeout=IDLE_WAIT_S)
                    self._on_finished(submitter.take_finished())
                return
            left = deadline - self._clock()
            if left <= 0:
                return
            submitter.router.wait(waiting, timeout=left)
            done = submitter.take_finished()
            if not done:  # the wait timed out
                return
            self._on_finished(done)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._parts()[1].take_errors()

    def get_failed_load_req_ids(self) -> set[str]:
        return self._parts()[1].take_failed_requests()

    def build_worker_meta(self) -> OffloadingWorkerMetadata | None:
        submitter = self._submitter
        if submitter is None:
            return None
        for medium, tier in self.lower.items():
            dropped = tier.dropped.take()
            if dropped:
                submitter.changes.append(TierChange(medium, tuple(dropped), removed=True))
        if not submitter.results and not self._late and not submitter.changes:
            return None
        results, submitter.results = submitter.results, []
        changes, submitter.changes = submitter.changes, []
        late, self._late = self._late, []
        tiers = {HOST: self.host.stats.snapshot()} if self.host is not None else {}
        for medium, tier in self.lower.items():
            tiers[medium] = tier.stats.snapshot()
        return OffloadingWorkerMetadata(results, tiers, late, self.stats.snapshot(), changes)

    def shutdown(self) -> None:
        """Drains what the engine computed into the tiers, stage by stage, within
        `shutdown_timeout_s` in all: each store's copy (engine to host), then the write-through
        that copy starts (host to disk and Redis), so a store whose copy ended after the last
        step still reaches the disk. Loads nobody waits for, and writes already given up, are not
        waited for. What is still running at the deadline is dropped, logged and counted
        (`num_dropped_at_shutdown`); then the transfer threads stop."""
        if self._submitter is None:
            return
        submitter, loads, stores = self._parts()
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        while True:
            self._on_finished(submitter.take_finished())  # a copy that ended starts its writes
            pending = [k for k in submitter.in_flight if not loads.owns(k)
                       and k.job_id not in stores.given_up]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            submitter.router.wait(pending, left)
        if pending:
            self.stats.add(num_dropped_at_shutdown=len(pending))
            stages = sorted(f"{k.stage.value}{' to ' + k.medium if k.medium else ''}"
                            for k in pending)
            logger.warning("OffloadingConnector: shutdown dropped %d transfers still running after "
                           "%.1f s (shutdown_timeout_s): %s", len(pending),
                           self.config.shutdown_timeout_s, ", ".join(stages))
        submitter.router.shutdown(0.0)
        for tier in self.lower.values():
            tier.close()

    @property
    def num_in_flight(self) -> int:
        """Loads and transfers not reported yet (0 when the worker is idle)."""
        if self._submitter is None or self._loads is None:
            return 0
        return len(self._loads.loads) + len(self._submitter.in_flight)

    def check_no_leaks(self) -> None:
        """Raise if a load, a transfer, a completion or a load error is left (tests call it)."""
        if self._submitter is None:
            return
        _, loads, stores = self._parts()
        left = {"loads": len(loads.loads), "transfers": len(self._submitter.in_flight),
                "finished loads": int(loads.has_ready), "load errors": loads.num_errors,
                "store copies": len(stores.copies), "write-throughs": len(stores.writes),
                "held requests": len(self._held)}
        if any(left.values()):
            raise RuntimeError(f"OffloadingConnector worker: left in flight: {left}")

    def _parts(self) -> tuple[Submitter, LoadRunner, StoreRunner]:
        assert self._submitter is not None and self._loads is not None \
            and self._stores is not None, "OffloadingConnector: register_kv_caches was not called"
        return self._submitter, self._loads, self._stores
