"""ARCManager: narrated scenarios on a 4-block tier with integer keys."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvport.connectors.offloading.manager.arc import ARCManager
from manager_checks import (
    MEDIUM, ExpectedEvent, ExpectedPrepareStoreOutput, verify_events, verify_store_output,
)

from kvport.connectors.offloading.manager.abstract import PrepareStoreOutput



@dataclass
class ExpectedARCState:
    t1: list[int]  # oldest first
    t2: list[int]
    b1: list[int]
    b2: list[int]
    target: int


def verify_state(manager: ARCManager, expected: ExpectedARCState) -> None:
    actual = ExpectedARCState(manager.t1_keys, manager.t2_keys, manager.b1_keys, manager.b2_keys,
                              manager.target_t1_size)
    assert actual == expected
    manager.check_integrity()


def store(manager: ARCManager, keys: list[int]) -> PrepareStoreOutput:
    """prepare_store + complete_store(success) of keys that must fit."""
    output = manager.prepare_store(keys)
    assert output is not None, f"prepare_store({keys}) returned None"
    manager.complete_store(output.keys_to_store)
    return output


def snapshot(manager: ARCManager) -> tuple:
    return (manager.t1_keys, manager.t2_keys, manager.b1_keys, manager.b2_keys,
            manager.target_t1_size, manager.num_free_slots, manager.num_pinned,
            manager.num_being_written)


def test_arc_scenario() -> None:
    manager = ARCManager(4, MEDIUM)

    # prepare store [1, 2] -> slots [0, 1], both enter T1
    verify_store_output(manager.prepare_store([1, 2]),
                        ExpectedPrepareStoreOutput([1, 2], [0, 1], []))
    # touch [1] while being written -> not an access: 1 only moves to T1's end
    manager.touch([1])
    verify_state(manager, ExpectedARCState(t1=[2, 1], t2=[], b1=[], b2=[], target=0))

    # complete store [1, 2]; touch [1] -> ready in T1: promoted to T2
    manager.complete_store([1, 2])
    manager.touch([1])
    verify_state(manager, ExpectedARCState(t1=[2], t2=[1], b1=[], b2=[], target=0))
    # touch [1] again -> stays in T2
    manager.touch([1])
    verify_state(manager, ExpectedARCState(t1=[2], t2=[1], b1=[], b2=[], target=0))

    # store [3, 4] -> the tier is full
    store(manager, [3, 4])
    verify_events(manager, [ExpectedEvent((1, 2), False), ExpectedEvent((3, 4), False)])

    # prepare store [5] -> |T1| = 3 >= target 0: evicts T1's oldest, 2, into B1
    verify_store_output(manager.prepare_store([5]), ExpectedPrepareStoreOutput([5], [1], [2]))
    manager.complete_store([5])
    verify_state(manager, ExpectedARCState(t1=[3, 4, 5], t2=[1], b1=[2], b2=[], target=0))

    # prepare store [2] -> B1 hit: target += max(1, 0 // 1) = 1; |T1| = 3 >= 1: evicts 3
    verify_store_output(manager.prepare_store([2]), ExpectedPrepareStoreOutput([2], [2], [3]))
    verify_state(manager, ExpectedARCState(t1=[4, 5, 2], t2=[1], b1=[3], b2=[], target=1))

    # failed complete store [2] -> dropped without becoming a ghost
    manager.complete_store([2], success=False)
    verify_state(manager, ExpectedARCState(t1=[4, 5], t2=[1], b1=[3], b2=[], target=1))
    verify_events(manager, [ExpectedEvent((2,), True), ExpectedEvent((5,), False),
                            ExpectedEvent((3,), True)])
    assert manager.num_free_slots == 1
    assert manager.num_pinned == manager.num_being_written == 0


def test_victim_side_follows_the_target() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2, 3, 4])
    # touch [1, 2, 3] -> T2 = [3, 2, 1] (1 the most recent)
    manager.touch([1, 2, 3])
    verify_state(manager, ExpectedARCState(t1=[4], t2=[3, 2, 1], b1=[], b2=[], target=0))

    # store [5] -> |T1| = 1 >= 0: evicts 4 from T1
    assert store(manager, [5]).evicted_keys == [4]
    # store [4] -> B1 hit, target 1; |T1| = 1 >= 1: still T1, evicts 5
    assert store(manager, [4]).evicted_keys == [5]
    verify_state(manager, ExpectedARCState(t1=[4], t2=[3, 2, 1], b1=[5], b2=[], target=1))

    # store [5] -> B1 hit, target 2; |T1| = 1 < 2: evicts T2's oldest, 3, into B2
    assert store(manager, [5]).evicted_keys == [3]
    verify_state(manager, ExpectedARCState(t1=[4, 5], t2=[2, 1], b1=[], b2=[3], target=2))

    # store [6] -> |T1| = 2 >= 2: back to T1, evicts 4
    assert store(manager, [6]).evicted_keys == [4]

    # store [3] -> B2 hit: target -= max(1, |B1| 1 // |B2| 1) = 1; |T1| = 2 >= 1: evicts 5
    assert store(manager, [3]).evicted_keys == [5]
    verify_state(manager, ExpectedARCState(t1=[6, 3], t2=[2, 1], b1=[4, 5], b2=[], target=1))


def test_ghost_hits_step_by_ghost_list_ratio() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2, 3, 4])
    manager.touch([1, 2, 3, 4])  # T2 = [4, 3, 2, 1]
    # store [5] -> T1 empty: falls back to T2, evicts 4
    assert store(manager, [5]).evicted_keys == [4]
    # 5 pinned; store [6] -> T1 has nothing evictable: T2 again, evicts 3
    manager.prepare_load([5])
    assert store(manager, [6]).evicted_keys == [3]
    manager.complete_load([5])
    # store [7] -> T1's oldest, 5, goes to B1
    assert store(manager, [7]).evicted_keys == [5]
    verify_state(manager, ExpectedARCState(t1=[6, 7], t2=[2, 1], b1=[5], b2=[4, 3], target=0))

    # store [5] -> B1 hit: target += max(1, |B2| 2 // |B1| 1) = 2; |T1| = 2 >= 2: evicts 6
    assert store(manager, [5]).evicted_keys == [6]
    verify_state(manager, ExpectedARCState(t1=[7, 5], t2=[2, 1], b1=[6], b2=[4, 3], target=2))

    # store [4, 3] -> two B2 hits, in order: 2 - max(1, 1 // 2) = 1, then 1 - max(1, 1 // 1) = 0;
    # |T1| = 2 >= 0: evicts 7 and 5 from T1
    assert store(manager, [4, 3]).evicted_keys == [7, 5]
    verify_state(manager, ExpectedARCState(t1=[4, 3], t2=[2, 1], b1=[6, 7, 5], b2=[], target=0))


def test_target_stays_within_capacity() -> None:
    manager = ARCManager(2, MEDIUM)
    for key in range(1, 30):
        store(manager, [key])
        store(manager, [key - 1])  # a B1 hit each time after the first rounds
        assert 0 <= manager.target_t1_size <= 2
    assert manager.target_t1_size == 2


def test_ghost_lists_stay_within_capacity() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2, 3, 4])
    # store [5] .. [12] one by one -> each evicts T1's oldest; B1 keeps the last 4
    for key in range(5, 13):
        store(manager, [key])
    verify_state(manager, ExpectedARCState(t1=[9, 10, 11, 12], t2=[], b1=[5, 6, 7, 8], b2=[],
                                           target=0))
    # the same through T2: T1 stays empty, so every store evicts T2's oldest into B2
    manager.touch([12, 11, 10, 9])  # T2 = [9, 10, 11, 12]
    for key in range(13, 21):
        store(manager, [key])
        manager.touch([key])
    verify_state(manager, ExpectedARCState(t1=[], t2=[17, 18, 19, 20], b1=[5, 6, 7, 8],
                                           b2=[13, 14, 15, 16], target=0))


def test_pinned_and_being_written_blocks_are_kept() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2])
    manager.prepare_store([3])  # being written
    store(manager, [4])
    manager.prepare_load([1])  # pinned
    # prepare store [5, 6] -> only 2 and 4 can go
    verify_store_output(manager.prepare_store([5, 6]),
                        ExpectedPrepareStoreOutput([5, 6], [1, 3], [2, 4]))
    # nothing evictable: prepare store [7] -> None
    assert manager.prepare_store([7]) is None
    manager.complete_load([1])
    manager.complete_store([3, 5, 6])
    assert store(manager, [7]).evicted_keys == [1]


def test_named_block_is_never_its_own_victim() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2, 3, 4])
    # prepare store [1, 5] -> 1 is T1's oldest but named: evicts [2]
    verify_store_output(manager.prepare_store([1, 5]), ExpectedPrepareStoreOutput([5], [1], [2]))


def test_prepare_store_that_cannot_fit_changes_nothing() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2, 3, 4])
    store(manager, [5])  # 1 -> B1
    manager.take_events()
    manager.prepare_load([2, 3, 4, 5])
    # prepare store [1] -> None: its B1 hit must not move the target, nor leave B1
    before = snapshot(manager)
    assert manager.prepare_store([1]) is None
    assert snapshot(manager) == before
    assert manager.take_events() == []
    # prepare store of present keys only -> an empty output, not None
    verify_store_output(manager.prepare_store([2, 5]), ExpectedPrepareStoreOutput([], [], []))


def test_touch_ignores_ghosts_and_unknown_keys() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2, 3, 4])
    store(manager, [5])  # 1 -> B1
    manager.touch([1, 9])
    verify_state(manager, ExpectedARCState(t1=[2, 3, 4, 5], t2=[], b1=[1], b2=[], target=0))


def test_reset_clears_ghosts_and_target() -> None:
    manager = ARCManager(4, MEDIUM)
    store(manager, [1, 2, 3, 4])
    store(manager, [5])
    store(manager, [1])
    manager.touch([5])
    manager.take_events()
    assert manager.reset()
    verify_state(manager, ExpectedARCState(t1=[], t2=[], b1=[], b2=[], target=0))
    verify_events(manager, [ExpectedEvent((3, 4, 1, 5), True)])
    assert manager.num_free_slots == 4


def test_constructor_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        ARCManager(0, MEDIUM)
    with pytest.raises(ValueError, match="medium"):
        ARCManager(4, "")
