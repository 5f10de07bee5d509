"""LRUManager and its admission strategies: narrated scenarios on a 4-block tier with integer
keys."""

from __future__ import annotations


import pytest

from kvport.connectors.offloading.manager.admission import AdmitAfterRequests
from kvport.connectors.offloading.manager.lru import LRUManager
from manager_checks import (
    MEDIUM, ExpectedEvent, ExpectedPrepareStoreOutput, verify_events, verify_nothing_leaked,
    verify_store_output,
)




def stored(keys: list[int], num_blocks: int = 4) -> LRUManager:
    """An LRU tier holding `keys` as ready blocks, stored in one call, events drained."""
    manager = LRUManager(num_blocks, MEDIUM)
    assert manager.prepare_store(keys) is not None
    manager.complete_store(keys)
    manager.take_events()
    return manager


def snapshot(manager: LRUManager) -> tuple:
    blocks = [(key, manager.lookup([key]), manager.contains(key)) for key in manager.keys_by_age]
    return manager.keys_by_age, blocks, manager.num_free_slots, manager.num_pinned, \
        manager.num_being_written


def test_lru_scenario() -> None:
    manager = LRUManager(4, MEDIUM)

    # prepare store [1, 2] -> slots [0, 1]; not ready yet, so lookup misses
    verify_store_output(manager.prepare_store([1, 2]),
                        ExpectedPrepareStoreOutput([1, 2], [0, 1], []))
    assert manager.lookup([1, 2]) == 0
    assert manager.num_being_written == 2
    verify_events(manager, [])

    # complete store [1, 2] -> one stored event
    manager.complete_store([1, 2])
    assert manager.lookup([1, 2, 3]) == 2
    verify_events(manager, [ExpectedEvent((1, 2), removed=False)])

    # prepare store [2, 3, 4, 5] -> 2 is present; stores [3, 4, 5] at [0, 2, 3] (1's freed slot
    # and two fresh ones, ascending), evicts [1]
    verify_store_output(manager.prepare_store([2, 3, 4, 5]),
                        ExpectedPrepareStoreOutput([3, 4, 5], [0, 2, 3], [1]))
    verify_events(manager, [ExpectedEvent((1,), removed=True)])
    # lookup stops at 3, which is being written
    assert manager.lookup([2, 3, 4]) == 1

    # prepare store [1, 6] -> None: only 2 is evictable; nothing changes, no event
    before = snapshot(manager)
    assert manager.prepare_store([1, 6]) is None
    assert snapshot(manager) == before
    verify_events(manager, [])

    # complete store [3, 4, 5]
    manager.complete_store([3, 4, 5])
    verify_events(manager, [ExpectedEvent((3, 4, 5), removed=False)])
    assert manager.keys_by_age == [2, 3, 4, 5]

    # prepare load [2, 3] -> slots [1, 0], pinned: prepare store [6, 7, 8] -> None
    assert manager.prepare_load([2, 3]) == [1, 0]
    assert manager.num_pinned == 2
    assert manager.prepare_store([6, 7, 8]) is None

    # complete load [2, 3]; prepare store [6, 7, 8] -> evicts [2, 3, 4], the oldest;
    # their slots 1, 0, 2 are reused in ascending order
    manager.complete_load([2, 3])
    verify_store_output(manager.prepare_store([6, 7, 8]),
                        ExpectedPrepareStoreOutput([6, 7, 8], [0, 1, 2], [2, 3, 4]))
    manager.complete_store([6, 7, 8])
    verify_events(manager, [ExpectedEvent((2, 3, 4), removed=True),
                            ExpectedEvent((6, 7, 8), removed=False)])

    # touch [5, 6, 7] -> 5 most recent, 8 the oldest
    manager.touch([5, 6, 7])
    assert manager.keys_by_age == [8, 7, 6, 5]

    # prepare store [9] -> evicts [8], reuses its slot 2
    verify_store_output(manager.prepare_store([9]), ExpectedPrepareStoreOutput([9], [2], [8]))

    # complete store [7, 9] failed -> 9 (being written) is dropped, 7 (ready) survives
    manager.complete_store([7, 9], success=False)
    assert manager.lookup([7]) == 1
    assert not manager.contains(9)
    assert manager.num_free_slots == 1
    verify_events(manager, [ExpectedEvent((8,), removed=True)])

    # the freed slot 2 is the next one handed out
    verify_store_output(manager.prepare_store([10]), ExpectedPrepareStoreOutput([10], [2], []))
    manager.complete_store([10])
    verify_events(manager, [ExpectedEvent((10,), removed=False)])
    verify_nothing_leaked(manager)


def test_named_block_is_never_its_own_victim() -> None:
    # 1 is the oldest, but prepare store [1, 5] names it -> evicts [2]
    manager = stored([1, 2, 3, 4])
    verify_store_output(manager.prepare_store([1, 5]), ExpectedPrepareStoreOutput([5], [1], [2]))
    assert manager.contains(1)


def test_named_blocks_count_against_the_room() -> None:
    # [1, 2, 3] ready, 4 pinned: prepare store [1, 2, 3, 5] -> None (nothing evictable)
    manager = stored([1, 2, 3, 4])
    manager.prepare_load([4])
    assert manager.prepare_store([1, 2, 3, 5]) is None
    # prepare store [1, 2, 5] -> evicts [3]
    verify_store_output(manager.prepare_store([1, 2, 5]), ExpectedPrepareStoreOutput([5], [2], [3]))


def test_blocks_being_written_are_kept() -> None:
    manager = stored([1, 2])
    # prepare store [3, 4] -> fills the tier; [5, 6] -> evicts the ready [1, 2] only
    manager.prepare_store([3, 4])
    verify_store_output(manager.prepare_store([5, 6]),
                        ExpectedPrepareStoreOutput([5, 6], [0, 1], [1, 2]))
    # everything is being written: prepare store [7] -> None
    assert manager.prepare_store([7]) is None
    assert manager.num_being_written == 4
    manager.complete_store([3, 4, 5, 6])
    verify_nothing_leaked(manager)


def test_prepare_store_of_present_keys_returns_empty_output() -> None:
    # all pinned or being written, but nothing new -> empty output, not None
    manager = stored([1, 2])
    manager.prepare_store([3, 4])
    manager.prepare_load([1, 2])
    verify_store_output(manager.prepare_store([4, 3, 2, 1]), ExpectedPrepareStoreOutput([], [], []))
    verify_store_output(manager.prepare_store([]), ExpectedPrepareStoreOutput([], [], []))


def test_prepare_store_larger_than_the_tier_returns_none() -> None:
    manager = LRUManager(4, MEDIUM)
    assert manager.prepare_store([1, 2, 3, 4, 5]) is None
    assert manager.num_free_slots == 4
    assert manager.stats.num_rejected_stores == 1
    verify_events(manager, [])


def test_duplicate_keys_are_stored_once() -> None:
    manager = LRUManager(4, MEDIUM)
    verify_store_output(manager.prepare_store([1, 1, 2]),
                        ExpectedPrepareStoreOutput([1, 2], [0, 1], []))
    manager.complete_store([1, 2, 1])
    verify_events(manager, [ExpectedEvent((1, 2), removed=False)])


def test_pin_counts_stack() -> None:
    # two readers of 1: it stays pinned until both complete
    manager = stored([1, 2, 3, 4])
    manager.prepare_load([1])
    manager.prepare_load([1, 2])
    manager.complete_load([1])
    verify_store_output(manager.prepare_store([5, 6]),
                        ExpectedPrepareStoreOutput([5, 6], [2, 3], [3, 4]))
    manager.complete_load([1, 2])
    manager.complete_store([5, 6])
    # 1 is the oldest evictable again
    verify_store_output(manager.prepare_store([7]), ExpectedPrepareStoreOutput([7], [0], [1]))


def test_load_protocol_misuse_asserts() -> None:
    manager = stored([1])
    manager.prepare_store([2])
    with pytest.raises(AssertionError, match="not ready"):
        manager.prepare_load([1, 2])  # 2 is being written
    with pytest.raises(AssertionError, match="not ready"):
        manager.prepare_load([3])  # unknown
    assert manager.num_pinned == 0, "a refused prepare_load pins nothing"
    with pytest.raises(AssertionError, match="not pinned"):
        manager.complete_load([1])


def test_complete_store_ignores_unknown_and_ready_keys() -> None:
    manager = stored([1])
    manager.complete_store([1, 7])
    manager.complete_store([1, 7], success=False)
    assert manager.lookup([1]) == 1
    verify_events(manager, [])
    assert manager.stats.num_failed_blocks == 0


def test_touch_order_and_unknown_keys() -> None:
    manager = stored([1, 2, 3, 4])
    # touch [3, 9, 1] -> 9 ignored; 3 ends up the most recent, then 1
    manager.touch([3, 9, 1])
    assert manager.keys_by_age == [2, 4, 1, 3]
    # prepare store [5, 6] -> evicts [2, 4]
    verify_store_output(manager.prepare_store([5, 6]),
                        ExpectedPrepareStoreOutput([5, 6], [1, 3], [2, 4]))


def test_reset() -> None:
    manager = stored([1, 2, 3])
    manager.prepare_load([1])
    assert not manager.reset(), "refused while a block is pinned"
    manager.complete_load([1])
    manager.prepare_store([4])
    assert not manager.reset(), "refused while a block is being written"
    assert manager.keys_by_age == [1, 2, 3, 4]
    manager.complete_store([4])
    manager.take_events()
    assert manager.reset()
    assert manager.keys_by_age == []
    assert manager.num_free_slots == 4
    verify_events(manager, [ExpectedEvent((1, 2, 3, 4), removed=True)])
    verify_store_output(manager.prepare_store([5]), ExpectedPrepareStoreOutput([5], [0], []))


def test_stats() -> None:
    manager = stored([1, 2, 3, 4])
    assert manager.lookup([1, 2, 9]) == 2
    assert manager.lookup([1, 2, 9]) == 2  # a retried match: lookups count nothing
    assert (manager.stats.num_lookups, manager.stats.num_hit_blocks) == (0, 0)
    manager.count_admission([1, 2, 9], 2)  # the request was admitted: counted once
    manager.prepare_store([5])
    manager.complete_store([5], success=False)
    stats = manager.stats
    assert (stats.num_lookups, stats.num_hit_blocks) == (1, 2)
    assert (stats.num_stored_blocks, stats.num_evicted_blocks, stats.num_failed_blocks) == (4, 1, 1)


def test_check_integrity_reports_a_corrupted_table() -> None:
    manager = stored([1, 2])
    manager.check_integrity()
    manager._table[2].slot_id = manager._table[1].slot_id  # two blocks, one slot
    with pytest.raises(RuntimeError, match="owned twice"):
        manager.check_integrity()


@pytest.mark.parametrize("num_blocks, medium", [(0, "CPU"), (-1, "CPU"), (2.0, "CPU"), (4, "")])
def test_constructor_rejects_bad_values(num_blocks: object, medium: str) -> None:
    with pytest.raises(ValueError, match=repr(num_blocks) if medium else "medium"):
        LRUManager(num_blocks, medium)  # type: ignore[arg-type]


# ----- admission control -----


def admitting_after(threshold: int, max_tracked: int = 64000,
                    ) -> tuple[LRUManager, AdmitAfterRequests]:
    admission = AdmitAfterRequests(threshold, max_tracked)
    return LRUManager(4, MEDIUM, admission), admission


def test_admission_after_2_requests() -> None:
    manager, admission = admitting_after(2)

    # a request matched twice (retried) and admitted once: lookups count nothing, the
    # admission counts each distinct key once
    assert manager.lookup([1, 2, 3]) == 0
    assert manager.lookup([1, 2, 3]) == 0
    assert [admission.num_requests_of(key) for key in (1, 2, 3)] == [0, 0, 0]
    manager.count_admission([1, 2, 3], 0)
    assert [admission.num_requests_of(key) for key in (1, 2, 3)] == [1, 1, 1]

    # prepare store [1, 2, 3] -> nothing admitted yet; all deferred, nothing changes
    verify_store_output(manager.prepare_store([1, 2, 3]),
                        ExpectedPrepareStoreOutput([], [], [], deferred_keys=[1, 2, 3]))
    assert manager.num_free_slots == 4

    # a second request asked for [1, 2, 2] -> 1 and 2 counted once more (once per request)
    manager.count_admission([1, 2, 2], 0)
    assert admission.num_requests_of(2) == 2

    # prepare store [1, 2, 3] -> stores [1, 2], defers [3]
    verify_store_output(manager.prepare_store([1, 2, 3]),
                        ExpectedPrepareStoreOutput([1, 2], [0, 1], [], deferred_keys=[3]))
    manager.complete_store([1, 2])
    verify_events(manager, [ExpectedEvent((1, 2), removed=False)])
    assert manager.lookup([1, 2, 3]) == 2
    manager.count_admission([1, 2, 3], 2)
    # 3 was asked for by two requests by now
    verify_store_output(manager.prepare_store([3]), ExpectedPrepareStoreOutput([3], [2], [], []))
    manager.complete_store([3])
    assert manager.stats.num_deferred_blocks == 4
    assert (manager.stats.num_lookups, manager.stats.num_hit_blocks) == (3, 2)
    verify_nothing_leaked(manager)


def test_promotions_bypass_admission() -> None:
    # 5 was never asked for, but a promotion of a hit from a lower tier is stored at once
    manager, admission = admitting_after(3)
    verify_store_output(manager.prepare_store([5, 6], bypass_admission=True),
                        ExpectedPrepareStoreOutput([5, 6], [0, 1], [], deferred_keys=[]))
    assert admission.num_requests_of(5) == 0
    manager.complete_store([5, 6])
    assert manager.stats.num_deferred_blocks == 0
    verify_nothing_leaked(manager)


def test_admission_passes_present_keys_so_they_are_not_victims() -> None:
    manager, _ = admitting_after(2)
    manager.prepare_store([1, 2, 3, 4], bypass_admission=True)
    manager.complete_store([1, 2, 3, 4])
    manager.count_admission([5], 0)
    manager.count_admission([5], 0)
    # 1 was never asked for, but it is present: it is named, not evicted
    verify_store_output(manager.prepare_store([1, 5]),
                        ExpectedPrepareStoreOutput([5], [1], [2], []))


def test_admission_none_when_the_admitted_keys_cannot_fit() -> None:
    manager, _ = admitting_after(2)
    manager.prepare_store([1, 2, 3, 4], bypass_admission=True)
    manager.complete_store([1, 2, 3, 4])
    manager.prepare_load([1, 2, 3, 4])
    manager.count_admission([5, 6], 0)
    manager.count_admission([5], 0)
    assert manager.prepare_store([5, 6]) is None
    assert manager.stats.num_deferred_blocks == 0


@pytest.mark.parametrize("threshold", [0, 1])
def test_low_threshold_admits_everything(threshold: int) -> None:
    manager, _ = admitting_after(threshold)
    verify_store_output(manager.prepare_store([1, 2]),
                        ExpectedPrepareStoreOutput([1, 2], [0, 1], [], deferred_keys=[]))


def test_admission_tracks_a_bounded_number_of_keys() -> None:
    manager, admission = admitting_after(2, max_tracked=2)
    manager.count_admission([1, 2], 0)
    manager.count_admission([1, 2], 0)
    manager.count_admission([3], 0)  # pushes out 1, the least recently counted
    assert [admission.num_requests_of(key) for key in (1, 2, 3)] == [0, 2, 1]
    manager.check_integrity()


@pytest.mark.parametrize("threshold, max_tracked", [(-1, 10), (2, 0), (True, 10)])
def test_admission_rejects_bad_values(threshold: int, max_tracked: int) -> None:
    with pytest.raises(ValueError):
        AdmitAfterRequests(threshold, max_tracked)
