"""Worker-side transfer machinery: handlers per direction and the router in front of them.

Runs in the worker (next to the model runner). The connector's worker half submits jobs with
ids it chooses (any hashable value: the router and handlers never interpret them) and polls
completions once per step:

    router.submit(job_id, src, dst)    route by (src.medium(), dst.medium()); never raises for a
                                       handler's failure: the job is then reported failed
    router.get_finished()              completions since the last call, each job exactly
                                       once, as they ended (a stuck job holds back no other)
    router.wait(job_ids, timeout)      block until those jobs are done (unknown ids ignored)
    router.cancel(job_ids)             cancel those that have not started (reported failed)
    router.abandon(job_ids)            cancel those, and replace the threads of running ones
                                       (late: stuck in I/O), which report when they end
    router.shutdown(timeout)           cancel queued jobs, wait for running ones at most timeout

A failed job names what was not done in `failed_indices`: positions in the destination spec. For
an ENGINE destination those are the engine blocks (positions in `EngineBlocks.block_ids`) that
hold no valid KV; a job that failed as a whole lists every position.

The handler the tiers run on is `threads.ThreadPoolHandler`; which function runs on which
handler is the tiers' wiring (`wiring.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvport.connectors.offloading.mediums import LoadStoreSpec
from kvport.connectors.offloading.tiers import TransferOutcome

logger = logging.getLogger(__name__)

TransferFn = Callable[[LoadStoreSpec, LoadStoreSpec], TransferOutcome]
# jobs' (source, destination) -> each job's outcome, in order: several jobs in one call
BatchFn = Callable[[Sequence[tuple[LoadStoreSpec, LoadStoreSpec]]], list[TransferOutcome]]
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
        """Jobs finished since the last call, in the order they ended, each exactly once."""

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

    def started(self, job_ids: Iterable[JobId]) -> set[JobId]:
        """The named jobs that are running or ended, not queued. This default: all of them."""
        return set(job_ids)

    def abandon(self, job_ids: Iterable[JobId]) -> int:
        """Stop waiting for the named jobs: cancel queued ones; a handler with threads replaces
        the thread of each running one, so later jobs overtake it. Running jobs still report
        when they end. Returns the threads started; this default only cancels."""
        self.cancel(job_ids)
        return 0


def failed_result(job_id: JobId, kind: tuple[str, str], num_dst: int,
                  seconds: float = 0.0) -> TransferResult:
    return TransferResult(job_id, False, 0, seconds, kind, list(range(num_dst)))


class TransferRouter:
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
        """Completions of every handler, then refused submits."""
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
        for kind, ids in self._by_handler(job_ids).items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._handlers[kind].wait(ids, left):
                return False
        return True

    def cancel(self, job_ids: Iterable[JobId]) -> None:
        """Cancel the named jobs that have not started yet (see TransferHandler.cancel)."""
        for kind, ids in self._by_handler(job_ids).items():
            self._handlers[kind].cancel(ids)

    def started(self, job_ids: Iterable[JobId]) -> set[JobId]:
        """The named jobs that are running or ended (see TransferHandler.started)."""
        out: set[JobId] = set()
        for kind, ids in self._by_handler(job_ids).items():
            out |= self._handlers[kind].started(ids)
        return out

    def abandon(self, job_ids: Iterable[JobId]) -> int:
        """Abandon the named jobs (see TransferHandler.abandon); the threads started."""
        started = 0
        for kind, ids in self._by_handler(job_ids).items():
            started += self._handlers[kind].abandon(ids)
        return started

    def _by_handler(self, job_ids: Iterable[JobId]) -> dict[tuple[str, str], list[JobId]]:
        by_handler: dict[tuple[str, str], list[JobId]] = {}
        for j in job_ids:
            if j in self._job_kind:
                by_handler.setdefault(self._job_kind[j], []).append(j)
        return by_handler

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
