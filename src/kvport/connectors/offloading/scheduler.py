"""The OffloadingConnector's scheduler half: which offload blocks to load and store, as jobs.

Keys: offload block i of a request (f engine blocks, obs = f * block_size tokens, see
`geometry.OffloadGeometry`) is keyed by the chained hash of its last engine block. Only full
offload blocks are stored or loaded.

Hits (`get_num_new_matched_tokens`): after the engine's own prefix hit, the leading run of keys
ready in the host tier, extended by keys a lower tier holds: each from the highest that has it
(a disk entry exists; else Redis, asked once per request for all the keys left, in one batched
round trip with a short timeout, which is a miss). A run held wholly in host memory is a
synchronous load (answered is_async=False, copied before the step's forward: the request prefills
in the step that admits it); any other run is async (the request waits in
WAITING_FOR_REMOTE_KVS). Keys outside host memory are promoted through host slots reserved with
prepare_store (bypassing admission control: they are hits), in the same job as the host-to-engine
copy. Lookups are counted (manager stats, admission control) once per
admission, in update_state_after_alloc, not per match: the engine may match a waiting request
several times before it is admitted.

Keys being written: a key that another request's job is writing to the host tier (a promotion
or a store in flight) ends the hit run. The request then waits for that write, answered None
(ask again) each step, at most `inflight_wait_s` (see inflight.py), and computes what is still
being written after that. It never shares the other job: once the keys are ready it takes them
as any hit (the engine's own prefix cache, after the other request's load, or a copy of its
own), so the other job's failure is only a miss for it. Host hits of the same keys are never
shared either: each request copies its own (reads of ready slots run in parallel).

Stores (`build_connector_meta`): every full offload block that the step computes (or that a hit
covered without it being in the host tier) gets a slot from prepare_store and one ENGINE->HOST
job per request and step. A full host tier (None) retries the next step. With lower tiers the
job also names its keys' entries there: once a worker's copy is done, the worker writes the same
slots through to disk and Redis by itself. When every worker reported the copy, the keys become
ready and stay pinned until every worker reported the write (see jobs.py for the stages).
Behind a slow lower tier those pins would grow until no slot is left for new stores: at most
WRITE_THROUGH_SHARE of the host slots are planned for write-throughs at once; a store beyond
that stays in host memory only (counted: num_skipped_write_throughs).

The fence: `request_finished` returns False, so a finished or preempted request's blocks go back
to the pool at once, while its store jobs may not have read them yet. Every step, the pending
store jobs that read a block handed out again in this step (and every store job of a preempted
request) go into `jobs_to_flush`; the worker finishes them before anything writes KV.

Re-admission: a preempted request asked again while its own stores are unreported is answered
None (ask again) until they report. They were flushed at the preemption, so they are done or
nearly, but their keys are still being written: matched now, the hit run would end at them and
the request would recompute what it has just offloaded. Waiting lets it load them, and keeps a
request's jobs simple: store jobs or one load job, never both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvport.connectors.base import KVCacheEvent, KVConnectorOutput
from kvport.connectors.offloading.admission import admission_for
from kvport.connectors.offloading.arc import ARCManager
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.inflight import InflightWaits
from kvport.connectors.offloading.jobs import LOAD, STORE, Job, JobTable
from kvport.connectors.offloading.lru import LRUManager
from kvport.connectors.offloading.lower_lookup import LowerLookup
from kvport.connectors.offloading.mediums import (
    DISK, HOST, KEYED_BLOCKS, REDIS, EngineBlocks, HostBlocks,
)
from kvport.connectors.offloading.metadata import (
    JobResult, LoadJob, OffloadingConnectorMetadata, OffloadingWorkerMetadata, Promotion, Stage,
    StoreJob,
)
from kvport.connectors.offloading.policy import PolicyManager

if TYPE_CHECKING:
    from kvport.connectors.views import RequestView, SchedulerOutputView

logger = logging.getLogger(__name__)
# The share of host slots that stores writing through to lower tiers may hold at once: the rest
# keeps room for new stores and promotions however slow disk or Redis is.
WRITE_THROUGH_SHARE = 0.5


@dataclass
class _ReqState:
    request: RequestView | None = None
    block_ids: list[int] = field(default_factory=list)  # the request's block table
    next_store_idx: int = 0  # offload blocks below this were offered to the host tier
    store_jobs: set[int] = field(default_factory=set)
    load_job: int | None = None
    # A load of this request failed: it is not offered another one (the engine recomputes the
    # blocks; offering them again could fail the same way, forever).
    load_failed: bool = False
    hashes_ok: bool = True  # one block hash per engine block (see HitStats)


@dataclass
class _Match:
    """What get_num_new_matched_tokens found, for update_state_after_alloc."""

    num_local: int
    start: int  # first offload block not fully covered by the local hit
    asked: list[bytes]  # the keys from `start` on: counted once the request is admitted
    host_keys: list[bytes] = field(default_factory=list)
    # The run's keys outside host memory, in token order, each with the lower tier (DISK, REDIS)
    # it is promoted from.
    lower: list[tuple[bytes, str]] = field(default_factory=list)
    sync: bool = False  # host hits only: a synchronous load


@dataclass
class HitStats:
    num_queried_tokens: int = 0  # prompt tokens beyond the local hit, asked of the connector
    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    num_redis_hit_tokens: int = 0
    num_load_jobs: int = 0
    num_sync_loads: int = 0  # of num_load_jobs: host hits copied before the step's forward
    num_failed_loads: int = 0
    num_store_jobs: int = 0
    num_failed_stores: int = 0
    num_flushed_jobs: int = 0
    num_busy_answers: int = 0  # None answers: the request's own stores were still pending
    # Admissions whose block hashes were not one per engine block (a hash block size unlike
    # the KV block's): key i would name another prefix than the bytes under it, so the
    # request is neither loaded nor stored.
    num_mismatched_hashes: int = 0
    num_skipped_write_throughs: int = 0  # stores kept in host memory only (WRITE_THROUGH_SHARE)


def make_manager(config: OffloadingConfig, num_slots: int) -> PolicyManager:
    """The host tier's manager: the configured eviction policy and admission control."""
    cls = LRUManager if config.eviction_policy == "lru" else ARCManager
    return cls(num_slots, HOST, admission_for(config.store_threshold))


class OffloadingScheduler:
    def __init__(self, config: OffloadingConfig, geometry: OffloadGeometry, load: bool = True,
                 store: bool = True, num_workers: int = 1) -> None:
        self.load_enabled, self.store_enabled = load, store  # kv_role consumer / producer
        self.sync_host_loads = config.sync_host_loads
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.factor = geometry.block_factor  # f
        self.offload_tokens = geometry.offload_tokens  # obs
        self.manager = make_manager(config, geometry.num_slots)
        self.lower = LowerLookup(config, geometry.disk_namespace)  # disk, Redis: which keys
        self._reqs: dict[str, _ReqState] = {}
        self._matches: dict[str, _Match] = {}  # req_id -> its latest match
        # In flight (planned, not every stage reported by every worker: one per TP rank).
        self._jobs = JobTable(num_workers)
        self._fresh_blocks: set[int] = set()  # handed out in this step (after_alloc)
        self._finished: set[str] = set()  # finished requests kept until their jobs report
        self._loads: list[LoadJob] = []  # for the next metadata
        # Synchronous loads in flight: job id -> engine blocks it writes (fenced once planned).
        self._sync_loads: dict[int, list[int]] = {}
        self._hit_split: dict[str, dict[str, int]] = {}  # req_id -> tier -> hit tokens
        self.stats = HitStats()
        self.waits = InflightWaits(config.inflight_wait_s)
        self.tier_stats: dict[str, dict[str, float]] = {}  # worker tiers' cumulative counters
        self.worker_stats: dict[str, float] = {}  # the workers' own (deadlines.WorkerStats)
        self._late_jobs: set[int] = set()  # jobs a worker gave up waiting for, not reported yet
        self._num_writing = 0  # keys of stores planned with write-throughs, until those end

    # ---- admission -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_local: int) -> tuple[int | None, bool]:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is not None and st.store_jobs:
            self.stats.num_busy_answers += 1
            return None, False  # its own stores are unreported: load them once they are
        if not self._hashes_ok(request):
            if rid not in self._matches:  # counted once per admission, not per retry
                self.stats.num_mismatched_hashes += 1
                logger.warning("OffloadingConnector: request %s has %d block hashes for %d tokens "
                               "in blocks of %d; it is not offloaded", rid,
                               len(request.block_hashes), request.num_tokens, self.block_size)
            self._matches[rid] = _Match(num_local, 0, [])
            return 0, False
        keys = self.geometry.keys(request.block_hashes)
        start = num_local // self.offload_tokens
        self._matches[rid] = _Match(num_local, start, keys[start:])
        if not self.load_enabled or (st is not None and st.load_failed):
            return 0, False
        if st is not None and st.load_job is not None:
            return 0, False  # a late load still holds its slots: this request loads no more
        num_host = self.manager.lookup(keys[start:]) if start < len(keys) else 0
        self.manager.touch(keys[:start + num_host])  # the prefix's first block most recent
        if start >= len(keys):
            return 0, False
        host_keys = keys[start:start + num_host]
        lower: list[tuple[bytes, str]] = []
        if self.lower:
            # Promotions need host slots: never more than the tier could free for them. A key
            # in host memory ends the run (being written: the request may wait for it, below).
            room = max(0, self._room() - num_host)
            candidates = keys[start + num_host:start + num_host + room]
            lower = self.lower.find_run(candidates, stop=self.manager.contains)
        end = start + num_host + len(lower)
        if self._being_written(keys, end, request.num_tokens) and self.waits.should_wait(rid):
            return None, False  # ask again once that write reported
        sync = self.sync_host_loads and not lower
        if sync:
            # The forward must compute at least the prompt's last token (its logits give the
            # first output token): a synchronous hit ends at the last whole offload block
            # before it, as the engine's own prefix cache does.
            end = min(end, (request.num_tokens - 1) // self.offload_tokens)
            host_keys = keys[start:end]
        num_external = end * self.offload_tokens - num_local
        if num_external <= 0:
            return 0, False
        self._matches[rid] = _Match(num_local, start, keys[start:], host_keys, lower, sync)
        return num_external, not sync

    def _hashes_ok(self, request: RequestView) -> bool:
        """One hash per full engine block: key i then names exactly the prefix stored under it."""
        return len(request.block_hashes) == request.num_tokens // self.block_size

    def _being_written(self, keys: list[bytes], end: int, num_tokens: int) -> bool:
        """The hit run ends at `keys[end]` because another job is writing it to the host tier,
        and the request could use it (the prompt's last token is always computed)."""
        if end >= min(len(keys), (num_tokens - 1) // self.offload_tokens):
            return False
        return self.manager.contains(keys[end]) and not self.manager.lookup(keys[end:end + 1])

    def update_state_after_alloc(self, request: RequestView, block_ids: list[int],
                                 num_external: int) -> None:
        rid = request.request_id
        self.waits.forget(rid)
        old = self._reqs.get(rid)
        match = self._matches.pop(rid, None)
        st = _ReqState(request, list(block_ids), store_jobs=set(old.store_jobs) if old else set(),
                       load_failed=old is not None and old.load_failed,
                       hashes_ok=self._hashes_ok(request))
        self._reqs[rid] = st
        # Blocks new to this request may have been freed by another one with a store pending.
        if old is not None and old.block_ids and old.block_ids == block_ids[:len(old.block_ids)]:
            self._fresh_blocks.update(block_ids[len(old.block_ids):])  # resumed after a load
        else:
            num_local = match.num_local if match is not None else request.num_computed_tokens
            self._fresh_blocks.update(block_ids[num_local // self.block_size:])
        if match is not None:  # counted here, once per admission (matches may be retried)
            self.stats.num_queried_tokens += max(0, request.num_tokens - match.num_local)
            if match.asked:
                self.manager.count_admission(match.asked, len(match.host_keys))
        if num_external > 0:
            assert match is not None, f"{rid}: {num_external} external tokens without a match"
            split = self._split_by_tier(match, num_external)
            self.stats.num_host_hit_tokens += split.get(HOST, 0)
            self.stats.num_disk_hit_tokens += split.get(DISK, 0)
            self.stats.num_redis_hit_tokens += split.get(REDIS, 0)
            self._hit_split[rid] = split
            self._plan_load(rid, st, match)

    def _split_by_tier(self, match: _Match, num_external: int) -> dict[str, int]:
        """The hit's first `num_external` tokens per tier they come from (HOST, DISK, REDIS), in
        token order. The local hit may end inside the run's first offload block: those tokens
        are the engine's own."""
        sources = [HOST] * len(match.host_keys) + [medium for _, medium in match.lower]
        split: dict[str, int] = {}
        left = num_external
        for j, medium in enumerate(sources):
            tokens = self.offload_tokens
            if j == 0:
                tokens -= match.num_local - match.start * self.offload_tokens
            tokens = min(tokens, left)
            split[medium] = split.get(medium, 0) + tokens
            left -= tokens
        return split

    def take_hit_split(self, req_id: str) -> dict[str, int]:
        """Tokens of the request's latest hit per tier (HOST, DISK, REDIS): for engines that
        report hits by source (vLLM)."""
        return self._hit_split.pop(req_id, {})

    def _plan_load(self, rid: str, st: _ReqState, match: _Match) -> None:
        f = self.factor
        first_block = match.num_local // self.block_size  # engine blocks before it are local
        num_host = len(match.host_keys)
        slots = self.manager.prepare_load(match.host_keys)  # pinned until the load reports
        job = Job(LOAD, rid, list(match.host_keys), pinned=list(match.host_keys))
        promotions: list[Promotion] = []
        lower_keys = [key for key, _ in match.lower]
        if lower_keys:
            # Host slots for the promotion. The keys are hits, admitted when first stored:
            # admission control must not hold them back.
            out = self.manager.prepare_store(lower_keys, bypass_admission=True)
            if out is not None and out.keys_to_store == lower_keys:
                job.promoted = lower_keys
                slots = slots + out.slot_ids
                promotions = _promotions(match.lower, out.slot_ids)
            elif out is not None:  # not expected (keys being written end the hit run)
                self.manager.complete_store(out.keys_to_store, success=False)
        loadable_end = (match.start + num_host + len(job.promoted)) * f
        hit_end = (match.start + num_host + len(lower_keys)) * f
        dst = st.block_ids[first_block:loadable_end]
        load = LoadJob(self._jobs.add(job), rid, HostBlocks(slots),
                       EngineBlocks(dst, first_block - match.start * f if dst else 0),
                       promotions,
                       unloadable=st.block_ids[max(first_block, loadable_end):hit_end],
                       sync=match.sync)
        st.load_job = load.job_id
        self._loads.append(load)
        self.stats.num_load_jobs += 1
        if match.sync:
            self._sync_loads[load.job_id] = dst
            self.stats.num_sync_loads += 1

    # ---- per step ------------------------------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutputView) -> OffloadingConnectorMetadata:
        meta = OffloadingConnectorMetadata(loads=self._loads)
        self._loads = []
        flush: set[int] = set()
        for rid in so.preempted_req_ids:
            st = self._reqs.get(rid)
            if st is not None:
                flush |= st.store_jobs
                st.block_ids, st.next_store_idx = [], 0
        computed: dict[str, int] = {}
        fresh, self._fresh_blocks = self._fresh_blocks, set()
        for new in so.scheduled_new_reqs:
            st = self._reqs.setdefault(new.req_id, _ReqState())
            known = len(st.block_ids)
            if st.block_ids != new.block_ids[:known]:
                fresh.update(new.block_ids[new.num_computed_tokens // self.block_size:])
            else:  # admitted (known in full already), or running and sent in full again
                fresh.update(new.block_ids[known:])
            st.block_ids = list(new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            st = self._reqs.setdefault(cached.req_id, _ReqState())
            st.block_ids.extend(cached.new_block_ids)
            fresh.update(cached.new_block_ids)
            computed[cached.req_id] = cached.num_computed_tokens
        flush |= self._jobs.readers_of(fresh)
        # This step's synchronous loads write blocks handed out now: fenced from here on. A part
        # that outlived its step (its blocks recomputed by their request) does not start after
        # its deadline (EngineBlocks.deadline), and one already copying ends within ms; the
        # fence makes sure even that one ends before another request gets the blocks.
        planned = {load.job_id for load in meta.loads}
        for job_id in planned & self._sync_loads.keys():
            self._jobs.fence(job_id, self._sync_loads[job_id])
        meta.jobs_to_flush = flush
        self.stats.num_flushed_jobs += len(flush)
        for rid, num_computed in computed.items():
            job = self._plan_store(rid, num_computed + so.num_scheduled_tokens.get(rid, 0))
            if job is not None:
                meta.stores.append(job)
        return meta

    def _plan_store(self, rid: str, num_tokens_done: int) -> StoreJob | None:
        st = self._reqs[rid]
        req = st.request
        if req is None or not self.store_enabled or not st.hashes_ok:
            return None
        f = self.factor
        end = min(num_tokens_done // self.offload_tokens, len(req.block_hashes) // f,
                  len(st.block_ids) // f)
        if end <= st.next_store_idx:
            return None  # most steps (decodes inside a block): nothing to slice or hash
        # At most what the tier could free: a run longer than the tier is stored a part per
        # step (its first blocks first) instead of being refused forever.
        end = min(end, st.next_store_idx + self._room())
        wanted = self.geometry.keys(req.block_hashes[:end * f])[st.next_store_idx:]
        out = self.manager.prepare_store(wanted) if wanted else None
        if out is None:
            return None  # full of pinned or in-flight blocks: offer them again next step
        first = st.next_store_idx
        st.next_store_idx += len(wanted)
        if not out.keys_to_store:
            return None
        position = {k: first + i for i, k in enumerate(wanted)}
        src = [b for k in out.keys_to_store
               for b in st.block_ids[position[k] * f:(position[k] + 1) * f]]
        keys = list(out.keys_to_store)
        writes = [KEYED_BLOCKS[medium](keys) for medium in self.lower.media]
        if writes and self._num_writing and \
                self._num_writing + len(keys) > WRITE_THROUGH_SHARE * self.geometry.num_slots:
            writes = []  # a slow lower tier: this store stays in host memory only
            self.stats.num_skipped_write_throughs += 1
        self._num_writing += len(keys) if writes else 0
        job_id = self._jobs.add(Job(STORE, rid, keys, src, writes_through=bool(writes)))
        st.store_jobs.add(job_id)
        self.stats.num_store_jobs += 1
        return StoreJob(job_id, EngineBlocks(src), HostBlocks(out.slot_ids), writes, rid)

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        meta = out.worker_meta
        if meta is None:
            return
        assert isinstance(meta, OffloadingWorkerMetadata), f"not the offloading worker's: {meta!r}"
        self.tier_stats.update(meta.tier_stats)
        self.worker_stats.update(meta.worker_stats)
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
                self._jobs.release_reads(result.job_id, job)
                self._sync_loads.pop(result.job_id, None)
                self._finish_load(result, job)
                self.manager.complete_load(job.pinned)
        self._late_jobs = {j for j in self._late_jobs if j in self._jobs}

    def _finish_copy(self, result: JobResult, job: Job) -> None:
        """Every worker copied the store's blocks into host slots: its keys are ready (the
        failed ones freed), and the fence no longer waits for it."""
        self._jobs.release_reads(result.job_id, job)
        st = self._reqs.get(job.req_id)
        if st is not None:
            st.store_jobs.discard(result.job_id)
        failed = set(result.failed_indices)
        good = [k for i, k in enumerate(job.keys) if i not in failed]
        bad = [k for i, k in enumerate(job.keys) if i in failed]
        if bad:
            self.stats.num_failed_stores += 1
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
        if st is not None:
            self._forget_if_done(job.req_id)

    def _finish_write(self, result: JobResult, job: Job) -> None:
        """Every worker's write-throughs ended (written, skipped or failed: each lower tier
        counts which); the slots they read may be reused."""
        self._jobs.pop(result.job_id)
        self._num_writing -= len(job.keys)
        self.manager.complete_load(job.pinned)
        self.manager.complete_store(job.failed_keys, success=False)

    def _finish_load(self, result: JobResult, job: Job) -> None:
        if job.promoted:
            failed = set(result.promote_failed)
            self.manager.complete_store([k for i, k in enumerate(job.promoted) if i in failed],
                                        success=False)
            self.manager.complete_store([k for i, k in enumerate(job.promoted)
                                         if i not in failed])
        if not result.success:
            self.stats.num_failed_loads += 1
        st = self._reqs.get(job.req_id)
        if st is not None:
            st.load_job = None
            st.load_failed = st.load_failed or not result.success
            self._forget_if_done(job.req_id)

    # ---- lifecycle -----------------------------------------------------------------------------

    def request_finished(self, request: RequestView) -> None:
        """The blocks are freed now; pending stores keep reading them under the fence."""
        rid = request.request_id
        self._matches.pop(rid, None)
        self._hit_split.pop(rid, None)
        self.waits.forget(rid)
        st = self._reqs.get(rid)
        if st is not None:
            st.request, st.block_ids, st.next_store_idx = None, [], 0
            self._finished.add(rid)
            self._forget_if_done(rid)

    def _forget_if_done(self, rid: str) -> None:
        st = self._reqs.get(rid)
        if (st is not None and rid in self._finished and not st.store_jobs
                and st.load_job is None):
            del self._reqs[rid]
            self._finished.discard(rid)

    def take_events(self) -> list[KVCacheEvent]:
        return [KVCacheEvent(tuple(e.keys), e.medium, e.removed)
                for e in self.manager.take_events()]

    def has_pending_work(self) -> bool:
        """A job is in flight that the workers still wait for (not one they gave up on: its
        thread may never return, and the engine must not step forever for it)."""
        return len(self._jobs) > len(self._late_jobs)

    def reset_cache(self) -> bool:
        """Drops the host tier (not disk or Redis: other engines may share them). False while
        any host block is being read or written."""
        return self.manager.reset()

    def _room(self) -> int:
        """Host slots that are free or could be freed (not pinned, not being written)."""
        return self.geometry.num_slots - self.manager.num_pinned - self.manager.num_being_written

    def metrics(self) -> dict[str, Any]:
        """Per tier: the worker's transfer counters, with what only this half knows (lookups,
        hits, evictions and occupancy of the host tier are the manager's)."""
        m, g = self.manager.stats, self.geometry
        used = g.num_slots - self.manager.num_free_slots
        host = dict(self.tier_stats.get(HOST, {}))
        host.update(num_slots=g.num_slots, occupancy_blocks=used,
                    occupancy_bytes=used * g.slot_bytes, lookups=m.num_lookups,
                    hits=m.num_hit_blocks, evictions=m.num_evicted_blocks,
                    num_rejected_stores=m.num_rejected_stores,
                    num_deferred_blocks=m.num_deferred_blocks,
                    hit_tokens=self.stats.num_host_hit_tokens)
        requests = dict(vars(self.stats), num_late_jobs=len(self._late_jobs),
                        num_inflight_waits=self.waits.num_waits,
                        num_inflight_timeouts=self.waits.num_timeouts)
        out: dict[str, Any] = {"offload_block_tokens": self.offload_tokens, "host": host,
                               "requests": requests, "worker": dict(self.worker_stats)}
        hit_tokens = {DISK: self.stats.num_disk_hit_tokens, REDIS: self.stats.num_redis_hit_tokens}
        for medium in self.lower.media:
            tier = dict(self.tier_stats.get(medium, {}))
            tier.update(self.lower.stats(medium))  # the lookups: this half's own
            tier["hit_tokens"] = hit_tokens[medium]
            out[medium.lower()] = tier
        return out

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
        assert self._jobs or not self._num_writing, f"{self._num_writing} keys still writing"
        if self._jobs or self.manager.num_pinned or self.manager.num_being_written:
            raise RuntimeError(f"OffloadingConnector: {len(self._jobs)} jobs in flight, "
                               f"{self.manager.num_pinned} pinned and "
                               f"{self.manager.num_being_written} half-written host blocks")


def _promotions(lower: list[tuple[bytes, str]], slots: list[int]) -> list[Promotion]:
    """The promotions of a hit's keys outside host memory into their slots: one per lower tier,
    each with its keys in token order."""
    by_medium: dict[str, tuple[list[bytes], list[int]]] = {}
    for (key, medium), slot in zip(lower, slots, strict=True):
        keys, dst = by_medium.setdefault(medium, ([], []))
        keys.append(key)
        dst.append(slot)
    return [Promotion(KEYED_BLOCKS[medium](keys), HostBlocks(dst))
            for medium, (keys, dst) in by_medium.items()]
