"""Expected-value records and checks shared by the offload manager tests."""

from __future__ import annotations

from dataclasses import dataclass

from kvport.connectors.offloading.manager.abstract import OffloadingManager, PrepareStoreOutput

MEDIUM = "CPU"


@dataclass
class ExpectedPrepareStoreOutput:
    keys_to_store: list[int]
    slot_ids: list[int]
    evicted_keys: list[int]
    deferred_keys: list[int] | None = None  # None: not checked


@dataclass
class ExpectedEvent:
    keys: tuple[int, ...]
    removed: bool


def verify_store_output(output: PrepareStoreOutput | None,
                        expected: ExpectedPrepareStoreOutput) -> None:
    assert output is not None, "prepare_store returned None"
    assert output.keys_to_store == expected.keys_to_store
    assert output.slot_ids == expected.slot_ids
    assert output.evicted_keys == expected.evicted_keys
    if expected.deferred_keys is not None:
        assert output.deferred_keys == expected.deferred_keys


def verify_events(manager: OffloadingManager, expected: list[ExpectedEvent]) -> None:
    events = manager.take_events()
    assert [(e.keys, e.removed) for e in events] == [(e.keys, e.removed) for e in expected]
    assert all(e.medium == MEDIUM for e in events)
    assert manager.take_events() == [], "take_events must drain"


def verify_nothing_leaked(manager: OffloadingManager) -> None:
    manager.check_integrity()
    assert manager.num_pinned == 0
    assert manager.num_being_written == 0
