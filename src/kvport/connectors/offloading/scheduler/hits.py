"""Hits: how many tokens a waiting request may load, and the load job that delivers them.

After the engine's own prefix hit, the hit run is the leading run of keys ready in the host tier,
extended by keys a lower tier holds: each from the highest that has it (a disk entry exists;
else Redis, asked once per request for all the keys left, in one batched round trip with a short
timeout, which is a miss). A run held wholly in host memory is a synchronous load (answered
is_async=False, copied before the step's forward: the request prefills in the step that admits
it); any other run is async (the request waits in WAITING_FOR_REMOTE_KVS). Keys outside host
memory are promoted through host slots reserved with prepare_store (bypassing admission
control: they are hits), in the same job as the host-to-engine copy.

A hybrid model (several KV cache groups) takes its hit from group_hits.py: the largest boundary
at which every group holds what a hit there reads (a sliding group only its window).

`match` may run several times for one request before it is admitted; what it found is kept for
`admit` (update_state_after_alloc), which counts the lookups once per admission and plans the
load.

Keys being written: a key that another request's job is writing to the host tier (a promotion
or a store in flight) ends the hit run. The request then waits for that write, answered None
(ask again) each step, at most `inflight_wait_s` (inflight.py), and computes what is still being
written after that. It never shares the other job: once the keys are ready it takes them as any
hit, so the other job's failure is only a miss for it. Host hits of the same keys are never
shared either: each request copies its own (reads of ready slots run in parallel).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.manager.policy import PolicyManager
from kvport.connectors.offloading.mediums import (
    DISK, HOST, KEYED_BLOCKS, REDIS, EngineBlocks, HostBlocks,
)
from kvport.connectors.offloading.metadata import LoadJob, Promotion
from kvport.connectors.offloading.scheduler.block_events import BlockEvents
from kvport.connectors.offloading.scheduler.decisions import Observations, lookup_seconds
from kvport.connectors.offloading.scheduler.counters import SchedulerCounters
from kvport.connectors.offloading.scheduler.group_hits import find_group_hit
from kvport.connectors.offloading.scheduler.inflight import InflightWaits
from kvport.connectors.offloading.scheduler.jobs import LOAD, Job, JobTable
from kvport.connectors.offloading.scheduler.lower_lookup import LowerLookup
from kvport.connectors.offloading.scheduler.requests import ReqState
from kvport.connectors.transfer_params import NO_LIMITS, TransferLimits

if TYPE_CHECKING:
    from kvport.connectors.views import RequestView

logger = logging.getLogger(__name__)


@dataclass
class Match:
    """What `match` found for a request, kept for its admission."""

    num_local: int
    start: int  # first offload block not fully covered by the local hit
    asked: list[bytes]  # the keys from `start` on: counted once the request is admitted
    host_keys: list[bytes] = field(default_factory=list)
    # The run's keys outside host memory, in token order, each with the lower tier (DISK, REDIS)
    # it is promoted from.
    lower: list[tuple[bytes, str]] = field(default_factory=list)
    sync: bool = False  # host hits only: a synchronous load
    # Several KV cache groups: where each of host_keys + lower goes, (group, block); and per hit
    # block the tier its tokens count for. None with one group (the run is blocks start..end).
    dst: list[tuple[int, int]] | None = None
    media: list[str] | None = None
    junction: int | None = None  # group_hits.GroupHit.junction
    limited: bool = False  # the request's own limits (kv_transfer_params) cut the hit short

    @property
    def end(self) -> int:
        """The offload block after the run."""
        if self.media is not None:
            return self.start + len(self.media)
        return self.start + len(self.host_keys) + len(self.lower)


class HitPlanner:
    def __init__(self, geometry: OffloadGeometry, manager: PolicyManager, lower: LowerLookup,
                 waits: InflightWaits, jobs: JobTable, counters: SchedulerCounters,
                 load_enabled: bool, sync_host_loads: bool,
                 events: BlockEvents | None = None,
                 observations: Observations | None = None) -> None:
        self.geometry = geometry
        self.events = events if events is not None else BlockEvents(False, 1, 1)
        self.observations = observations if observations is not None else Observations()
        self.manager = manager
        self.lower = lower
        self.waits = waits
        self.jobs = jobs
        self.counters = counters
        self.load_enabled = load_enabled
        self.sync_host_loads = sync_host_loads
        self._matches: dict[str, Match] = {}  # req_id -> its latest match
        self._hit_split: dict[str, dict[str, int]] = {}  # req_id -> tier -> hit tokens

    def match(self, request: RequestView, num_local: int, st: ReqState | None,
              limits: TransferLimits = NO_LIMITS) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens, for a request with no store job in flight, within its
        own `limits` (kv_transfer_params)."""
        rid, g = request.request_id, self.geometry
        if not hashes_ok(request, g.block_size):
            if rid not in self._matches:  # counted once per admission, not per retry
                self.counters.num_mismatched_hashes += 1
                logger.warning("OffloadingConnector: request %s has %d block hashes for %d tokens "
                               "in blocks of %d; it is not offloaded", rid,
                               len(request.block_hashes), request.num_tokens, request.block_size)
            self._matches[rid] = Match(num_local, 0, [])
            return 0, False
        groups = g.group_keys(request.block_hashes)
        start = g.num_offload_blocks(num_local)
        self._matches[rid] = Match(num_local, start, [k for ks in groups for k in ks[start:]])
        if not self.load_enabled or (st is not None and st.load_failed):
            return 0, False
        if st is not None and st.load_job is not None:
            return 0, False  # a late load still holds its slots: this request loads no more
        capped = False  # the request's max_load_tokens ends its keys early
        if limits.max_load_tokens is not None:  # a hit ends on a block boundary within it
            last = g.num_offload_blocks(num_local + limits.max_load_tokens)
            capped = last < len(groups[0])
            groups = tuple(ks[:last] for ks in groups)
        if len(groups) > 1:
            return self._match_groups(request, num_local, start, groups, limits)
        keys = groups[0]
        began = time.perf_counter()
        num_host = self.manager.lookup(keys[start:]) if start < len(keys) else 0
        self.observations.add(lookup_seconds(HOST), time.perf_counter() - began)
        limited = False
        if num_host and not limits.loads_from(HOST):
            num_host, limited = 0, True  # a run through host memory ends at once
        self.manager.touch(keys[:start + num_host])  # the prefix's first block most recent
        if start >= len(keys):
            self._matches[rid].limited = capped
            return 0, False
        match = Match(num_local, start, keys[start:], keys[start:start + num_host])
        if self.lower:
            # Promotions need host slots: never more than the tier could free for them. A key
            # in host memory ends the run (being written: the request may wait for it, below).
            room = max(0, self.room() - num_host)
            candidates = keys[start + num_host:start + num_host + room]
            match.lower = self.lower.find_run(candidates, stop=self.manager.contains)
            cut = next((i for i, (_, m) in enumerate(match.lower)
                        if not limits.loads_from(m)), None)
            if cut is not None:  # the run ends at a block of a tier the request does not allow
                match.lower, limited = match.lower[:cut], True
        end = match.end
        match.limited = limited or (capped and end == len(keys))
        if self._being_written(keys, end, request.num_tokens) and self.waits.should_wait(rid):
            return None, False  # ask again once that write reported
        match.sync = self.sync_host_loads and not match.lower
        if match.sync:
            # A synchronous hit leaves the prompt's last token to the forward, as the engine's
            # own prefix cache does.
            end = min(end, g.max_hit_blocks(request.num_tokens))
            match.host_keys = keys[start:end]
        num_external = g.hit_tokens(num_local, start, end)
        if num_external <= 0:
            self._matches[rid].limited = match.limited
            return 0, False
        self._matches[rid] = match
        return num_external, not match.sync

    def _match_groups(self, request: RequestView, num_local: int, start: int,
                      groups: tuple[list[bytes], ...],
                      limits: TransferLimits) -> tuple[int | None, bool]:
        """`match` for a hybrid model (group_hits.py). Its hits leave the prompt's last token
        to the forward (as the engine's own prefix cache does), so a hit always ends on a block
        boundary, where the sliding windows were stored for. A hit that needs a block from a
        tier the request does not load from is none (a shorter one would need other windows)."""
        rid, g = request.request_id, self.geometry
        limit = min(g.max_hit_blocks(request.num_tokens), len(groups[0]))
        hit = find_group_hit(g, self.manager, self.lower, groups, start, limit, self.room())
        local = [ks[i] for i in range(min(start, limit)) for grp, ks in enumerate(groups)
                 if g.group_windows[grp] is None]
        self.manager.touch(local + hit.touched)  # the prefix's first block most recent
        match = self._matches[rid]
        match.junction = hit.junction
        if hit.blocked and self.waits.should_wait(rid):
            return None, False  # ask again once that write reported
        if hit.end <= start:
            return 0, False
        if not all(limits.loads_from(m) for _, _, _, m in hit.parts):
            match.limited = True
            return 0, False
        match.host_keys = [key for _, _, key, m in hit.parts if m == HOST]
        match.lower = [(key, m) for _, _, key, m in hit.parts if m != HOST]
        match.dst = [(grp, i) for grp, i, _, _ in hit.parts]
        match.media = hit.media
        match.sync = self.sync_host_loads and not match.lower
        return g.hit_tokens(num_local, start, hit.end), not match.sync

    def _being_written(self, keys: list[bytes], end: int, num_tokens: int) -> bool:
        """The hit run ends at `keys[end]` because another job is writing it to the host tier,
        and the request could use it (the prompt's last token is always computed)."""
        if end >= min(len(keys), self.geometry.max_hit_blocks(num_tokens)):
            return False
        return self.manager.contains(keys[end]) and not self.manager.lookup(keys[end:end + 1])

    def admit(self, request: RequestView) -> Match | None:
        """update_state_after_alloc: the request's latest match, its lookups counted (once per
        admission: matches may be retried)."""
        match = self._matches.pop(request.request_id, None)
        if match is not None:
            self.counters.num_queried_tokens += max(0, request.num_tokens - match.num_local)
            self.counters.num_limited_hits += match.limited
            if match.asked:
                self.manager.count_admission(match.asked, len(match.host_keys))
        return match

    def plan_load(self, st: ReqState, match: Match, num_external: int) -> LoadJob:
        """The load job of an admitted hit of `num_external` tokens into the request's blocks."""
        assert st.request is not None, "a load for a request that is gone"
        rid, g = st.request.request_id, self.geometry
        split = self._split_by_tier(match, num_external)
        self.counters.num_host_hit_tokens += split.get(HOST, 0)
        self.counters.num_disk_hit_tokens += split.get(DISK, 0)
        self.counters.num_redis_hit_tokens += split.get(REDIS, 0)
        self._hit_split[rid] = split
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
                self._describe_promoted(st.request, match)  # type: ignore[arg-type]
            elif out is not None:  # not expected (keys being written end the hit run)
                self.manager.complete_store(out.keys_to_store, success=False)
        if match.dst is not None:  # several groups: each key's block, in its group's table
            blocks = [st.tables[grp][i] for grp, i in match.dst]
            loadable = len(match.host_keys) + len(job.promoted)
            dst, unloadable, skip = blocks[:loadable], blocks[loadable:], 0
        else:
            loadable_end = match.start + len(match.host_keys) + len(job.promoted)
            table = st.tables[0]
            dst = table[g.hit_blocks(match.num_local, match.start, loadable_end)]
            unloadable = table[g.hit_blocks(match.num_local, loadable_end, match.end)]
            skip = g.skip(match.num_local, match.start) if dst else 0
        load = LoadJob(self.jobs.add(job), rid, HostBlocks(slots), EngineBlocks(dst, skip),
                       promotions, unloadable=unloadable, sync=match.sync)
        self.counters.num_load_jobs += 1
        self.counters.num_sync_loads += match.sync
        return load

    def _describe_promoted(self, request: RequestView, match: Match) -> None:
        """The promoted keys will be stored in host memory: what each holds (KV events)."""
        first = len(match.host_keys)
        for j, (key, _) in enumerate(match.lower):
            if match.dst is not None:
                self.events.describe(request, key, *match.dst[first + j])
            else:
                self.events.describe(request, key, 0, match.start + first + j)

    def _split_by_tier(self, match: Match, num_external: int) -> dict[str, int]:
        """The hit's first `num_external` tokens per tier they come from (HOST, DISK, REDIS), in
        token order. The local hit may end inside the run's first offload block: those tokens
        are the engine's own."""
        sources = match.media or ([HOST] * len(match.host_keys)
                                  + [medium for _, medium in match.lower])
        split: dict[str, int] = {}
        left = num_external
        for j, medium in enumerate(sources):
            tokens = min(left, self.geometry.offload_tokens if j else
                         self.geometry.hit_tokens(match.num_local, match.start, match.start + 1))
            split[medium] = split.get(medium, 0) + tokens
            left -= tokens
        return split

    def hit_split(self, req_id: str) -> dict[str, int]:
        """Tokens of the request's latest hit per tier, left for take_hit_split."""
        return dict(self._hit_split.get(req_id, {}))

    def take_hit_split(self, req_id: str) -> dict[str, int]:
        """Tokens of the request's latest hit per tier (HOST, DISK, REDIS): for engines that
        report hits by source (vLLM)."""
        return self._hit_split.pop(req_id, {})

    def forget(self, req_id: str) -> None:
        """The request finished: drop what was kept for it."""
        self._matches.pop(req_id, None)
        self._hit_split.pop(req_id, None)

    def room(self) -> int:
        """Host slots that are free or could be freed (not pinned, not being written)."""
        return (self.geometry.num_slots - self.manager.num_pinned
                - self.manager.num_being_written)


def hashes_ok(request: RequestView, block_size: int) -> bool:
    """One hash per full engine block: key i then names exactly the prefix stored under it."""
    return len(request.block_hashes) == request.num_tokens // block_size


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
