"""A transfer handler on a pool of threads (`ThreadPoolHandler`): each job, or the jobs queued
together as one batch, runs on one of its threads; each job is reported once it ended, whatever
the jobs before it do. A job stuck in I/O can be abandoned: the pool gets a thread in place of
the stuck one, so the jobs queued behind it go on. The handler interface and the router in
front of the handlers are in `transfers`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvport.connectors.offloading.mediums import LoadStoreSpec
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.worker.transfers import (
    BatchFn, JobId, TransferFn, TransferHandler, TransferResult, failed_result,
)

logger = logging.getLogger(__name__)

THREAD_EXIT_S = 1.0  # how long shutdown waits for an idle transfer thread to end
# At most this many threads of one handler may be stuck in abandoned jobs, each replaced by a
# new one: a tier whose every call hangs (a dead NFS mount) must not grow threads without end.
# Beyond it, abandoned jobs are not replaced; the jobs queued behind them wait (and are late).
MAX_STUCK_THREADS = 4


class ThreadPoolHandler(TransferHandler):
    """Runs `transfer(src, dst)` for each job on a pool of `num_threads` threads. A transfer that
    raises becomes a failed result listing every destination position. Jobs are reported as
    they end; `abandon` replaces the thread of a job stuck in I/O (see there).

    With `batch`, a thread that takes a job also takes the jobs queued behind it, up to a
    batch size in destination positions (one job alone may be larger), and runs them in one
    `batch([(src, dst), ...])` call, which returns each job's outcome; each job is still
    reported on its own. This is for tiers whose fixed cost per call shows at small jobs (a
    disk load of 8 entries: the thread hand-off and the tier's per-call work are 10 % of it).
    Only jobs already queued are taken: none waits for a later one. A batch that raises is run
    again job by job, so that a job that raises fails alone.

    The batch size is `max_batch_blocks`; with `batch_seconds`, it is instead what the last
    call moved in that long at its rate (at least 1, at most `max_batch_blocks`, at most twice
    the size before; `first_batch_blocks` before any call). A batch's jobs are reported when the
    call ends, so the size bounds what its first job waits for the others: a time bounds it
    whether the tier's bytes are in the page cache (many jobs fit) or on the device (few
    do)."""

    def __init__(self, transfer: TransferFn, num_threads: int = 1, name: str = "transfer",
                 batch: BatchFn | None = None, max_batch_blocks: int = 0,
                 batch_seconds: float = 0.0, first_batch_blocks: int = 0) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if batch is not None and max_batch_blocks < 1:
            raise ValueError(f"max_batch_blocks must be >= 1 with a batch, got "
                             f"{max_batch_blocks}")
        if batch_seconds < 0 or first_batch_blocks < 0:
            raise ValueError(f"batch_seconds and first_batch_blocks must be >= 0, got "
                             f"{batch_seconds} and {first_batch_blocks}")
        self._transfer = transfer
        self._batch = batch
        self._max_batch_blocks = max_batch_blocks
        self._batch_seconds = batch_seconds if batch is not None else 0.0
        # the next batch's size; written by the threads after each call (a plain int: a lost
        # update only costs one batch of another size)
        self._batch_blocks = min(first_batch_blocks or max_batch_blocks, max_batch_blocks)
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        # NOTE: daemon threads, not a ThreadPoolExecutor: the executor joins its threads at
        # interpreter exit, so one transfer stuck in I/O would hang the process forever.
        self._name = name
        self._threads: list[threading.Thread] = []
        self._by_id: dict[JobId, _Task] = {}  # job id -> task, until reported
        self._done: list[_Task] = []  # ended, not reported yet (appended under the lock)
        self.num_stuck_threads = 0  # running an abandoned job, replaced by another thread
        self.num_replaced_threads = 0  # in all, since start
        self.num_unreplaced = 0  # abandoned jobs whose thread was not replaced (the cap)
        # Guards the tasks' states and the waiters. NOTE: not concurrent.futures' Future: its
        # per-job locks and waiters cost 10 us a job (both threads), a tenth of a warm disk load
        # of 8 entries; and a waiter is woken once, when the last of its jobs ends (woken at
        # each batch to look, its thread took the GIL from the transfer's: 5 % slower loads).
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []
        self._closed = False
        for _ in range(num_threads):
            self._start_thread()

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._loop, name=f"kvport-{self._name}-"
                                  f"{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def submit(self, job_id: JobId, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        if self._closed:
            raise RuntimeError(f"submit of job {job_id} after shutdown")
        if job_id in self._by_id:
            raise ValueError(f"job id {job_id} is already in flight")
        task = _Task(job_id, src, dst)
        self._by_id[job_id] = task
        self._queue.put(task)

    def _loop(self) -> None:
        runner = _Runner()
        carried: _Task | None = None  # taken from the queue, but over the last batch's size
        while True:
            task = carried if carried is not None else self._queue.get()
            if task is None:
                return
            tasks, carried = self._take_batch(task)
            started = self._start(tasks, runner)
            begin = time.perf_counter()
            if len(started) == 1:
                self._finish(started, [self._run(started[0])])
            elif started:
                self._finish(started, self._run_batch(started))
            if started and self._batch_seconds:
                self._size_next_batch(sum(len(t.dst) for t in started),
                                      time.perf_counter() - begin)
            if runner.replaced:  # another thread took this one's place while it was stuck
                if carried is not None:
                    self._queue.put(carried)
                with self._lock:
                    self.num_stuck_threads -= 1
                return

    def _size_next_batch(self, blocks: int, seconds: float) -> None:
        """The next batch: what a call at the rate of this one (`blocks` in `seconds`) moves in
        batch_seconds, but at most twice the size the batches had: a call may find its bytes
        read ahead by the one before, which is not the rate of the next, so the size only grows
        step by step; a slow call shrinks it at once. Not capped by `blocks` itself: a burst of jobs after a
        few small calls must not start from small batches again."""
        fit = int(blocks / max(seconds, 1e-6) * self._batch_seconds)
        self._batch_blocks = max(1, min(self._max_batch_blocks, fit, 2 * self._batch_blocks))

    def _take_batch(self, first: _Task) -> tuple[list[_Task], _Task | None]:
        """first, and with a batch the jobs queued behind it while they fit; the job taken that
        did not fit is returned to run next (by this thread: a queue has no front to put it
        back at)."""
        tasks = [first]
        if self._batch is None:
            return tasks, None
        blocks, limit = len(first.dst), self._batch_blocks
        while blocks < limit:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                break
            if task is None:  # shutdown: left for a thread to take (maybe this one, next)
                self._queue.put(None)
                break
            if blocks + len(task.dst) > limit:
                return tasks, task
            tasks.append(task)
            blocks += len(task.dst)
        return tasks, None

    def _start(self, tasks: list[_Task], runner: _Runner) -> list[_Task]:
        """The tasks not cancelled while queued, marked running (no longer cancellable) on the
        calling thread's `runner`."""
        with self._lock:
            started = [t for t in tasks if t.state is _QUEUED]
            for t in started:
                t.state, t.runner = _RUNNING, runner
        return started

    def _finish(self, tasks: list[_Task], results: list[TransferResult]) -> None:
        with self._lock:
            for t, result in zip(tasks, results):
                t.result = result
            self._end_locked(tasks)

    def _end_locked(self, tasks: list[_Task]) -> None:
        """Mark tasks done (after their results, if any, were set); wake the waiters whose
        last pending tasks these were."""
        for t in tasks:
            t.state = _DONE
        self._done.extend(tasks)
        for waiter in self._waiters:
            waiter.pending.difference_update(tasks)
            if not waiter.pending:
                waiter.done.set()

    def _run(self, task: _Task) -> TransferResult:
        start = time.perf_counter()
        try:
            return _result(task, self._transfer(task.src, task.dst), time.perf_counter() - start)
        except BaseException:  # a thread that dies would leave its job open forever
            logger.warning("transfer job %s %s->%s failed", task.job_id, *task.kind,
                           exc_info=True)
            return failed_result(task.job_id, task.kind, len(task.dst),
                                 time.perf_counter() - start)

    def _run_batch(self, tasks: list[_Task]) -> list[TransferResult]:
        """One batch call for tasks; each job's seconds are the call's, shared by positions."""
        assert self._batch is not None
        start = time.perf_counter()
        try:
            outs = self._batch([(t.src, t.dst) for t in tasks])
            assert len(outs) == len(tasks), f"{len(outs)} outcomes for {len(tasks)} jobs"
            share = (time.perf_counter() - start) / max(1, sum(len(t.dst) for t in tasks))
            return [_result(t, out, share * len(t.dst)) for t, out in zip(tasks, outs)]
        except BaseException:
            logger.warning("transfer batch of %d jobs %s->%s failed; run one by one",
                           len(tasks), *tasks[0].kind, exc_info=True)
            return [self._run(t) for t in tasks]

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done, self._done = self._done, []
        for task in done:
            del self._by_id[task.job_id]
        return [task.report() for task in done]

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> bool:
        tasks = [self._by_id[j] for j in job_ids if j in self._by_id]
        return self._wait_done(tasks, timeout)

    def _wait_done(self, tasks: list[_Task], timeout: float | None) -> bool:
        with self._lock:
            pending = {t for t in tasks if t.state is not _DONE}
            if not pending:
                return True
            waiter = _Waiter(pending, threading.Event())
            self._waiters.append(waiter)
        try:
            return waiter.done.wait(timeout)
        finally:
            with self._lock:
                self._waiters.remove(waiter)

    def cancel(self, job_ids: Iterable[JobId]) -> None:
        with self._lock:
            # a running job goes on; a cancelled one has no result: it reports failed, its
            # destination untouched
            self._end_locked([t for t in map(self._by_id.get, job_ids)
                              if t is not None and t.state is _QUEUED])

    def started(self, job_ids: Iterable[JobId]) -> set[JobId]:
        with self._lock:
            return {j for j in job_ids
                    if (t := self._by_id.get(j)) is None or t.state is not _QUEUED}

    def abandon(self, job_ids: Iterable[JobId]) -> int:
        """Give up waiting for the named jobs: queued ones are cancelled (reported failed); the
        thread of each running one is replaced by a new thread (at most MAX_STUCK_THREADS stuck
        at once), so the jobs queued behind it go on. A running job is still reported when it
        ends, and its thread then ends. Returns how many threads were started."""
        job_ids = list(job_ids)
        self.cancel(job_ids)
        with self._lock:
            runners = {t.runner for t in map(self._by_id.get, job_ids)
                       if t is not None and t.state is _RUNNING and t.runner is not None
                       and not t.runner.replaced}
            started = 0
            for runner in runners:
                if self.num_stuck_threads >= MAX_STUCK_THREADS:
                    self.num_unreplaced += 1
                    continue
                runner.replaced = True
                self.num_stuck_threads += 1
                self.num_replaced_threads += 1
                started += 1
        for _ in range(started):
            self._start_thread()
        return started

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.cancel(list(self._by_id))  # only queued jobs can be cancelled; they report failed
        for _ in self._threads:
            self._queue.put(None)
        if not self._wait_done(list(self._by_id.values()), timeout):
            logger.warning("transfer handler shut down with jobs still running after %.1fs; "
                           "their (daemon) threads are abandoned", timeout)
            return
        # Nothing runs: the threads take their sentinel and end. Joined, so none is still
        # alive when the interpreter exits (a daemon thread torn down there while inside torch
        # aborted the process: "terminate called without an active exception").
        for thread in self._threads:
            thread.join(timeout=THREAD_EXIT_S)


# A task's states, in order (compared by identity): waiting in the queue (cancellable),
# running, done (with its result; without one if it was cancelled while queued).
_QUEUED, _RUNNING, _DONE = "queued", "running", "done"


@dataclass(eq=False)
class _Task:
    job_id: JobId
    src: LoadStoreSpec
    dst: LoadStoreSpec
    state: str = _QUEUED  # changed under the handler's lock
    result: TransferResult | None = None  # set before state becomes _DONE
    runner: _Runner | None = None  # the thread running it, once started

    @property
    def kind(self) -> tuple[str, str]:
        return (self.src.medium(), self.dst.medium())

    def report(self) -> TransferResult:
        if self.result is None:  # cancelled: never ran, the destination is untouched
            return failed_result(self.job_id, self.kind, len(self.dst))
        return self.result


@dataclass(eq=False)
class _Runner:
    """One transfer thread; `replaced` once another thread took its place (set under the
    handler's lock): it ends after the job it is stuck in."""

    replaced: bool = False


@dataclass(eq=False)
class _Waiter:
    """A thread in wait(): its tasks not done yet; `done` set when none is left."""

    pending: set[_Task]
    done: threading.Event


def _result(task: _Task, out: TransferOutcome, seconds: float) -> TransferResult:
    return TransferResult(task.job_id, not out.failed_indices, out.num_bytes, seconds, task.kind,
                          list(out.failed_indices))
