"""Bounded waits for keys another request's job is writing into the host tier.

A hit run ends at the first key that is being written to host memory: another request's load is
promoting it from disk or Redis, or another request's store is copying it from the engine. The
request could compute the rest of its prompt at once, but the write is usually much cheaper than
that compute: it is what the connector chose over computing for the other request. So the
request is answered None (ask again) while the write runs, and takes the keys as host hits once
they are ready; the requests then prefill together.

The wait is bounded: at most `limit_s` from the request's first wait (not per key, so a chain of
writes cannot keep it waiting longer), then the request computes the keys still being written.
A write that fails ends the wait too: its keys are then simply not in host memory, so the
request's latency is tied to the other job for at most `limit_s`, and its outcome never.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


# A request's deadline once it has passed: counted and logged once, never waited on again.
_EXPIRED = -math.inf


class InflightWaits:
    """The deadline of each request waiting for another job's write, from its first wait until
    it is admitted or finished."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self.clock = clock  # tests move time themselves
        self._deadlines: dict[str, float] = {}  # req_id -> when its wait ends (or _EXPIRED)
        self.num_waits = 0  # None answers given because of a write in flight
        self.num_timeouts = 0  # requests that stopped waiting at their deadline

    def should_wait(self, req_id: str) -> bool:
        """The request's run ends at a key being written: True while its wait lasts."""
        if self.limit_s <= 0:
            return False
        now = self.clock()
        deadline = self._deadlines.setdefault(req_id, now + self.limit_s)
        if now < deadline:
            self.num_waits += 1
            return True
        if deadline != _EXPIRED:
            self._deadlines[req_id] = _EXPIRED
            self.num_timeouts += 1
            logger.warning("OffloadingConnector: request %s waited %.2f s for blocks another "
                           "request is writing to host memory; it computes them "
                           "(inflight_wait_s)", req_id, self.limit_s)
        return False

    def forget(self, req_id: str) -> None:
        """The request was admitted or finished: a later wait (after a preemption) starts anew."""
        self._deadlines.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._deadlines)
