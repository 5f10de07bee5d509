"""StreamHandler (worker/streams.py): the bookkeeping of jobs whose copies a device runs later.
The queue here stands in for a CUDA stream's events, which a test completes at will: what CUDA
itself does (stream order, the compute stream's waits) is checked by tools/gpu_check.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.worker.streams import HostQueue, StreamHandler
from kvport.connectors.offloading.worker.transfers import TransferRouter


class ManualEvent:
    def __init__(self) -> None:
        self.done = False
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


class ManualQueue:
    """Runs each copy at once (as a stream would, later) and hands out events it completes
    only when told; records which jobs were synchronous loads."""

    def __init__(self) -> None:
        self.events: list[ManualEvent] = []
        self.sync: list[bool] = []

    def enqueue(self, run: Callable[[], TransferOutcome],
                sync: bool) -> tuple[TransferOutcome, ManualEvent]:
        self.sync.append(sync)
        self.events.append(ManualEvent())
        return run(), self.events[-1]


def copy(src: HostBlocks | EngineBlocks, dst: HostBlocks | EngineBlocks) -> TransferOutcome:
    return TransferOutcome(100 * len(dst), [0] if getattr(dst, "block_ids", [1])[0] == 99 else [])


def test_jobs_are_reported_when_their_events_complete_in_any_order() -> None:
    queue = ManualQueue()
    handler = StreamHandler(copy, queue)
    handler.submit("a", EngineBlocks([1]), HostBlocks([0]))
    handler.submit("b", HostBlocks([0]), EngineBlocks([2], deadline=1.0))  # a synchronous load
    handler.submit("c", HostBlocks([1]), EngineBlocks([3]))
    assert queue.sync == [False, True, False]
    assert handler.get_finished() == []
    queue.events[1].done = True  # the expedited load ends before the store queued ahead of it
    [b] = handler.get_finished()
    assert (b.job_id, b.success, b.num_bytes, b.transfer_type) == ("b", True, 100,
                                                                   ("HOST", "ENGINE"))
    assert handler.wait(["a"], timeout=0.0) is False  # a timeout, and nothing consumed
    assert handler.wait(["a", "zzz"]) is True  # synchronizes "a" only
    assert queue.events[0].synchronized == 1 and queue.events[2].synchronized == 0
    assert [r.job_id for r in handler.get_finished()] == ["a"]
    queue.events[2].done = True
    assert [r.job_id for r in handler.get_finished()] == ["c"]
    assert handler.get_finished() == []


def test_a_failed_outcome_and_a_copy_that_raises() -> None:
    router = TransferRouter()
    handler = StreamHandler(copy, HostQueue())
    router.register_handler("HOST", "ENGINE", handler)
    router.submit("bad", HostBlocks([0]), EngineBlocks([99, 5]))
    [bad] = router.get_finished()
    assert (bad.success, bad.failed_indices) == (False, [0])

    def boom(src: object, dst: object) -> TransferOutcome:
        raise IndexError("block 12 of 12")
    router2 = TransferRouter()
    router2.register_handler("HOST", "ENGINE", StreamHandler(boom, HostQueue()))
    assert router2.submit("x", HostBlocks([0, 1]), EngineBlocks([3, 4])) is False
    [x] = router2.get_finished()
    assert (x.job_id, x.success, x.failed_indices) == ("x", False, [0, 1])


def test_ids_in_flight_and_submits_after_shutdown_are_refused() -> None:
    queue = ManualQueue()
    handler = StreamHandler(copy, queue)
    handler.submit("a", EngineBlocks([1]), HostBlocks([0]))
    with pytest.raises(ValueError, match="job id a is already in flight"):
        handler.submit("a", EngineBlocks([2]), HostBlocks([1]))
    handler.shutdown(timeout=0.0)  # waits at most 0 s for "a" (an enqueued copy runs on)
    assert queue.events[0].synchronized == 0
    queue.events[0].done = True
    assert [r.job_id for r in handler.get_finished()] == ["a"]  # still reported
    with pytest.raises(RuntimeError, match="submit of job b after shutdown"):
        handler.submit("b", EngineBlocks([2]), HostBlocks([1]))
