"""One piece of work cut into consecutive parts that run at once: the first on the calling
thread, the others on helper threads (the host tier's copies, the disk tier's cached reads)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from itertools import pairwise
from typing import TypeVar

T = TypeVar("T")


def run_in_parts(n: int, k: int, part: Callable[[int, int], T],
                 helpers: ThreadPoolExecutor) -> list[T]:
    """part(lo, hi) for k consecutive ranges covering range(n), at once: [0, hi) on this
    thread, the others on `helpers`. Each part's result, in order; the first exception raised
    is raised. Every part has ended when this returns or raises, even if this thread's part
    raised: the parts write into memory the caller hands on (a failed copy's engine blocks are
    recomputed into)."""
    bounds = [n * g // k for g in range(k + 1)]
    futures = [helpers.submit(part, lo, hi) for lo, hi in pairwise(bounds[1:])]
    try:
        first = part(0, bounds[1])
    finally:
        wait(futures)
    return [first, *(f.result() for f in futures)]
