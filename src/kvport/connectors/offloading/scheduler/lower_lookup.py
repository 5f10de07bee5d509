"""The scheduler half's view of the tiers below host memory: which keys the disk tier and the Redis
tier hold, asked at scheduling time.

The disk tier is asked per key (tiers/disk/lookup.py: one stat). Redis is asked once per request,
for every key the disk does not settle, in one batched round trip with a short timeout
(tiers/redis/lookup.py); a timeout, an error or a Redis that is down answers "none", so the
request computes those blocks instead of waiting. A key is taken from the highest tier that holds it (disk before Redis: a local read is
cheaper than a network one).

Bounded: with a disk tier the lookup runs on a helper thread (bounded.BoundedCall) and the
scheduler waits at most the disk's `lookup_timeout_ms` (plus Redis's, when the run reaches it):
a stat on a hung network file system makes misses, not a stalled scheduler. Redis's own query is
bounded by its deadline (redis_node), so without a disk tier no thread is involved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvport.connectors.offloading.scheduler.bounded import BoundedCall
from kvport.connectors.offloading.scheduler.decisions import Observations, lookup_seconds
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import DISK, REDIS
from kvport.connectors.offloading.metrics import RedisLookupMetrics
from kvport.connectors.offloading.tiers.disk.lookup import DiskLookup

if TYPE_CHECKING:
    from kvport.connectors.offloading.tiers.redis.lookup import RedisLookup

REDIS_GRACE_S = 0.05  # past Redis's deadline: its watchdog's cut and the reply's handling


class LowerLookup:
    def __init__(self, config: OffloadingConfig, geometry: OffloadGeometry,
                 observations: Observations | None = None, removals: bool = False) -> None:
        """`removals`: someone reads removal events (the Redis tier then listens for its
        server's own removals, if its config asks: keyspace_events)."""
        self.observations = observations if observations is not None else Observations()
        namespace = geometry.namespace
        disk = config.disk_tier
        self.disk = DiskLookup(disk, namespace) if disk is not None else None
        self.redis: RedisLookup | None = None
        self._timeout_s = 0.0  # how long the scheduler waits for a lookup with a disk tier
        if disk is not None:
            self._timeout_s += self.disk.timeout_s
        if config.redis_tier is not None:
            # Imported here: redis-py is an optional dependency (kvport[redis]).
            from kvport.connectors.offloading.tiers.redis.lookup import RedisLookup

            self.redis = RedisLookup(config.redis_tier, namespace, listen=removals)
            self._timeout_s += config.redis_tier.lookup_timeout_ms / 1000.0 + REDIS_GRACE_S
        self._bounded = BoundedCall("disk-lookup") if disk is not None else None
        # The lower tiers top down; stores are written through to each of them.
        self.media = list(geometry.lower_media)

    def __bool__(self) -> bool:
        return bool(self.media)

    def find_run(self, keys: list[bytes],
                 stop: Callable[[bytes], bool]) -> list[tuple[bytes, str]]:
        """The leading run of `keys` some lower tier holds, each with the tier (DISK, REDIS) to
        promote it from. `stop(key)` True ends the run at that key (it is being written to the
        host tier). Bounded in time (module docstring): too late, it is empty (a miss)."""
        if self._bounded is None or not keys:
            return self._find_run(keys, stop)
        # `stop` reads the scheduler's manager: evaluated here, on the scheduler's thread.
        end = next((i for i, key in enumerate(keys) if stop(key)), len(keys))
        return self._bounded.run(lambda: self._find_run(keys[:end], lambda _: False),
                                 self._timeout_s, [])

    def _find_run(self, keys: list[bytes],
                  stop: Callable[[bytes], bool]) -> list[tuple[bytes, str]]:
        run: list[tuple[bytes, str]] = []
        in_redis: list[bool] | None = None  # for keys[first_asked:], asked at most once
        first_asked = 0
        disk_s = 0.0  # the disk's stats of this run, together
        for i, key in enumerate(keys):
            if stop(key):
                break
            if self.disk is not None:
                began = time.perf_counter()
                held = self.disk.exists(key)
                disk_s += time.perf_counter() - began
                if held:
                    run.append((key, DISK))
                    continue
            if self.redis is None:
                break
            if in_redis is None:
                in_redis, first_asked = self._redis_exists(keys[i:]), i
            if not in_redis[i - first_asked]:
                break
            run.append((key, REDIS))
        if self.disk is not None and keys:
            self.observations.add(lookup_seconds(DISK), disk_s)
        return run

    def _redis_exists(self, keys: list[bytes]) -> list[bool]:
        assert self.redis is not None, "a Redis lookup without a Redis tier"
        began = time.perf_counter()
        found = self.redis.exists(keys)
        self.observations.add(lookup_seconds(REDIS), time.perf_counter() - began)
        return found

    def find_each(self, keys: list[bytes]) -> dict[bytes, str]:
        """Of `keys`, those some lower tier holds, each with the tier (DISK, REDIS) to promote
        it from: not a run, each key on its own (a sliding window group's scattered blocks).
        Bounded in time as `find_run`."""
        if self._bounded is None or not keys:
            return self._find_each(keys)
        return self._bounded.run(lambda: self._find_each(keys), self._timeout_s, {})

    def _find_each(self, keys: list[bytes]) -> dict[bytes, str]:
        found: dict[bytes, str] = {}
        left = keys
        if self.disk is not None:
            began = time.perf_counter()
            found = {key: DISK for key in keys if self.disk.exists(key)}
            self.observations.add(lookup_seconds(DISK), time.perf_counter() - began)
            left = [key for key in keys if key not in found]
        if self.redis is not None and left:
            found.update((key, REDIS) for key, there in zip(left, self._redis_exists(left))
                         if there)
        return found

    def take_absent(self) -> dict[str, list[bytes]]:
        """Per lower tier, the keys its lookups since the last call found it does not hold
        (a tier that drops entries by itself, or another process's eviction, is learnt so)."""
        absent: dict[str, list[bytes]] = {}
        for medium, lookup in ((DISK, self.disk), (REDIS, self.redis)):
            if lookup is not None:
                keys = lookup.absent.take()
                if keys:
                    absent[medium] = keys
        return absent

    def redis_metrics(self) -> RedisLookupMetrics:
        """The Redis lookups' own counters (round trips, timeouts, ...)."""
        return self.redis.stats() if self.redis is not None else RedisLookupMetrics()

    def disk_metrics(self) -> tuple[int, int]:
        """(lookups that timed out, lookups skipped while one ran late)."""
        if self._bounded is None:
            return 0, 0
        return self._bounded.num_timeouts, self._bounded.num_skipped

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        if self._bounded is not None:
            self._bounded.close()
