"""Stores: which offload blocks a step computed that the host tier should keep, as jobs.

Every full offload block that the step computes (or that a hit covered without it being in the
host tier) gets a slot from prepare_store, in one ENGINE->HOST job per request and step. A full
host tier (None) retries the next step. With lower tiers the job also names its keys' entries
there: once a worker's copy is done, the worker writes the same slots through to disk and Redis
by itself. When every worker reported the copy, the keys become ready and stay pinned until
every worker reported the write (jobs.py has the stages). Behind a slow lower tier those pins
would grow until no slot is left for new stores: at most WRITE_THROUGH_SHARE of the host slots
are planned for write-throughs at once; a store beyond that stays in host memory only (counted:
num_skipped_write_throughs).
"""

from __future__ import annotations

from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.manager.policy import PolicyManager
from kvport.connectors.offloading.mediums import KEYED_BLOCKS, EngineBlocks, HostBlocks
from kvport.connectors.offloading.metadata import StoreJob
from kvport.connectors.offloading.scheduler.counters import SchedulerCounters
from kvport.connectors.offloading.scheduler.jobs import STORE, Job, JobTable
from kvport.connectors.offloading.scheduler.requests import ReqState

# The share of host slots that stores writing through to lower tiers may hold at once: the rest
# keeps room for new stores and promotions however slow disk or Redis is.
WRITE_THROUGH_SHARE = 0.5


class StorePlanner:
    def __init__(self, geometry: OffloadGeometry, manager: PolicyManager, jobs: JobTable,
                 counters: SchedulerCounters, store_enabled: bool) -> None:
        self.geometry = geometry
        self.manager = manager
        self.jobs = jobs
        self.counters = counters
        self.store_enabled = store_enabled
        self.num_writing = 0  # keys of stores planned with write-throughs, until those end

    def plan(self, st: ReqState, num_tokens_done: int, room: int) -> StoreJob | None:
        """The store of what the request's first `num_tokens_done` tokens add to the offload
        blocks offered so far; `room`: host slots that are free or could be freed."""
        req, g = st.request, self.geometry
        if req is None or not self.store_enabled or not st.hashes_ok:
            return None
        end = min(g.num_offload_blocks(num_tokens_done), g.whole_blocks(len(req.block_hashes)),
                  g.whole_blocks(len(st.block_ids)))
        if end <= st.next_store_idx:
            return None  # most steps (decodes inside a block): nothing to slice or hash
        # At most what the tier could free: a run longer than the tier is stored a part per
        # step (its first blocks first) instead of being refused forever.
        end = min(end, st.next_store_idx + room)
        wanted = g.keys(req.block_hashes)[st.next_store_idx:end]
        out = self.manager.prepare_store(wanted) if wanted else None
        if out is None:
            return None  # full of pinned or in-flight blocks: offer them again next step
        first = st.next_store_idx
        st.next_store_idx += len(wanted)
        if not out.keys_to_store:
            return None
        position = {k: first + i for i, k in enumerate(wanted)}
        src = [b for k in out.keys_to_store
               for b in g.engine_span(st.block_ids, position[k], position[k] + 1)]
        stored = list(out.keys_to_store)
        writes = [KEYED_BLOCKS[medium](stored) for medium in g.lower_media]
        if writes and self.num_writing and \
                self.num_writing + len(stored) > WRITE_THROUGH_SHARE * g.num_slots:
            writes = []  # a slow lower tier: this store stays in host memory only
            self.counters.num_skipped_write_throughs += 1
        self.num_writing += len(stored) if writes else 0
        job_id = self.jobs.add(Job(STORE, req.request_id, stored, writes_through=bool(writes)))
        st.store_jobs.add(job_id)
        self.counters.num_store_jobs += 1
        return StoreJob(job_id, EngineBlocks(src), HostBlocks(out.slot_ids), writes,
                        req.request_id)

    def write_ended(self, job: Job) -> None:
        """Every worker's write-through of a store ended."""
        self.num_writing -= len(job.keys)
