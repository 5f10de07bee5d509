"""One piece of work cut into consecutive ranges that several threads take in turn: the calling
thread and helper threads (the host tier's copies, the disk tier's cached reads).

The ranges are pulled, not dealt: each thread takes the next range nobody has taken until none
is left. A helper that starts late (a thread idle for a while may be woken on the caller's own
core first and wait there for milliseconds, so a read cut in fixed halves can run at one
thread's speed) then takes fewer ranges, instead of the caller waiting for its fixed share; one
that has not started when the caller runs out of ranges is cancelled, not waited for."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")

RANGES_PER_THREAD = 4  # enough to even out a late start, few enough that a range is not tiny


def run_in_parts(n: int, k: int, part: Callable[[int, int], T],
                 helpers: ThreadPoolExecutor) -> list[T]:
    """part(lo, hi) for consecutive ranges covering range(n) (RANGES_PER_THREAD * k of them, at
    most n), taken in turn by this thread and up to k - 1 tasks on `helpers`. Each range's
    result, in order. An exception a part raises is raised (then no further range starts).
    Every part has ended when this returns or raises, even if this thread's part raised: the
    parts write into memory the caller hands on (a failed copy's engine blocks are recomputed
    into)."""
    num_ranges = max(1, min(n, RANGES_PER_THREAD * k))
    bounds = [n * r // num_ranges for r in range(num_ranges + 1)]
    results: list[T | None] = [None] * num_ranges
    taken = itertools.count()  # next() on it is atomic under the GIL
    failed: list[BaseException] = []

    def take_ranges() -> None:
        while not failed and (r := next(taken)) < num_ranges:
            try:
                results[r] = part(bounds[r], bounds[r + 1])
            except BaseException as exc:
                failed.append(exc)
                raise

    futures = [helpers.submit(take_ranges) for _ in range(min(k, num_ranges) - 1)]
    try:
        take_ranges()
    finally:
        # A helper task still queued took no range, and now finds none: cancel it. One that
        # started may be in its last range: wait for it.
        wait([f for f in futures if not f.cancel()])
    if failed:
        raise failed[0]
    return results  # type: ignore[return-value]  # every range ran: none is left None
