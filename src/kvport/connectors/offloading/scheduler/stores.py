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

A hybrid model (several KV cache groups) stores every block of a full group, and of a sliding
group only the blocks a hit can use (geometry.worth_storing) that the engine still holds: a block
its window left may already hold another request's KV.
"""

from __future__ import annotations

from kvport.connectors.offloading.geometry import OffloadGeometry, group_key
from kvport.connectors.offloading.manager.policy import PolicyManager
from kvport.connectors.offloading.mediums import KEYED_BLOCKS, EngineBlocks, HostBlocks
from kvport.connectors.offloading.metadata import StoreJob
from kvport.connectors.offloading.scheduler.block_events import BlockEvents
from kvport.connectors.offloading.scheduler.decisions import (
    ALLOCATION_BLOCKS, DecisionCounters, Observations,
)
from kvport.connectors.offloading.scheduler.counters import SchedulerCounters
from kvport.connectors.offloading.scheduler.jobs import STORE, Job, JobTable
from kvport.connectors.offloading.scheduler.requests import ReqState

# The share of host slots that stores writing through to lower tiers may hold at once: the rest
# keeps room for new stores and promotions however slow disk or Redis is.
WRITE_THROUGH_SHARE = 0.5


class StorePlanner:
    def __init__(self, geometry: OffloadGeometry, manager: PolicyManager, jobs: JobTable,
                 counters: SchedulerCounters, store_enabled: bool,
                 events: BlockEvents | None = None, decisions: DecisionCounters | None = None,
                 observations: Observations | None = None) -> None:
        self.geometry = geometry
        self.events = events if events is not None else BlockEvents(False, 1, 1)
        self.decisions = decisions if decisions is not None else DecisionCounters()
        self.observations = observations if observations is not None else Observations()
        self.manager = manager
        self.jobs = jobs
        self.counters = counters
        self.store_enabled = store_enabled
        self.num_writing = 0  # keys of stores planned with write-throughs, until those end

    def plan(self, st: ReqState, num_tokens_done: int, num_computed: int,
             room: int) -> StoreJob | None:
        """The store of what the request's first `num_tokens_done` tokens add to the offload
        blocks offered so far; `num_computed`: its tokens computed before this step (a sliding
        group's blocks before its window are freed); `room`: host slots that are free or could
        be freed."""
        req, g = st.request, self.geometry
        if req is None or not self.store_enabled or not st.hashes_ok or not st.limits.stores:
            return None
        if st.limits.max_offload_tokens is not None:
            num_tokens_done = min(num_tokens_done, st.limits.max_offload_tokens)
        end = min(g.num_offload_blocks(num_tokens_done), g.whole_blocks(len(req.block_hashes)),
                  *(g.whole_blocks(len(table)) for table in st.tables))
        if end <= st.next_store_idx:
            return None  # most steps (decodes inside a block): nothing to slice or hash
        first = st.next_store_idx
        if g.num_groups == 1:
            # At most what the tier could free: a run longer than the tier is stored a part per
            # step (its first blocks first) instead of being refused forever.
            end = min(end, first + room)
            wanted = g.keys(req.block_hashes)[first:end]
            where = {k: (0, first + i) for i, k in enumerate(wanted)}
        else:
            wanted, where, end = self._group_blocks(st, first, end, num_computed, room)
        out = self.manager.prepare_store(wanted) if wanted else None
        if wanted:
            self.observations.add(ALLOCATION_BLOCKS, len(wanted))
        if out is None:
            if wanted:
                self.decisions.host_refused_blocks += len(wanted)
                return None  # full of pinned or in-flight blocks: offer them again next step
            st.next_store_idx = end  # nothing in these blocks is worth storing
            return None
        st.next_store_idx = end
        self.decisions.host_present_blocks += (len(wanted) - len(out.keys_to_store)
                                               - len(out.deferred_keys))
        if not out.keys_to_store:
            return None
        stored = list(out.keys_to_store)
        for key in stored:
            self.events.describe(req, key, *where[key])
        src = [b for k in stored for b in g.engine_span(st.tables[where[k][0]], where[k][1],
                                                        where[k][1] + 1)]
        writes = [KEYED_BLOCKS[medium](stored) for medium in g.lower_media
                  if st.limits.stores_to(medium)]
        if writes and self.num_writing and \
                self.num_writing + len(stored) > WRITE_THROUGH_SHARE * g.num_slots:
            writes = []  # a slow lower tier: this store stays in host memory only
            self.counters.num_skipped_write_throughs += 1
        self.num_writing += len(stored) if writes else 0
        job_id = self.jobs.add(Job(STORE, req.request_id, stored, writes_through=bool(writes)))
        st.store_jobs.add(job_id)
        reads: dict[int, int] = {}  # sliding group -> its first block this job reads
        for key in stored:
            group, i = where[key]
            if g.group_windows[group] is not None:
                reads[group] = min(i, reads.get(group, i))
        if reads:
            st.sliding_reads[job_id] = list(reads.items())
        self.counters.num_store_jobs += 1
        return StoreJob(job_id, EngineBlocks(src), HostBlocks(out.slot_ids), writes,
                        req.request_id)

    def _group_blocks(self, st: ReqState, first: int, end: int, num_computed: int,
                      room: int) -> tuple[list[bytes], dict[bytes, tuple[int, int]], int]:
        """Several groups: the keys of blocks [first, end) worth storing (every block of a full
        group; of a sliding one, those a hit may use and the engine still holds), where each
        lies (group, block), and the block the offer ends at (at most `room` keys)."""
        req, g = st.request, self.geometry
        assert req is not None, "stores of a finished request"
        hashes = req.block_hashes  # with several groups an offload block is one engine block
        held = [g.first_held(group, num_computed) for group in range(g.num_groups)]
        wanted: list[bytes] = []
        where: dict[bytes, tuple[int, int]] = {}
        for i in range(first, end):
            block = [(group, group_key(hashes[i], group)) for group in range(g.num_groups)
                     if i >= held[group]
                     and g.worth_storing(group, i, req.num_prompt_tokens, st.junction)]
            if len(wanted) + len(block) > room:
                return wanted, where, i
            for group, key in block:
                wanted.append(key)
                where[key] = (group, i)
        return wanted, where, end

    def write_ended(self, job: Job) -> None:
        """Every worker's write-through of a store ended."""
        self.num_writing -= len(job.keys)
