"""Bookkeeping shared by the eviction policies: block states, slot ids, and the primitives of
OffloadingManager implemented once over a small set of policy hooks (LRU and ARC supply them).
Admission control is a strategy the manager consults in prepare_store (see admission)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from kvport.connectors.offloading.manager.admission import AdmissionPolicy, AdmitAll
from kvport.connectors.offloading.manager.abstract import (
    BlockKey, OffloadingEvent, OffloadingManager, ManagerCounters, PrepareStoreOutput,
)


@dataclass(slots=True)
class BlockStatus:
    slot_id: int
    ref_cnt: int = -1  # -1: being written; >= 0: ready, with that many readers

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class SlotAllocator:
    """Slot ids 0..num_slots-1: fresh ids in order first, then freed ids last-freed-first.

    A store's slots are taken together (`allocate_many`) and handed out in ascending order: the
    fresh ones are consecutive, and freed ones mostly come back in runs (eviction frees the
    oldest store's slots together). A job whose slots are consecutive is one gather (store) or
    one scatter (load) in the host tier, however small its engine blocks are.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._num_fresh_used = 0  # ids below this have been handed out at least once
        self._free_ids: list[int] = []  # freed ids; the end is reused first

    @property
    def num_free(self) -> int:
        return self.num_slots - self._num_fresh_used + len(self._free_ids)

    def allocate_many(self, n: int) -> list[int]:
        """`n` slot ids, ascending (see the class note)."""
        assert n <= self.num_free, f"{n} slots asked, {self.num_free} free"
        num_fresh = min(n, self.num_slots - self._num_fresh_used)
        ids = list(range(self._num_fresh_used, self._num_fresh_used + num_fresh))
        self._num_fresh_used += num_fresh
        if n > num_fresh:
            taken = n - num_fresh
            ids += self._free_ids[-taken:]
            del self._free_ids[-taken:]
        return sorted(ids)

    def free(self, slot_id: int) -> None:
        assert 0 <= slot_id < self._num_fresh_used, f"slot {slot_id} was never handed out"
        self._free_ids.append(slot_id)

    def free_ids(self) -> list[int]:
        return list(range(self._num_fresh_used, self.num_slots)) + self._free_ids

    def reset(self) -> None:
        self._num_fresh_used = 0
        self._free_ids.clear()


class PolicyManager(OffloadingManager):
    """The bookkeeping LRUManager and ARCManager share; a subclass orders the blocks and picks
    victims through the `_find/_blocks/_insert/_remove/_promote/_select_victims` hooks."""

    def __init__(self, num_blocks: int, medium: str,
                 admission: AdmissionPolicy | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if not isinstance(medium, str) or not medium:
            raise ValueError(f"medium must be a non-empty string, got {medium!r}")
        self._medium = medium
        self.admission = admission if admission is not None else AdmitAll()
        self._slots = SlotAllocator(num_blocks)
        self._events: list[OffloadingEvent] = []
        self._stats = ManagerCounters()
        self._num_being_written = 0  # blocks with ref_cnt == -1
        self._num_pinned = 0  # blocks with ref_cnt > 0

    # ----- policy hooks -----
    @abstractmethod
    def _find(self, key: BlockKey) -> BlockStatus | None:
        """Called by every primitive that names keys: the key's block (ready or being written),
        or None when the key is not present. A pure read: it must not count as an access (only
        _promote records one), since lookup and prepare_load are not touches."""

    @abstractmethod
    def _blocks(self) -> Iterator[tuple[BlockKey, BlockStatus]]:
        """Called by reset, _clear and check_integrity: every present key with its block, each
        once, in the policy's own order (reset reports the removed keys in it). A pure read;
        callers that remove blocks take the whole list first."""

    @abstractmethod
    def _insert(self, key: BlockKey, block: BlockStatus) -> None:
        """Adds a new (being written) block as the most recent."""

    @abstractmethod
    def _remove(self, key: BlockKey, evicted: bool) -> BlockStatus:
        """Takes a block out; `evicted` tells an eviction from a failed store or a reset."""

    @abstractmethod
    def _promote(self, key: BlockKey, block: BlockStatus) -> None:
        """One access of a present block (touch)."""

    @abstractmethod
    def _select_victims(self, num: int, protected: set[BlockKey]) -> list[BlockKey]:
        """Exactly `num` keys of ready, unpinned blocks outside `protected`, in eviction order.
        The caller has checked that enough exist; nothing is removed yet."""

    def _on_store(self, new_keys: list[BlockKey]) -> None:
        """Called once prepare_store is known to succeed, before victims are chosen."""

    def _clear(self) -> None:
        for key, _ in list(self._blocks()):
            self._remove(key, evicted=False)

    def _check_policy(self) -> list[str]:
        return []

    # ----- primitives -----
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        num_hits = 0
        for key in keys:
            block = self._find(key)
            if block is None or not block.is_ready:
                break
            num_hits += 1
        return num_hits

    def count_admission(self, keys: Sequence[BlockKey], num_hits: int) -> None:
        self._stats.num_lookups += 1
        self._stats.num_hit_blocks += num_hits
        self.admission.on_request(keys)

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        blocks = [self._find(key) for key in keys]
        for key, block in zip(keys, blocks):
            assert block is not None and block.is_ready, f"prepare_load: key {key!r} is not ready"
        for block in blocks:
            assert block is not None
            if block.ref_cnt == 0:
                self._num_pinned += 1
            block.ref_cnt += 1
        return [block.slot_id for block in blocks if block is not None]

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            block = self._find(key)
            assert block is not None and block.ref_cnt > 0, f"complete_load: {key!r} not pinned"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_pinned -= 1

    def touch(self, keys: Sequence[BlockKey]) -> None:
        # NOTE: reversed, so that keys[0] is promoted last and ends up the most recent.
        for key in reversed(list(dict.fromkeys(keys))):
            block = self._find(key)
            if block is not None:
                self._promote(key, block)

    def prepare_store(self, keys: Sequence[BlockKey], *,
                      bypass_admission: bool = False) -> PrepareStoreOutput | None:
        new_keys: list[BlockKey] = []
        deferred: list[BlockKey] = []  # new, but not admitted (yet)
        protected: set[BlockKey] = set()  # present, evictable, but named in this call
        for key in dict.fromkeys(keys):
            block = self._find(key)
            if block is None and (bypass_admission or self.admission.admits(key)):
                new_keys.append(key)
            elif block is None:
                deferred.append(key)
            elif block.ref_cnt == 0:
                protected.add(key)
        num_to_evict = len(new_keys) - self._slots.num_free
        num_evictable = (self.num_blocks - self._slots.num_free - self._num_being_written
                         - self._num_pinned - len(protected))
        if num_to_evict > num_evictable:
            self._stats.num_rejected_stores += 1
            return None
        self._on_store(new_keys)
        evicted = self._select_victims(num_to_evict, protected) if num_to_evict > 0 else []
        assert len(evicted) == max(0, num_to_evict), f"{len(evicted)} victims for {num_to_evict}"
        for key in evicted:
            self._slots.free(self._remove(key, evicted=True).slot_id)
        if evicted:
            self._events.append(OffloadingEvent(tuple(evicted), self._medium, removed=True))
            self._stats.num_evicted_blocks += len(evicted)
        slot_ids = self._slots.allocate_many(len(new_keys))
        for key, slot_id in zip(new_keys, slot_ids, strict=True):
            self._insert(key, BlockStatus(slot_id))
        self._num_being_written += len(new_keys)
        self._stats.num_deferred_blocks += len(deferred)
        return PrepareStoreOutput(new_keys, slot_ids, evicted, deferred)

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        done = []
        for key in dict.fromkeys(keys):
            block = self._find(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_cnt = 0
            else:
                self._slots.free(self._remove(key, evicted=False).slot_id)
            done.append(key)
        self._num_being_written -= len(done)
        if success and done:
            self._events.append(OffloadingEvent(tuple(done), self._medium, removed=False))
            self._stats.num_stored_blocks += len(done)
        elif not success:
            self._stats.num_failed_blocks += len(done)

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def contains(self, key: BlockKey) -> bool:
        return self._find(key) is not None

    def reset(self) -> bool:
        if self._num_pinned or self._num_being_written:
            return False
        keys = [key for key, _ in self._blocks()]
        self._clear()
        self._slots.reset()
        if keys:
            self._events.append(OffloadingEvent(tuple(keys), self._medium, removed=True))
        return True

    def check_integrity(self) -> None:
        owned = [block.slot_id for _, block in self._blocks()]
        free = self._slots.free_ids()
        refs = [block.ref_cnt for _, block in self._blocks()]
        problems = self._check_policy() + self.admission.check()
        if len(owned) + len(free) != self.num_blocks:
            problems.append(f"{len(owned)} owned + {len(free)} free != {self.num_blocks} slots")
        if len(set(owned) | set(free)) != len(owned) + len(free):
            problems.append(f"slot ids owned twice or both owned and free: {sorted(owned + free)}")
        if any(not 0 <= slot_id < self.num_blocks for slot_id in owned + free):
            problems.append(f"slot ids out of [0, {self.num_blocks}): {sorted(owned + free)}")
        if any(ref < -1 for ref in refs):
            problems.append(f"ref_cnt below -1: {sorted(refs)}")
        if refs.count(-1) != self._num_being_written:
            problems.append(f"{refs.count(-1)} blocks being written, counter says "
                            f"{self._num_being_written}")
        if sum(ref > 0 for ref in refs) != self._num_pinned:
            problems.append(f"{sum(ref > 0 for ref in refs)} blocks pinned, counter says "
                            f"{self._num_pinned}")
        if problems:
            raise RuntimeError(f"{type(self).__name__} integrity: " + "; ".join(problems))

    @property
    def medium(self) -> str:
        return self._medium

    @property
    def num_blocks(self) -> int:
        return self._slots.num_slots

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_being_written(self) -> int:
        return self._num_being_written

    @property
    def stats(self) -> ManagerCounters:
        return replace(self._stats)
