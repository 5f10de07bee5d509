"""Worker-side transfer machinery: handlers per direction and the router in front of them.

Runs in the worker (next to the model runner). The connector's worker half submits jobs with
ids it chooses (any hashable value: the router and handlers never interpret them) and polls
completions once per step:

    worker.submit(job_id, src, dst)    route by (src.medium(), dst.medium()); never raises for a
                                       handler's failure: the job is then reported failed
    worker.get_finished()              completions since the last call; per direction in
                                       submission order, each job exactly once
    worker.wait(job_ids, timeout)      block until those jobs are done (unknown ids ignored)
    worker.cancel(job_ids)             cancel those that have not started (reported failed)
    worker.shutdown(timeout)           cancel queued jobs, wait for running ones at most timeout

A failed job names what was not done in `failed_indices`: positions in the destination spec. For
an ENGINE destination those are the engine blocks (positions in `EngineBlocks.block_ids`) that
hold no valid KV; a job that failed as a whole lists every position.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvport.connectors.offloading.mediums import DISK, ENGINE, HOST, REDIS, LoadStoreSpec
from kvport.connectors.offloading.tiers import TierStats, TransferOutcome

if TYPE_CHECKING:
    from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
    from kvport.connectors.offloading.tiers.host import HostTier

logger = logging.getLogger(__name__)

TransferFn = Callable[[LoadStoreSpec, LoadStoreSpec], TransferOutcome]
THREAD_EXIT_S = 1.0  # how long shutdown waits for an idle transfer thread to end
JobId = Hashable  # chosen by the submitter, unique among its jobs in flight


@dataclass
class TransferResult:
    """One finished job. `seconds` is the transfer's own run time (not its queueing)."""

    job_id: JobId
    success: bool
    num_bytes: int = 0
    seconds: float = 0.0
    transfer_type: tuple[str, str] = ("", "")  # (source medium, destination medium)
    failed_indices: list[int] = field(default_factory=list)


class TransferHandler(ABC):
    """Moves blocks in one direction. Called only from the worker-side connector's thread."""

    @abstractmethod
    def submit(self, job_id: JobId, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        """Start a job and return at once. May raise (the worker then reports the job failed)."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, in submission order: a job that finished early is
        held back until every earlier job of this handler has finished. Each job exactly once."""

    @abstractmethod
    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> bool:
        """Block until the named jobs finished (unknown or reported ids are ignored). Returns
        False if the timeout passed first. Does not consume results."""

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancel queued jobs (reported failed), wait at most `timeout` for running ones."""

    def cancel(self, job_ids: Iterable[JobId]) -> None:
        """Cancel the named jobs that have not started (they report failed, their destination
        untouched); running ones go on. This default cancels nothing."""


class ThreadPoolHandler(TransferHandler):
    """Runs `transfer(src, dst)` for each job on a pool of `num_threads` threads. A transfer that
    raises becomes a failed result listing every destination position."""

    def __init__(self, transfer: TransferFn, num_threads: int = 1, name: str = "transfer") -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._transfer = transfer
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        # NOTE: daemon threads, not a ThreadPoolExecutor: the executor joins its threads at
        # interpreter exit, so one transfer stuck in I/O would hang the process forever.
        self._threads = [threading.Thread(target=self._loop, name=f"kvport-{name}-{i}",
                                          daemon=True) for i in range(num_threads)]
        for t in self._threads:
            t.start()
        self._jobs: deque[_Task] = deque()  # submission order; the head is reported first
        self._by_id: dict[JobId, _Task] = {}  # job id -> task, until reported
        self._closed = False

    def submit(self, job_id: JobId, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        if self._closed:
            raise RuntimeError(f"submit of job {job_id} after shutdown")
        if job_id in self._by_id:
            raise ValueError(f"job id {job_id} is already in flight")
        task = _Task(job_id, src, dst, Future())
        self._jobs.append(task)
        self._by_id[job_id] = task
        self._queue.put(task)

    def _loop(self) -> None:
        while (task := self._queue.get()) is not None:
            if task.future.set_running_or_notify_cancel():  # False: cancelled while queued
                task.future.set_result(self._run(task))

    def _run(self, task: _Task) -> TransferResult:
        start = time.perf_counter()
        try:
            out = self._transfer(task.src, task.dst)
        except BaseException:  # a thread that dies would leave its job open forever
            logger.warning("transfer job %s %s->%s failed", task.job_id, *task.kind,
                           exc_info=True)
            return failed_result(task.job_id, task.kind, len(task.dst),
                                 time.perf_counter() - start)
        return TransferResult(task.job_id, not out.failed_indices, out.num_bytes,
                              time.perf_counter() - start, task.kind, list(out.failed_indices))

    def get_finished(self) -> list[TransferResult]:
        done: list[TransferResult] = []
        while self._jobs and self._jobs[0].future.done():
            task = self._jobs.popleft()
            del self._by_id[task.job_id]
            done.append(task.result())
        return done

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> bool:
        futures = [self._by_id[j].future for j in job_ids if j in self._by_id]
        return not wait_futures(futures, timeout=timeout).not_done

    def cancel(self, job_ids: Iterable[JobId]) -> None:
        for j in job_ids:
            task = self._by_id.get(j)
            if task is not None:
                task.future.cancel()  # False (nothing happens) once the job runs

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._jobs:
            task.future.cancel()  # only queued jobs can be cancelled; they report failed
        for _ in self._threads:
            self._queue.put(None)
        running = [t.future for t in self._jobs if not t.future.done()]
        if wait_futures(running, timeout=timeout).not_done:
            logger.warning("transfer handler shut down with jobs still running after %.1fs; "
                           "their (daemon) threads are abandoned", timeout)
            return
        # Nothing runs: the threads take their sentinel and end. Joined, so none is still
        # alive when the interpreter exits (a daemon thread torn down there while inside torch
        # aborted the process: "terminate called without an active exception").
        for thread in self._threads:
            thread.join(timeout=THREAD_EXIT_S)


@dataclass
class _Task:
    job_id: JobId
    src: LoadStoreSpec
    dst: LoadStoreSpec
    future: Future[TransferResult]

    @property
    def kind(self) -> tuple[str, str]:
        return (self.src.medium(), self.dst.medium())

    def result(self) -> TransferResult:
        if self.future.cancelled():  # never ran: the destination is untouched
            return failed_result(self.job_id, self.kind, len(self.dst))
        return self.future.result()  # _run never raises


def failed_result(job_id: JobId, kind: tuple[str, str], num_dst: int,
                  seconds: float = 0.0) -> TransferResult:
    return TransferResult(job_id, False, 0, seconds, kind, list(range(num_dst)))


class OffloadingWorker:
    """Routes jobs to the handler registered for their (source, destination) mediums."""

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], TransferHandler] = {}  # (src, dst) -> handler
        self._job_kind: dict[JobId, tuple[str, str]] = {}  # job id -> route, until reported
        self._rejected: list[TransferResult] = []  # jobs whose submit raised
        self._lock = threading.Lock()

    def register_handler(self, src_medium: str, dst_medium: str,
                         handler: TransferHandler) -> None:
        key = (src_medium, dst_medium)
        assert key not in self._handlers, f"a handler for {src_medium}->{dst_medium} exists"
        self._handlers[key] = handler

    def submit(self, job_id: JobId, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        """Start a job; False if its handler refused it (the job is then reported failed with
        every destination position by the next get_finished). An unregistered pair is a bug and
        raises KeyError."""
        kind = (src.medium(), dst.medium())
        handler = self._handlers.get(kind)
        if handler is None:
            raise KeyError(f"no transfer handler for {kind[0]}->{kind[1]}; registered: "
                           f"{sorted(self._handlers)}")
        try:
            handler.submit(job_id, src, dst)
        except Exception:
            logger.exception("submit of job %s %s->%s failed", job_id, *kind)
            with self._lock:
                self._rejected.append(failed_result(job_id, kind, len(dst)))
            return False
        self._job_kind[job_id] = kind
        return True

    def get_finished(self) -> list[TransferResult]:
        """Completions of every handler (each in submission order), then refused submits."""
        results: list[TransferResult] = []
        for handler in self._handlers.values():
            results.extend(handler.get_finished())
        with self._lock:
            results.extend(self._rejected)
            self._rejected.clear()
        for r in results:
            self._job_kind.pop(r.job_id, None)
        return results

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> bool:
        """Block until the named jobs finished; False if `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        by_handler: dict[tuple[str, str], list[JobId]] = {}
        for j in job_ids:
            if j in self._job_kind:
                by_handler.setdefault(self._job_kind[j], []).append(j)
        for kind, ids in by_handler.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._handlers[kind].wait(ids, left):
                return False
        return True

    def cancel(self, job_ids: Iterable[JobId]) -> None:
        """Cancel the named jobs that have not started yet (see TransferHandler.cancel)."""
        by_handler: dict[tuple[str, str], list[JobId]] = {}
        for j in job_ids:
            if j in self._job_kind:
                by_handler.setdefault(self._job_kind[j], []).append(j)
        for kind, ids in by_handler.items():
            self._handlers[kind].cancel(ids)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Shut every handler down (each waits at most `timeout`), even if one raises."""
        errors: list[BaseException] = []
        for handler in self._handlers.values():
            try:
                handler.shutdown(timeout)
            except Exception as exc:  # noqa: BLE001 - the others must still shut down
                errors.append(exc)
        if errors:
            raise errors[0]


class LowerTier(Protocol):
    """A tier below the host tier (disk, Redis): it moves whole offload blocks between host slots
    and its own entries, by key. Runs on worker threads; never raises for its medium's faults
    (those are failed positions, counted in its stats)."""

    @property
    def stats(self) -> TierStats: ...

    def store_from_host(self, host: HostTier, src: HostBlocks, dst: Any) -> TransferOutcome: ...

    def load_to_host(self, host: HostTier, src: Any, dst: HostBlocks) -> TransferOutcome: ...

    def close(self) -> None:
        """Release connections (after the transfers stopped); must not block for long."""


def load_unless_late(host: HostTier, src: HostBlocks, dst: EngineBlocks) -> TransferOutcome:
    """HOST -> ENGINE, unless the destination's deadline has passed: then nothing is written
    and every block fails (the step that wanted it has recomputed it)."""
    if dst.deadline is not None and time.monotonic() > dst.deadline:
        return TransferOutcome(0, list(range(len(dst))))
    return host.load(src, dst)


def tier_routes(host: HostTier,
                lower: Mapping[str, LowerTier]) -> dict[tuple[str, str], TransferFn]:
    """The transfer functions of the standard wiring: ENGINE<->HOST copies, and HOST<->medium
    for each lower tier (medium name -> tier)."""
    routes: dict[tuple[str, str], TransferFn] = {
        (ENGINE, HOST): host.store,  # type: ignore[dict-item]
        (HOST, ENGINE): functools.partial(load_unless_late, host)}
    for medium, tier in lower.items():
        routes[(HOST, medium)] = functools.partial(tier.store_from_host, host)
        routes[(medium, HOST)] = functools.partial(tier.load_to_host, host)
    return routes


# Threads per direction between host memory and a lower tier. Disk: one; a job's entries are one
# extent of a run file read in file order, and a second thread reading another job at the same
# time breaks the device's stream into smaller requests (cold jobs of 8 SmolLM2 entries: 0.79-
# 0.85x of one sequential file with one thread, 0.56-0.75x with two; warm reads are bound by
# memory either way). Redis: two, so that one job's round trip overlaps another's.
LOWER_THREADS = {DISK: 1, REDIS: 2}


def build_tier_worker(host: HostTier, lower: Mapping[str, LowerTier] | None = None,
                      host_threads: int = 1, lower_threads: int | None = None,
                      ) -> OffloadingWorker:
    """The standard wiring (`tier_routes`) on thread pools, one per direction; `lower_threads`
    None: LOWER_THREADS per medium.

    NOTE: one host thread per direction is enough: one native copy reaches the memory
    bandwidth (tiers/block_copy.c)."""
    worker = OffloadingWorker()
    for (src, dst), fn in tier_routes(host, lower or {}).items():
        medium = dst if src == HOST else src
        threads = (host_threads if ENGINE in (src, dst) else
                   lower_threads or LOWER_THREADS.get(medium, 2))
        worker.register_handler(src, dst, ThreadPoolHandler(
            fn, threads, f"{src.lower()}-{dst.lower()}"))
    return worker
