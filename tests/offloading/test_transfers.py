"""Transfer worker: routing, completions as jobs end (a stuck job holds back no other),
abandoned jobs overtaken on a new thread, failures as results, bounded shutdown."""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from fault_tiers import DEADLINE_S, FaultyDisk, FaultyTransfer, wait_until

from kvport.connectors.offloading.mediums import (
    DISK,
    ENGINE,
    HOST,
    DiskBlocks,
    EngineBlocks,
    HostBlocks,
    LoadStoreSpec,
)
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.worker.wiring import build_tier_worker
from kvport.connectors.offloading.worker import threads as transfer_threads
from kvport.connectors.offloading.worker.threads import ThreadPoolHandler
from kvport.connectors.offloading.worker.transfers import TransferRouter, TransferResult


@pytest.fixture
def workers() -> Iterator[list[TransferRouter]]:
    made: list[TransferRouter] = []
    yield made
    for w in made:
        w.shutdown(timeout=1.0)


def drain(worker: TransferRouter, n: int) -> list[TransferResult]:
    got: list[TransferResult] = []
    wait_until(lambda: bool(got.extend(worker.get_finished())) or len(got) >= n)
    return got


def test_a_job_is_reported_when_it_ends_not_behind_an_earlier_one(
        workers: list[TransferRouter]) -> None:
    fn = FaultyTransfer(hold_on={1})
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(ENGINE, HOST, ThreadPoolHandler(fn, num_threads=2))
    worker.submit(10, EngineBlocks([0]), HostBlocks([0]))
    worker.submit(11, EngineBlocks([1]), HostBlocks([1]))
    wait_until(lambda: 2 in fn.finished)  # job 11 is done, job 10 is still held
    assert [r.job_id for r in worker.get_finished()] == [11]  # not held back behind job 10
    assert not worker.wait([10], timeout=0.01)
    fn.release(1)
    assert worker.wait([10, 11, 999], timeout=5.0)  # unknown or reported ids are ignored
    assert [r.job_id for r in worker.get_finished()] == [10]
    assert worker.get_finished() == []  # each job exactly once


def test_an_abandoned_job_is_overtaken_on_a_new_thread_and_still_reported(
        workers: list[TransferRouter]) -> None:
    """One thread, stuck in job 1: abandoning it starts a thread for the queued jobs; job 1 is
    reported when it finally ends, and its thread ends then (the pool is one thread again)."""
    fn = FaultyTransfer(hold_on={1})
    handler = ThreadPoolHandler(fn, num_threads=1, name="abandon-test")
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(DISK, HOST, handler)
    worker.submit(1, DiskBlocks([b"a"]), HostBlocks([0]))
    wait_until(lambda: 1 in fn.started)
    worker.submit(2, DiskBlocks([b"b"]), HostBlocks([1]))
    assert not worker.wait([2], timeout=0.01)  # queued behind the stuck job
    assert worker.abandon([1, 999]) == 1
    assert worker.wait([2], timeout=DEADLINE_S)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    assert worker.abandon([1]) == 0  # already replaced
    assert (handler.num_stuck_threads, handler.num_replaced_threads) == (1, 1)
    fn.release(1)
    assert [(r.job_id, r.success) for r in drain(worker, 1)] == [(1, True)]
    wait_until(lambda: handler.num_stuck_threads == 0)
    alive = [t for t in threading.enumerate() if t.name.startswith("kvport-abandon-test")]
    wait_until(lambda: sum(t.is_alive() for t in alive) == 1)


def test_abandoning_cancels_queued_jobs_and_stuck_threads_are_capped(
        workers: list[TransferRouter]) -> None:
    limit = transfer_threads.MAX_STUCK_THREADS
    fn = FaultyTransfer(hold_on=set(range(1, limit + 3)))
    handler = ThreadPoolHandler(fn, num_threads=1)
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(DISK, HOST, handler)
    for job in range(1, limit + 2):  # each gets stuck in turn, once the one before is replaced
        worker.submit(job, DiskBlocks([b"k"]), HostBlocks([job]))
        wait_until(lambda: job in fn.started)
        worker.abandon([job])
    assert (handler.num_stuck_threads, handler.num_unreplaced) == (limit, 1)
    worker.submit(99, DiskBlocks([b"k"]), HostBlocks([0]))  # queued behind the last stuck one
    worker.abandon([99])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(99, False)]
    assert len(fn.started) == limit + 1  # job 99 never ran
    fn.release_all()
    assert sorted(r.job_id for r in drain(worker, limit + 1)) == list(range(1, limit + 2))
    wait_until(lambda: handler.num_stuck_threads == 0)


def test_routing_by_medium_pair_and_directions_are_independent(
        workers: list[TransferRouter]) -> None:
    store, load = FaultyTransfer(hold_on={1}), FaultyTransfer()
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(ENGINE, HOST, ThreadPoolHandler(store))
    worker.register_handler(HOST, ENGINE, ThreadPoolHandler(load))
    worker.submit(1, EngineBlocks([0]), HostBlocks([0]))
    worker.submit(2, HostBlocks([1]), EngineBlocks([3]))
    got = drain(worker, 1)  # the load is not held back by the other direction's store
    assert [(r.job_id, r.transfer_type) for r in got] == [(2, (HOST, ENGINE))]
    store.release_all()
    assert [r.job_id for r in drain(worker, 1)] == [1]
    with pytest.raises(KeyError, match="DISK->HOST"):
        worker.submit(3, DiskBlocks([b"k"]), HostBlocks([0]))
    with pytest.raises(AssertionError, match="ENGINE->HOST"):
        worker.register_handler(ENGINE, HOST, ThreadPoolHandler(store))


def test_transfer_exception_becomes_a_failed_result(workers: list[TransferRouter]) -> None:
    fn = FaultyTransfer(fail_on={2})
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(HOST, ENGINE, ThreadPoolHandler(fn))
    for job in (1, 2, 3):
        worker.submit(job, HostBlocks([0]), EngineBlocks([4, 5], skip=1))
    got = drain(worker, 3)
    assert [(r.job_id, r.success) for r in got] == [(1, True), (2, False), (3, True)]
    assert got[1].failed_indices == [0, 1]  # every destination engine block position


def test_submit_that_raises_is_reported_failed(workers: list[TransferRouter]) -> None:
    worker = TransferRouter()
    workers.append(worker)
    handler = ThreadPoolHandler(FaultyTransfer())
    worker.register_handler(HOST, ENGINE, handler)
    assert worker.submit(1, HostBlocks([0]), EngineBlocks([7]))
    assert not worker.submit(1, HostBlocks([0]), EngineBlocks([8, 9]))  # duplicate id raises
    got = drain(worker, 2)
    assert sorted((r.job_id, r.success) for r in got) == [(1, False), (1, True)]
    assert [r.failed_indices for r in got if not r.success] == [[0, 1]]


def test_failed_load_names_the_unfilled_engine_blocks(tmp_path: Path,
                                                      workers: list[TransferRouter]) -> None:
    pool = torch.randn(8, 2, 2, 4, 2, 8)
    host = HostTier.for_pool(pool, num_slots=4, blocks_per_slot=2)
    disk = FaultyDisk(tmp_path, 1 << 20, b"ns")
    worker = build_tier_worker(host, {DISK: disk})
    workers.append(worker)
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    worker.submit(1, EngineBlocks([0, 1, 2, 3, 4, 5]), HostBlocks([0, 1, 2]))
    worker.wait([1])
    worker.submit(2, HostBlocks([0, 1, 2]), DiskBlocks(keys))
    assert [r.success for r in drain(worker, 2)] == [True, True]
    disk.corrupt_payload(keys[1])
    worker.submit(3, DiskBlocks(keys), HostBlocks([3, 2, 1]))
    (res,) = drain(worker, 1)
    assert (res.success, res.failed_indices, res.transfer_type) == (False, [1], (DISK, HOST))
    assert not disk.path(keys[1]).exists()
    disk.write_errno = errno.ENOSPC
    worker.submit(4, HostBlocks([0]), DiskBlocks([b"new-key"]))
    (res,) = drain(worker, 1)
    assert (res.success, res.failed_indices) == (False, [0])
    assert disk.stats.snapshot().skipped_stores == 1


def test_shutdown_with_a_never_completing_job_does_not_hang() -> None:
    fn = FaultyTransfer(hold_on={1})
    handler = ThreadPoolHandler(fn, num_threads=1)
    worker = TransferRouter()
    worker.register_handler(ENGINE, HOST, handler)
    worker.submit(1, EngineBlocks([0]), HostBlocks([0]))  # runs and never finishes
    worker.submit(2, EngineBlocks([1]), HostBlocks([1]))  # queued behind it
    wait_until(lambda: 1 in fn.started)
    start = time.monotonic()
    worker.shutdown(timeout=0.05)
    assert time.monotonic() - start < 2.0
    assert 2 not in fn.started  # the queued job was cancelled, never run
    with pytest.raises(RuntimeError, match="after shutdown"):
        handler.submit(3, EngineBlocks([0]), HostBlocks([0]))
    fn.release_all()  # the stuck job ends; the cancelled one was reported failed at once
    got = sorted(drain(worker, 2), key=lambda r: r.job_id)
    assert [(r.job_id, r.success) for r in got] == [(1, True), (2, False)]
    assert got[1].failed_indices == [0]


def test_shutdown_drains_nothing_left_running() -> None:
    worker = TransferRouter()
    worker.register_handler(ENGINE, HOST, ThreadPoolHandler(FaultyTransfer(), num_threads=2))
    for job in range(5):
        worker.submit(job, EngineBlocks([job]), HostBlocks([job]))
    worker.wait(range(5))
    worker.shutdown()
    assert sorted(r.job_id for r in worker.get_finished()) == [0, 1, 2, 3, 4]


def test_shutdown_ends_the_idle_threads() -> None:
    """No transfer thread outlives shutdown when nothing runs: a daemon thread torn down at
    interpreter exit while inside torch aborted `kvport generate` ("terminate called without an
    active exception", 4 runs in 10 with a disk tier)."""
    handler = ThreadPoolHandler(FaultyTransfer(), num_threads=2, name="join-test")
    handler.submit(1, EngineBlocks([1]), HostBlocks([1]))
    handler.wait([1])
    handler.shutdown(0.0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvport-join-test")]


class FakeClock:
    """perf_counter for transfer_threads: moves only when a test's transfer says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class RecordingBatch:
    """A batch function: records the destination sizes of each call's jobs; a job of
    `fail_size` positions fails its first one; `raises`: every call raises. With a `clock`,
    call i takes `seconds_per_block[i]` per destination position on it."""

    def __init__(self, fail_size: int = 0, raises: bool = False, clock: FakeClock | None = None,
                 seconds_per_block: Sequence[float] = ()) -> None:
        self.calls: list[list[int]] = []
        self.fail_size = fail_size
        self.raises = raises
        self.clock = clock
        self.seconds_per_block = seconds_per_block

    def __call__(self, jobs: Sequence[tuple[LoadStoreSpec, LoadStoreSpec]]
                 ) -> list[TransferOutcome]:
        if self.clock is not None:
            self.clock.now += (self.seconds_per_block[len(self.calls)]
                               * sum(len(dst) for _, dst in jobs))
        self.calls.append([len(dst) for _, dst in jobs])
        if self.raises:
            raise OSError(errno.EIO, "injected failure of a batch")
        return [TransferOutcome(len(dst), [0] if len(dst) == self.fail_size else [])
                for _, dst in jobs]


def batched_worker(workers: list[TransferRouter], fn: FaultyTransfer, batch: RecordingBatch,
                   max_batch_blocks: int, num_threads: int = 1,
                   name: str = "transfer") -> ThreadPoolHandler:
    handler = ThreadPoolHandler(fn, num_threads, name, batch=batch,
                                max_batch_blocks=max_batch_blocks)
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(DISK, HOST, handler)
    return handler


def submit_held(handler: ThreadPoolHandler, fn: FaultyTransfer, sizes: list[int]) -> None:
    """Job 1 runs alone and is held (fn's call 1); jobs 2, 3, ... of `sizes` queue behind it."""
    handler.submit(1, DiskBlocks([b"k"]), HostBlocks([0]))
    wait_until(lambda: 1 in fn.started)
    for job, size in enumerate(sizes, start=2):
        handler.submit(job, DiskBlocks([b"k"] * size), HostBlocks(list(range(size))))


def test_queued_jobs_run_as_one_batch_and_are_reported_alone(
        workers: list[TransferRouter]) -> None:
    """The jobs queued while the thread was busy run in batches of at most max_batch_blocks
    positions, in submission order (a job that does not fit starts the next batch); each job
    is reported alone, with its own outcome; a job alone in the queue runs alone."""
    fn, batch = FaultyTransfer(hold_on={1}), RecordingBatch(fail_size=3)
    handler = batched_worker(workers, fn, batch, max_batch_blocks=6)
    submit_held(handler, fn, [2, 3, 4, 1, 6, 7])
    fn.release(1)
    assert handler.wait(range(1, 8), timeout=DEADLINE_S)
    assert batch.calls == [[2, 3], [4, 1]]  # then 6 and 7 alone: each fills a batch
    assert fn.num_calls == 3  # job 1, then the jobs of 6 and 7 positions
    got = sorted(handler.get_finished(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success, r.failed_indices) for r in got] == [
        (1, True, []), (2, True, []), (3, False, [0]), (4, True, []), (5, True, []),
        (6, True, []), (7, True, [])]
    assert [r.num_bytes for r in got] == [1, 2, 3, 4, 1, 6, 7]
    assert all(r.transfer_type == (DISK, HOST) for r in got)


def test_a_batch_is_what_the_last_call_moved_in_batch_seconds(
        workers: list[TransferRouter], monkeypatch: pytest.MonkeyPatch) -> None:
    """With batch_seconds, the next batch is what the last call's rate moves in that long:
    grown at most twofold a call, shrunk at once by a slow call, never over max_batch_blocks;
    first_batch_blocks until a call was timed."""
    clock = FakeClock()
    monkeypatch.setattr(transfer_threads, "time", clock)
    fn = FaultyTransfer(hold_on={1})  # takes no time on the clock: its rate is unbounded
    tick = 2 ** -7  # seconds a block; binary fractions keep the clock's sums exact
    batch = RecordingBatch(clock=clock, seconds_per_block=[tick, tick, 4 * tick])
    handler = ThreadPoolHandler(fn, batch=batch, max_batch_blocks=12, batch_seconds=10 * tick,
                                first_batch_blocks=4)
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(DISK, HOST, handler)
    submit_held(handler, fn, [2] * 16)
    fn.release(1)
    assert handler.wait(range(1, 18), timeout=DEADLINE_S)
    # job 1 in no time: 8 (twice the first 4, not its unbounded rate); 8 blocks in 8 ticks:
    # 10 (under twice 8); 10 in 10 ticks: 10 (not 12); 10 in 40 ticks: 2, one job each
    assert batch.calls == [[2] * 4, [2] * 5, [2] * 5]
    assert fn.num_calls == 3
    assert all(r.success for r in handler.get_finished())
    handler._size_next_batch(10, 10 * tick / 100)  # 100 times faster: twice 10, but at most 12
    assert handler._batch_blocks == 12
    with pytest.raises(ValueError, match="must be >= 0, got -1.0 and 0"):
        ThreadPoolHandler(fn, batch=batch, max_batch_blocks=1, batch_seconds=-1.0)


def test_a_batch_that_raises_runs_job_by_job_and_a_bad_job_fails_alone(
        workers: list[TransferRouter]) -> None:
    fn, batch = FaultyTransfer(hold_on={1}, fail_on={3}), RecordingBatch(raises=True)
    handler = batched_worker(workers, fn, batch, max_batch_blocks=100)
    submit_held(handler, fn, [1, 2, 3])  # jobs 2, 3, 4: fn's calls 2, 3, 4 after the batch
    fn.release(1)
    assert handler.wait(range(1, 5), timeout=DEADLINE_S)
    assert batch.calls == [[1, 2, 3]]
    got = sorted(handler.get_finished(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success, r.failed_indices) for r in got] == [
        (1, True, []), (2, True, []), (3, False, [0, 1]), (4, True, [])]


def test_a_job_cancelled_while_queued_is_left_out_of_its_batch(
        workers: list[TransferRouter]) -> None:
    fn, batch = FaultyTransfer(hold_on={1}), RecordingBatch()
    handler = batched_worker(workers, fn, batch, max_batch_blocks=100)
    submit_held(handler, fn, [1, 2, 3])
    handler.cancel([3])
    fn.release(1)
    assert handler.wait(range(1, 5), timeout=DEADLINE_S)
    assert batch.calls == [[1, 3]]
    got = sorted(handler.get_finished(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success, r.failed_indices) for r in got] == [
        (1, True, []), (2, True, []), (3, False, [0, 1]), (4, True, [])]


def test_shutdown_ends_every_batching_thread(workers: list[TransferRouter]) -> None:
    """A thread that meets shutdown's end marker while it takes a batch leaves it for the
    others: each of the threads takes one and ends."""
    fn, batch = FaultyTransfer(hold_on={1, 2}), RecordingBatch()
    handler = batched_worker(workers, fn, batch, max_batch_blocks=100, num_threads=2,
                             name="batch-join")
    for job in (1, 2):  # one at a time: the second thread takes job 2, both are busy
        handler.submit(job, DiskBlocks([b"k"]), HostBlocks([0]))
        wait_until(lambda: job in fn.started)
    handler.submit(3, DiskBlocks([b"k"]), HostBlocks([0]))
    handler.submit(4, DiskBlocks([b"k"]), HostBlocks([0]))
    handler.shutdown(timeout=0.0)  # 3 and 4 cancelled; an end marker per thread queued last
    fn.release_all()
    wait_until(lambda: not [t for t in threading.enumerate()
                            if t.name.startswith("kvport-batch-join")])
    assert batch.calls == [] and fn.num_calls == 2
    got = sorted(handler.get_finished(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success) for r in got] == [(1, True), (2, True), (3, False), (4, False)]


def test_the_standard_wiring_batches_disk_promotions_only(tmp_path: Path,
                                                          workers: list[TransferRouter]
                                                          ) -> None:
    host = HostTier(4, 4096)
    worker = build_tier_worker(host, {DISK: DiskTier(tmp_path, 1 << 20, b"ns")})
    workers.append(worker)
    batching = {kind for kind, h in worker._handlers.items()
                if isinstance(h, ThreadPoolHandler) and h._batch is not None}
    assert batching == {(DISK, HOST)}


def test_wait_returns_when_the_last_of_its_jobs_ends(workers: list[TransferRouter]) -> None:
    """A waiter is woken once, by the end of the last job it waits for, not by each one."""
    fn = FaultyTransfer(hold_on={1, 2})
    handler = ThreadPoolHandler(fn, num_threads=2)
    worker = TransferRouter()
    workers.append(worker)
    worker.register_handler(HOST, ENGINE, handler)
    worker.submit(1, HostBlocks([0]), EngineBlocks([0]))
    worker.submit(2, HostBlocks([1]), EngineBlocks([1]))
    wait_until(lambda: fn.started == {1, 2})
    returned = threading.Event()
    waiting = threading.Thread(target=lambda: worker.wait([1, 2], DEADLINE_S) and returned.set())
    waiting.start()
    wait_until(lambda: bool(handler._waiters))  # registered before either job ends
    fn.release(1)
    wait_until(lambda: 1 in fn.finished)
    assert not returned.wait(0.2)  # job 2 still runs
    fn.release(2)
    waiting.join(DEADLINE_S)
    assert returned.is_set()
    assert [r.job_id for r in worker.get_finished()] == [1, 2]
    assert handler._waiters == []


def test_a_batch_needs_a_size() -> None:
    with pytest.raises(ValueError, match="max_batch_blocks must be >= 1 with a batch, got 0"):
        ThreadPoolHandler(FaultyTransfer(), batch=RecordingBatch())
