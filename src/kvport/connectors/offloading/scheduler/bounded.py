"""A call the scheduler makes into a medium that may hang (a stat on a hung network file system),
bounded: it runs on a helper thread, and the caller waits for it at most a timeout.

A call still running when its caller gave up is left to end on its own; until it has, later
calls do not start (one stuck thread, never a pile of them) and answer the caller's default at
once. Both cases are counted (`num_timeouts`, `num_skipped`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Call(Generic[T]):
    __slots__ = ("fn", "done", "value", "error")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


class BoundedCall:
    """One helper thread (started on the first call) for the calls of one medium."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._late: _Call | None = None  # the call a caller gave up on, until it ends
        self.num_timeouts = 0
        self.num_skipped = 0

    def run(self, fn: Callable[[], T], timeout_s: float, default: T) -> T:
        """fn() if it ends within timeout_s, else `default` (also at once while an earlier call
        that timed out still runs). An exception of fn is raised here."""
        if self._late is not None:
            if not self._late.done.is_set():
                self.num_skipped += 1
                return default
            self._late = None
            logger.info("%s: the late call ended; lookups run again", self.name)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"kvport-{self.name}",
                                            daemon=True)
            self._thread.start()
        call: _Call[T] = _Call(fn)
        self._queue.put(call)
        if not call.done.wait(timeout_s):
            self._late = call
            self.num_timeouts += 1
            logger.warning("%s: a lookup took more than %.0f ms; misses until it ends",
                           self.name, timeout_s * 1000)
            return default
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]  # set when done without error

    def _loop(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                call.value = call.fn()
            except BaseException as exc:  # handed to the caller (or lost if it gave up)
                call.error = exc
            finally:
                call.done.set()

    def close(self) -> None:
        """End the helper thread once its current call returned (never waits for it)."""
        if self._thread is not None:
            self._queue.put(None)
