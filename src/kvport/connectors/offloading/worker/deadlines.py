"""When the worker half stops waiting for a job's lower-tier I/O, and what it counts.

A promotion (disk or Redis into host memory) or a write-through (host memory to disk or Redis)
runs I/O that can hang: a hard NFS mount, a failing disk that retries, a stuck FUSE daemon, a
Redis reply that never comes. The worker gives each such stage a deadline when it submits it
(`load_timeout_s`, `write_timeout_s`); one still running then is *late*:

    a late load     its request is reported loaded with every engine block a load error (the
                    engine recomputes them); its promotions are abandoned (their threads are
                    replaced, so later jobs overtake them); no copy to the engine ever starts,
                    and its host slots stay pinned until the promotions' threads return
    a late write    abandoned the same way; its store no longer keeps the engine stepping, and
                    its host slots stay pinned until the write's thread returns

Copies between host memory and the engine's pool have no deadline: they move memory and cannot
hang, and the block-reuse fence must wait for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadlines:
    """Job id -> the monotonic time its lower-tier stage is late. Worker thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # a simulation moves time itself (tests/sim)
        self._at: dict[int, float] = {}
        self._extended: set[int] = set()  # jobs given a second deadline (extend_once)

    def start(self, job_id: int, seconds: float) -> None:
        assert job_id not in self._at, f"job {job_id} already has a deadline"
        self._at[job_id] = self._clock() + seconds

    def end(self, job_id: int) -> None:
        """The stage ended (in time or not): no deadline any more."""
        self._at.pop(job_id, None)
        self._extended.discard(job_id)

    def extend_once(self, job_id: int, seconds: float) -> bool:
        """A fresh deadline for a job take_expired returned, once: a job that was only queued
        behind a stuck one (whose thread is replaced now) gets its own time to run. False if
        it had its second deadline already."""
        if job_id in self._extended:
            return False
        self._extended.add(job_id)
        self._at[job_id] = self._clock() + seconds
        return True

    def take_expired(self) -> list[int]:
        """The jobs whose deadline passed, in id order; each is returned once."""
        now = self._clock()
        late = sorted(j for j, at in self._at.items() if at <= now)
        for j in late:
            del self._at[j]
        return late

    def __len__(self) -> int:
        return len(self._at)
