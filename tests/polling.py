"""The one way tests wait for something another thread or process does: poll a condition until
it holds, and fail with what was awaited once a deadline passes (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable


def poll_until(cond: Callable[[], bool], what: str, timeout_s: float,
               interval_s: float = 0.0) -> None:
    """Call cond until it returns true; AssertionError naming `what` after `timeout_s`.
    `interval_s` is the pause between tries: 0 only yields the GIL (worker threads of this
    process), a few ms or more spares the CPU while another process gets ready."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)
