"""The scheduler half's view of the tiers below host memory: which keys the disk tier and the Redis
tier hold, asked at scheduling time.

The disk tier is asked per key (`DiskLocation.exists`: one stat, the file system is the truth,
so entries other processes wrote are found). Redis is asked once per request, for every key the
disk does not settle, in one batched round trip with a short timeout (`RedisLookup`); a timeout,
an error or a Redis that is down answers "none", so the request computes those blocks instead of
waiting. A key is taken from the highest tier that holds it (disk before Redis: a local read is
cheaper than a network one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.mediums import DISK, REDIS
from kvport.connectors.offloading.tiers.disk_format import DiskLocation

if TYPE_CHECKING:
    from kvport.connectors.offloading.tiers.redis_client import RedisLookup


class LowerLookup:
    def __init__(self, config: OffloadingConfig, namespace: bytes) -> None:
        disk = config.disk_tier
        self.disk = DiskLocation(disk.root_dir, namespace) if disk is not None else None
        self.redis: RedisLookup | None = None
        if config.redis_tier is not None:
            # Imported here: redis-py is an optional dependency (kvport[redis]).
            from kvport.connectors.offloading.tiers.redis_client import RedisLookup

            self.redis = RedisLookup(config.redis_tier, namespace)
        # The lower tiers top down; stores are written through to each of them.
        self.media = [m for m, t in ((DISK, self.disk), (REDIS, self.redis)) if t is not None]

    def __bool__(self) -> bool:
        return bool(self.media)

    def find_run(self, keys: list[bytes],
                 stop: Callable[[bytes], bool]) -> list[tuple[bytes, str]]:
        """The leading run of `keys` some lower tier holds, each with the tier (DISK, REDIS) to
        promote it from. `stop(key)` True ends the run at that key (it is being written to the
        host tier)."""
        run: list[tuple[bytes, str]] = []
        in_redis: list[bool] | None = None  # for keys[first_asked:], asked at most once
        first_asked = 0
        for i, key in enumerate(keys):
            if stop(key):
                break
            if self.disk is not None and self.disk.exists(key):
                run.append((key, DISK))
                continue
            if self.redis is None:
                break
            if in_redis is None:
                in_redis, first_asked = self.redis.exists(keys[i:]), i
            if not in_redis[i - first_asked]:
                break
            run.append((key, REDIS))
        return run

    def stats(self, medium: str) -> dict[str, float]:
        """The lookups' own counters of one tier (Redis: round trips, timeouts, ...)."""
        if medium == REDIS and self.redis is not None:
            return {f"lookup_{name}": value for name, value in self.redis.stats().items()}
        return {}

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
