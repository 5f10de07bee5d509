"""The OffloadingConnector's scheduler half: which offload blocks to load and store, as jobs.

Keys: offload block i of a request (f engine blocks, geometry.py) is keyed by the chained hash
of its last engine block. Only full offload blocks are stored or loaded.

This class is the connector API's scheduler side; the work is done by its parts:
    hits.HitPlanner     get_num_new_matched_tokens, and the load job of an admitted hit
    stores.StorePlanner the store jobs of what each step computed (build_connector_meta)
    jobs.JobTable       jobs in flight, their stages, the tensor-parallel ranks' results
The results of the jobs (update_connector_output) update the host tier's manager here.

Blocks in use: no job reads or writes an engine block after the engine gave it to another
request. A finished request whose stores (or late synchronous-load parts) are in flight is held:
request_finished answers True, the next metadata names its jobs (`held`), and the worker reports
it in finished_sending once their copies ended; only then does the engine free its blocks. A
preempted request's blocks are free at once (the API has no hold for a preemption): its jobs go
into the step's `jobs_to_flush`, which the worker finishes in handle_preemptions, before
anything writes KV. With `sync_stores` (vLLM) a step's stores are copied within that step and
its synchronous loads are waited for, so nothing is in flight when a request finishes: it is
never held.

Re-admission: a preempted request asked again while its own stores are unreported is answered
None (ask again) until they report. They were flushed at the preemption, so they are done or
nearly, but their keys are still being written: matched now, the hit run would end at them and
the request would recompute what it has just offloaded. Waiting lets it load them, and keeps a
request's jobs simple: store jobs or one load job, never both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvport.connectors.base import KVCacheEvent, KVConnectorOutput
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.manager.admission import admission_for
from kvport.connectors.offloading.manager.arc import ARCManager
from kvport.connectors.offloading.manager.lru import LRUManager
from kvport.connectors.offloading.manager.policy import PolicyManager
from kvport.connectors.offloading.mediums import DISK, HOST, REDIS
from kvport.connectors.offloading.metrics import (
    ConnectorMetrics, DiskMetrics, DiskTierMetrics, RedisMetrics, RedisTierMetrics,
    RequestMetrics, TierMetrics, WorkerMetrics, extend,
)
from kvport.connectors.offloading.metadata import (
    JobResult, LoadJob, OffloadingConnectorMetadata, OffloadingWorkerMetadata, Stage, StoreJob,
    TierChange,
)
from kvport.connectors.offloading.scheduler.block_events import BlockEvents
from kvport.connectors.offloading.scheduler.counters import SchedulerCounters
from kvport.connectors.offloading.scheduler.decisions import (
    LOAD_BYTES, LOOKUP_CALL, STORE_BYTES, DecisionCounters, Observations,
)
from kvport.connectors.offloading.scheduler.hits import HitPlanner, hashes_ok
from kvport.connectors.offloading.scheduler.inflight import InflightWaits
from kvport.connectors.offloading.scheduler.jobs import STORE, Job, JobTable
from kvport.connectors.offloading.scheduler.lower_lookup import LowerLookup
from kvport.connectors.offloading.scheduler.requests import ReqState, RequestLimits, as_tables
from kvport.connectors.offloading.scheduler.report import decision_metrics, host_metrics
from kvport.connectors.offloading.scheduler.stores import StorePlanner

if TYPE_CHECKING:
    from kvport.connectors.views import RequestView, SchedulerOutputView

logger = logging.getLogger(__name__)


def make_manager(config: OffloadingConfig, num_slots: int) -> PolicyManager:
    """The host tier's manager: the configured eviction policy and admission control."""
    cls = LRUManager if config.eviction_policy == "lru" else ARCManager
    return cls(num_slots, HOST, admission_for(config.store_threshold))


class OffloadingScheduler:
    def __init__(self, config: OffloadingConfig, geometry: OffloadGeometry, load: bool = True,
                 store: bool = True, num_workers: int = 1, sync_stores: bool = False,
                 clock: Callable[[], float] = time.monotonic, events: bool = True) -> None:
        self.geometry = geometry
        self.manager = make_manager(config, geometry.num_slots)
        self.events = BlockEvents(events, geometry.block_size, geometry.block_factor)
        self.decisions = DecisionCounters()
        self.observations = Observations()  # single measurements, for histograms
        self._changes: list[TierChange] = []  # lower tiers' reports, for the next take_events
        self._settle: list[bytes] = []  # keys whose jobs ended, for the next take_events
        # disk, Redis: which keys (and, with KV events on, Redis's own removals as they happen)
        self.lower = LowerLookup(config, geometry, self.observations, removals=events)
        self.waits = InflightWaits(config.inflight_wait_s, clock)  # tests/sim moves the clock
        self.stats = SchedulerCounters()
        # In flight (planned, not every stage reported by every worker: one per TP rank).
        self._jobs = JobTable(num_workers)
        self.hits = HitPlanner(geometry, self.manager, self.lower, self.waits, self._jobs,
                               self.stats, load_enabled=load,
                               sync_host_loads=config.sync_host_loads, events=self.events,
                               observations=self.observations)
        self.stores = StorePlanner(geometry, self.manager, self._jobs, self.stats,
                                   store_enabled=store, events=self.events,
                                   decisions=self.decisions, observations=self.observations)
        self.sync_stores = sync_stores
        self._reqs: dict[str, ReqState] = {}
        self._finished: set[str] = set()  # finished requests kept until their jobs report
        self._loads: list[LoadJob] = []  # for the next metadata
        self._held: dict[str, list[int]] = {}  # for the next metadata: finished, blocks held
        self._final_stores: list[StoreJob] = []  # for the next metadata: of finished requests
        self.tiers: dict[str, TierMetrics] = {}  # medium -> the workers' latest, cumulative
        self.worker = WorkerMetrics()  # the workers' own, cumulative
        self._late_jobs: set[int] = set()  # jobs a worker gave up waiting for, not reported yet
        self._limits = RequestLimits(self.stats)  # each request's kv_transfer_params

    # ---- admission -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_local: int) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is not None and st.store_jobs:
            self.stats.num_busy_answers += 1
            return None, False  # its own stores are unreported: load them once they are
        start = time.perf_counter()
        answer = self.hits.match(request, num_local, st, self._limits.of(request))
        self.observations.add(LOOKUP_CALL, time.perf_counter() - start)
        return answer

    def update_state_after_alloc(self, request: RequestView,
                                 block_ids: list[int] | tuple[list[int], ...],
                                 num_external: int) -> None:
        rid = request.request_id
        self.waits.forget(rid)
        old = self._reqs.get(rid)
        match = self.hits.admit(request)
        st = ReqState(request, as_tables(block_ids),
                      store_jobs=set(old.store_jobs) if old else set(),
                      load_failed=old is not None and old.load_failed,
                      hashes_ok=hashes_ok(request, self.geometry.block_size),
                      junction=match.junction if match is not None else None,
                      limits=self._limits.of(request))
        self._reqs[rid] = st
        split: dict[str, int] = {}
        if num_external > 0:
            assert match is not None, f"{rid}: {num_external} external tokens without a match"
            load = self.hits.plan_load(st, match, num_external)
            st.load_job, st.load_sync = load.job_id, load.sync
            self._loads.append(load)
            split = self.hits.hit_split(rid)
            if not load.unloadable:
                # The hit's blocks are in the host tier (or promoted into it): not offered to
                # it again (vLLM's rule; a long prompt's hit would cost a lookup per key)
                st.next_store_idx = match.end
        if old is None:  # a first admission (not a preempted request's return)
            self.decisions.count_prompt(request.num_prompt_tokens,
                                        match.num_local if match is not None else 0, split)

    def take_hit_split(self, req_id: str) -> dict[str, int]:
        """Tokens of the request's latest hit per tier (HOST, DISK, REDIS): for engines that
        report hits by source (vLLM)."""
        return self.hits.take_hit_split(req_id)

    # ---- per step ------------------------------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutputView) -> OffloadingConnectorMetadata:
        meta = OffloadingConnectorMetadata(loads=self._loads, held=self._held,
                                           stores=self._final_stores,
                                           did_forward=so.total_num_scheduled_tokens > 0)
        self._loads, self._held, self._final_stores = [], {}, []
        for rid in so.preempted_req_ids:
            st = self._reqs.get(rid)
            if st is not None:
                meta.jobs_to_flush |= st.engine_jobs()
                st.reset_tables(self.geometry.num_groups)
                st.sliding_reads.clear()
        computed: dict[str, int] = {}  # req_id -> tokens computed before this step
        for new in so.scheduled_new_reqs:  # admitted, resumed, or sent in full again
            st = self._state(new.req_id)
            st.tables = as_tables(new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            st = self._state(cached.req_id)
            for table, new_ids in zip(st.tables, as_tables(cached.new_block_ids), strict=True):
                table.extend(new_ids)
            computed[cached.req_id] = cached.num_computed_tokens
        for rid, num_computed in computed.items():
            meta.jobs_to_flush |= self._left_window(self._reqs[rid], num_computed)
        self.stats.num_flushed_jobs += len(meta.jobs_to_flush)
        for rid, num_computed in computed.items():
            job = self.stores.plan(self._reqs[rid],
                                   num_computed + so.num_scheduled_tokens.get(rid, 0),
                                   num_computed, self.hits.room())
            if job is not None:
                meta.stores.append(job)
        return meta

    def _state(self, rid: str) -> ReqState:
        st = self._reqs.get(rid)
        if st is None:  # scheduled without update_state_after_alloc (not expected)
            st = self._reqs[rid] = ReqState(tables=tuple([] for _ in range(
                self.geometry.num_groups)))
        return st

    def _left_window(self, st: ReqState, num_computed: int) -> set[int]:
        """Store jobs of a running request that read a sliding-window block the engine freed
        this step (the window moved past it): flushed before anything writes KV, as a
        preempted request's are."""
        g, flush = self.geometry, set()
        for job_id, reads in list(st.sliding_reads.items()):
            if any(i < g.first_held(group, num_computed) for group, i in reads):
                flush.add(job_id)
                del st.sliding_reads[job_id]
        return flush

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        meta = out.worker_meta
        if meta is None:
            return
        assert isinstance(meta, OffloadingWorkerMetadata), f"not the offloading worker's: {meta!r}"
        self.tiers.update(meta.tiers)
        self.worker = meta.worker
        self._changes.extend(meta.changes)
        self._late_jobs.update(meta.late_jobs)
        for one in meta.results:
            job = self._jobs.get(one.job_id)
            if job is None:
                logger.warning("OffloadingConnector: result of unknown job %d", one.job_id)
                continue
            result = self._jobs.complete(one)
            if result is None:
                continue  # other workers have not reported this stage yet
            if job.kind == STORE and result.stage is Stage.COPY:
                self._finish_copy(result, job)
            elif job.kind == STORE:
                self._finish_write(result, job)
            else:
                self._jobs.pop(result.job_id)
                self._finish_load(result, job)
                self.manager.complete_load(job.pinned)
        self._late_jobs = {j for j in self._late_jobs if j in self._jobs}

    def _finish_copy(self, result: JobResult, job: Job) -> None:
        """Every worker copied the store's blocks into host slots: its keys are ready (the
        failed ones freed)."""
        st = self._reqs.get(job.req_id)
        if st is not None:
            st.store_jobs.discard(result.job_id)
            st.sliding_reads.pop(result.job_id, None)
        failed = set(result.failed_indices)
        good = [k for i, k in enumerate(job.keys) if i not in failed]
        bad = [k for i, k in enumerate(job.keys) if i in failed]
        if bad:
            self.stats.num_failed_stores += 1
        self.observations.add(STORE_BYTES, len(good) * self.geometry.slot_bytes)
        self.manager.complete_store(good, success=True)
        if job.writes_through:
            # NOTE: the workers write their slots to disk now: keep the ready ones pinned and
            # the failed ones reserved (a worker whose copy worked may be writing them) until
            # every worker reported its write.
            self.manager.prepare_load(good)
            job.pinned, job.failed_keys = good, bad
        else:
            self.manager.complete_store(bad, success=False)
            self._jobs.pop(result.job_id)
            self._settle.extend(job.keys)
        if st is not None:
            self._forget_if_done(job.req_id)

    def _finish_write(self, result: JobResult, job: Job) -> None:
        """Every worker's write-throughs ended (written, skipped or failed: each lower tier
        counts which); the slots they read may be reused."""
        self._jobs.pop(result.job_id)
        self.stores.write_ended(job)
        self.manager.complete_load(job.pinned)
        self.manager.complete_store(job.failed_keys, success=False)
        self._settle.extend(job.keys)

    def _finish_load(self, result: JobResult, job: Job) -> None:
        if job.promoted:
            failed = set(result.promote_failed)
            self.manager.complete_store([k for i, k in enumerate(job.promoted) if i in failed],
                                        success=False)
            self.manager.complete_store([k for i, k in enumerate(job.promoted)
                                         if i not in failed])
            self._settle.extend(job.promoted)
        if not result.success:
            self.stats.num_failed_loads += 1
        self.observations.add(LOAD_BYTES,
                              (len(job.keys) + len(job.promoted)) * self.geometry.slot_bytes)
        st = self._reqs.get(job.req_id)
        if st is not None:
            st.load_job = None
            st.load_failed = st.load_failed or not result.success
            self._forget_if_done(job.req_id)

    # ---- lifecycle -----------------------------------------------------------------------------

    def request_finished(self, request: RequestView) -> bool:
        """True: the request's blocks are held until the worker reports it in finished_sending
        (jobs in flight still read or write them; see the module docstring)."""
        rid = request.request_id
        self.hits.forget(rid)
        self.waits.forget(rid)
        self._limits.forget(rid)
        st = self._reqs.get(rid)
        if st is None:
            return False
        self._store_final_blocks(st, request)
        st.request = None
        st.reset_tables(self.geometry.num_groups)
        st.sliding_reads.clear()
        self._finished.add(rid)
        jobs = st.engine_jobs()
        self._forget_if_done(rid)
        if jobs and not self.sync_stores:
            self._held[rid] = sorted(jobs)
            return True
        return False

    def _store_final_blocks(self, st: ReqState, request: RequestView) -> None:
        """Under async scheduling the block that a request's final step completed had no hash
        yet when that step was scheduled, so no step offered it: it is offered now (vLLM's own
        connector does the same), with the request held until the copy ends. Only blocks whose
        KV a finished step wrote: every token but the last sampled one (a step scheduled ahead
        may still be computing that one). Not with `sync_stores`: that engine may never step
        again to run the job."""
        if self.sync_stores or st.load_failed:
            return
        done = min(request.num_computed_tokens, request.num_tokens - 1)
        job = self.stores.plan(st, done, done, self.hits.room())
        if job is not None:
            self._final_stores.append(job)
            self.stats.num_final_block_stores += 1

    def _forget_if_done(self, rid: str) -> None:
        st = self._reqs.get(rid)
        if st is not None and rid in self._finished and st.idle:
            del self._reqs[rid]
            self._finished.discard(rid)

    def take_events(self) -> list[KVCacheEvent]:
        """What every tier stored and dropped since the last call, in the engine's terms
        (block_events.py): the host tier's manager, then the lower tiers' reports."""
        for e in self.manager.take_events():
            self.events.change(e.medium, e.keys, e.removed)  # type: ignore[arg-type]
        for medium, keys in self.lower.take_absent().items():
            self.events.removed(medium, keys)  # found gone by a lookup: no longer hit-able
        for change in self._changes:
            self.events.change(change.medium, change.keys, change.removed)
        self._changes = []
        self.events.settled(self._settle)
        self._settle = []
        return self.events.take()

    def has_pending_work(self) -> bool:
        """A job is in flight that the workers still wait for (not one they gave up on: its
        thread may never return, and the engine must not step forever for it)."""
        return len(self._jobs) > len(self._late_jobs)

    def reset_cache(self) -> bool:
        """Drops the host tier (not disk or Redis: other engines may share them). False while
        any host block is being read or written."""
        return self.manager.reset()

    def metrics(self) -> ConnectorMetrics:
        """Per tier: the workers' transfer counters, with what only this half knows (lookups,
        hits, evictions and occupancy of the host tier are the manager's)."""
        g, counts = self.geometry, self.stats
        host = host_metrics(self.manager, g, self.tiers.get(HOST, TierMetrics()), counts)
        requests = RequestMetrics(**vars(counts), num_late_jobs=len(self._late_jobs),
                                  num_inflight_waits=self.waits.num_waits,
                                  num_inflight_timeouts=self.waits.num_timeouts)
        disk = redis = None
        if DISK in g.lower_media:
            timeouts, skipped = self.lower.disk_metrics()
            disk = extend(DiskMetrics, self.tiers.get(DISK, DiskTierMetrics()),
                          lookup_timeouts=timeouts, lookup_skipped=skipped,
                          hit_tokens=counts.num_disk_hit_tokens)
        if REDIS in g.lower_media:
            tier = self.tiers.get(REDIS, RedisTierMetrics())
            assert isinstance(tier, RedisTierMetrics), f"not the Redis tier's: {tier!r}"
            redis = RedisMetrics.of(tier, self.lower.redis_metrics(), counts.num_redis_hit_tokens)
        return ConnectorMetrics(g.offload_tokens, host, requests, self.worker, disk, redis,
                                decision_metrics(self.decisions, self.manager))

    def close(self) -> None:
        """Releases the lookups' connections (Redis)."""
        self.lower.close()

    def check_no_leaks(self) -> None:
        """Raise if any job, pinned or half-written host block is left (tests call it)."""
        self.manager.check_integrity()
        problems = self._jobs.check()
        if problems:
            raise RuntimeError(f"OffloadingConnector: {'; '.join(problems)}")
        if len(self.waits):
            raise RuntimeError(f"OffloadingConnector: {len(self.waits)} requests still marked as "
                               f"waiting for another job's write")
        assert self._jobs or not self.stores.num_writing, \
            f"{self.stores.num_writing} keys still writing"
        if self._jobs or self.manager.num_pinned or self.manager.num_being_written:
            raise RuntimeError(f"OffloadingConnector: {len(self._jobs)} jobs in flight, "
                               f"{self.manager.num_pinned} pinned and "
                               f"{self.manager.num_being_written} half-written host blocks")
