"""Storage tiers of the offloading connector: `host.tier.HostTier` (primary, preallocated host
memory), and below it `disk.tier.DiskTier` (local files) and `redis.tier.RedisTier` (a shared
store), both written through from the host tier.

A tier exposes transfer functions `(src, dst) -> TransferOutcome` that run synchronously on a
worker thread (worker/wiring.py routes them), and its counters as `stats` (metrics.Counters of
its record in metrics.py). This module holds the record every tier returns; the tiers themselves
are imported from their packages, so that importing one does not import another.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class TransferOutcome:
    """What one synchronous transfer did. `failed_indices` are positions in the destination spec
    (engine block positions for an ENGINE destination) that were not filled."""

    num_bytes: int
    failed_indices: list[int] = field(default_factory=list)


class DroppedKeys:
    """The keys a lower tier dropped by itself (evicted for room, found gone, deleted as bad),
    for the scheduler half's removal events: appended by worker threads, drained by the worker
    half once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: list[bytes] = []

    def add(self, keys: list[bytes]) -> None:
        if keys:
            with self._lock:
                self._keys.extend(keys)

    def take(self) -> list[bytes]:
        with self._lock:
            keys, self._keys = self._keys, []
        return keys
