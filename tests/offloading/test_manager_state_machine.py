"""Random call sequences against LRUManager, ARCManager and an LRUManager with admission control,
checked against a simple model after every step (invariants F 29-35 of the vLLM connector
notes)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvport.connectors.offloading.manager.admission import AdmitAfterRequests
from kvport.connectors.offloading.manager.arc import ARCManager
from kvport.connectors.offloading.manager.lru import LRUManager
from kvport.connectors.offloading.manager.abstract import OffloadingManager

NUM_BLOCKS = 4
KEYS = st.integers(min_value=0, max_value=7)
KEY_LISTS = st.lists(KEYS, max_size=5)
MEDIUM = "CPU"


class ManagerMachine(RuleBasedStateMachine):
    """The model: ready keys with their pin counts, keys being written, every key's slot, the LRU
    order (checked exactly for LRU only) and the events not yet taken."""

    is_lru = False
    store_threshold = 0

    def make_manager(self) -> OffloadingManager:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.manager = self.make_manager()
        self.pins: dict[int, int] = {}  # ready key -> pin count
        self.writing: set[int] = set()  # keys being written
        self.slots: dict[int, int] = {}  # present key -> slot id
        self.order: list[int] = []  # present keys, least recently used first
        self.loads: list[list[int]] = []  # prepare_load arguments not yet completed
        self.stores: list[list[int]] = []  # keys_to_store not yet completed
        self.events: list[tuple[tuple[int, ...], bool]] = []  # (keys, removed), not yet taken
        self.num_seen: dict[int, int] = {}  # key -> admissions (count_admission) that named it
        self.num_lookups = 0  # count_admission calls
        self.num_hit_blocks = 0

    # ----- rules -----
    @rule(keys=KEY_LISTS)
    def lookup(self, keys: list[int]) -> None:
        expected = 0
        for key in keys:
            if key not in self.pins:
                break
            expected += 1
        assert self.manager.lookup(keys) == expected  # 29: leading run of ready keys only

    @rule(keys=KEY_LISTS, num_hits=st.integers(0, 5))
    def count_admission(self, keys: list[int], num_hits: int) -> None:
        for key in set(keys):
            self.num_seen[key] = self.num_seen.get(key, 0) + 1
        self.num_lookups += 1
        self.num_hit_blocks += num_hits
        self.manager.count_admission(keys, num_hits)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.pins)), min_size=1, max_size=3))
        assert self.manager.prepare_load(keys) == [self.slots[key] for key in keys]
        for key in keys:
            self.pins[key] += 1
        self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.manager.complete_load(keys)
        for key in keys:
            self.pins[key] -= 1

    @rule(keys=KEY_LISTS, bypass=st.booleans())
    def prepare_store(self, keys: list[int], bypass: bool) -> None:
        named = list(dict.fromkeys(keys))
        present = set(self.pins) | self.writing
        new = [key for key in named if key not in present
               and (bypass or self.store_threshold <= 1
                    or self.num_seen.get(key, 0) >= self.store_threshold)]
        evictable = [key for key in self.order if self.pins.get(key) == 0 and key not in named]
        num_free = NUM_BLOCKS - len(present)
        before = self.manager_state()
        output = self.manager.prepare_store(keys, bypass_admission=bypass)
        if len(new) - num_free > len(evictable):  # 31
            assert output is None
            assert self.manager_state() == before
            self.take_events()  # and no event
            return
        assert output is not None
        assert output.keys_to_store == new
        assert output.deferred_keys == [k for k in named if k not in present and k not in new]
        assert len(output.evicted_keys) == max(0, len(new) - num_free)
        assert set(output.evicted_keys) <= set(evictable)  # 30
        if self.is_lru:  # 34: the least recently used evictable blocks, oldest first
            assert output.evicted_keys == evictable[:len(output.evicted_keys)]
        for key in output.evicted_keys:
            self.forget(key)
        if output.evicted_keys:
            self.events.append((tuple(output.evicted_keys), True))
        assert len(set(output.slot_ids)) == len(new)  # 35: fresh slots, owned by nobody
        assert not set(output.slot_ids) & set(self.slots.values())
        for key, slot_id in zip(new, output.slot_ids):
            self.writing.add(key)
            self.slots[key] = slot_id
            self.order.append(key)
        if new:
            self.stores.append(new)

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans(), extra=KEY_LISTS)
    def complete_store(self, data: st.DataObject, success: bool, extra: list[int]) -> None:
        keys = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1))) + extra
        done = [key for key in dict.fromkeys(keys) if key in self.writing]
        self.manager.complete_store(keys, success)
        for key in done:
            self.writing.discard(key)
            if success:
                self.pins[key] = 0
            else:  # 32: only blocks being written go
                del self.slots[key]
                self.order.remove(key)
        if success and done:
            self.events.append((tuple(done), False))  # 33

    @rule(keys=KEY_LISTS)
    def touch(self, keys: list[int]) -> None:
        self.manager.touch(keys)
        for key in reversed(list(dict.fromkeys(keys))):
            if key in self.slots:
                self.order.remove(key)
                self.order.append(key)

    @rule()
    def take_events(self) -> None:
        events = self.manager.take_events()
        assert [(event.keys, event.removed) for event in events] == self.events
        assert all(event.medium == MEDIUM for event in events)
        self.events.clear()

    @rule()
    def reset(self) -> None:
        expected = not self.writing and not any(self.pins.values())
        before = self.manager_state()
        assert self.manager.reset() == expected
        if not expected:
            assert self.manager_state() == before
            self.take_events()  # and no event
            return
        if self.pins:
            events = self.manager.take_events()
            assert events[-1].removed and set(events[-1].keys) == set(self.pins)
            assert [(event.keys, event.removed) for event in events[:-1]] == self.events
            self.events.clear()
        for key in list(self.pins):
            self.forget(key)

    # ----- model helpers -----
    def forget(self, key: int) -> None:
        del self.pins[key]
        del self.slots[key]
        self.order.remove(key)

    def manager_state(self) -> tuple:
        manager = self.manager
        policy = (manager.t1_keys, manager.t2_keys, manager.b1_keys, manager.b2_keys,
                  manager.target_t1_size) if isinstance(manager, ARCManager) else ()
        return (manager.num_free_slots, manager.num_pinned, manager.num_being_written,
                [manager.contains(key) for key in range(8)], policy)

    # ----- invariants -----
    @invariant()
    def matches_model(self) -> None:
        manager = self.manager
        manager.check_integrity()
        assert manager.num_free_slots == NUM_BLOCKS - len(self.pins) - len(self.writing)
        assert manager.num_pinned == sum(count > 0 for count in self.pins.values())
        assert manager.num_being_written == len(self.writing)
        for key in range(8):
            assert manager.contains(key) == (key in self.pins or key in self.writing)
        assert len(set(self.slots.values())) == len(self.slots)
        assert (manager.stats.num_lookups, manager.stats.num_hit_blocks) == (
            self.num_lookups, self.num_hit_blocks)
        if self.is_lru:
            assert isinstance(manager, LRUManager)
            assert manager.keys_by_age == self.order

    def teardown(self) -> None:
        for keys in self.loads:
            self.manager.complete_load(keys)
        for keys in self.stores:
            self.manager.complete_store(keys)
        # nothing leaked
        assert self.manager.num_pinned == 0
        assert self.manager.num_being_written == 0
        self.manager.check_integrity()


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
                    database=None)


class LRUMachine(ManagerMachine):
    is_lru = True

    def make_manager(self) -> OffloadingManager:
        return LRUManager(NUM_BLOCKS, MEDIUM)


class ARCMachine(ManagerMachine):
    def make_manager(self) -> OffloadingManager:
        return ARCManager(NUM_BLOCKS, MEDIUM)


class AdmissionLRUMachine(ManagerMachine):
    is_lru = True
    store_threshold = 2

    def make_manager(self) -> OffloadingManager:
        return LRUManager(NUM_BLOCKS, MEDIUM, AdmitAfterRequests(self.store_threshold))


TestLRUManagerStateMachine = LRUMachine.TestCase
TestLRUManagerStateMachine.settings = SETTINGS
TestARCManagerStateMachine = ARCMachine.TestCase
TestARCManagerStateMachine.settings = SETTINGS
TestAdmissionStateMachine = AdmissionLRUMachine.TestCase
TestAdmissionStateMachine.settings = SETTINGS
