"""How `kvport bench transfer` times its sides: paired rounds (every side once per round, the
order rotated between rounds, ratios taken per round), bandwidth, and a helper thread on which
a baseline runs as the transfer worker runs a tier's jobs."""

from __future__ import annotations

import queue
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

GIB = float(1 << 30)
# Pause before each timed side. A torch copy's OpenMP threads keep spinning for a few ms after it
# and take the cores from whatever runs next, which would make the side after it look slower.
SETTLE_S = 0.02


def gib_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / GIB if seconds > 0 else float("inf")


@dataclass(frozen=True)
class RatioStats:
    """Bandwidth ratio side / base (= base seconds / side seconds) per round: median, min, max."""

    ratio: float
    ratio_min: float
    ratio_max: float


def ratio_stats(side: Sequence[float], base: Sequence[float]) -> RatioStats:
    ratios = [b / s for s, b in zip(side, base)]
    return RatioStats(statistics.median(ratios), min(ratios), max(ratios))


def paired_rounds(sides: Mapping[str, Callable[[], object]], repeats: int,
                  before: Callable[[str], object] | None = None,
                  warm_up: bool = True, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Seconds of each side in each of `repeats` rounds. A round runs every side once, back to
    back, in an order that rotates between rounds, so drift on a shared machine (another
    process taking a core for a while) hits every side alike; ratios are then taken per round.
    `before(side)` runs before each side (not timed), e.g. to drop its files' page cache; then
    `settle_s` passes, so that no side pays for the threads the previous one left spinning."""
    names = list(sides)
    if warm_up:  # page faults of fresh buffers, lazy allocations, the page cache
        for name in names:
            if before is not None:
                before(name)
            sides[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if before is not None:
                before(name)
            time.sleep(settle_s)
            start = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - start)
    return times


class HelperThread:
    """Runs functions on one thread of its own, as the transfer worker runs a tier's jobs, so
    that a baseline is timed in the same conditions as the tier (the same read can run slower
    on a waiting helper thread than on the main thread). `run(fn)` blocks until fn returned
    and re-raises what it raised."""

    def __init__(self, name: str = "kvport-bench-helper") -> None:
        self._todo: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (fn := self._todo.get()) is not None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                self._done.put(exc)
            else:
                self._done.put(None)

    def run(self, fn: Callable[[], object]) -> None:
        self._todo.put(fn)
        exc = self._done.get()
        if exc is not None:
            raise exc

    def wrap(self, fn: Callable[[], object]) -> Callable[[], None]:
        return lambda: self.run(fn)

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()
