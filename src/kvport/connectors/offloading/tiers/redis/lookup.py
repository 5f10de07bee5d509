"""Scheduler side: which keys the Redis tier holds. One batched EXISTS per request and server,
within `lookup_timeout_ms` in all; a timeout, an error or a Redis that is down answers "none",
so the request computes those blocks instead of waiting. The keys Redis says it does not hold,
and with `keyspace_events` those it removes by itself (notifications.py), are kept for the
scheduler half's removal events (`absent`)."""

from __future__ import annotations

import dataclasses

from kvport.connectors.offloading.config import RedisTierConfig
from kvport.connectors.offloading.metrics import Counters, RedisLookupMetrics
from kvport.connectors.offloading.tiers import DroppedKeys
from kvport.connectors.offloading.tiers.redis.client import RedisConnection, RedisKeyspace
from kvport.connectors.offloading.tiers.redis.notifications import RemovalListener


class RedisLookup:
    """The scheduler's question "which of these keys does Redis hold?", answered in one round
    trip per server within `lookup_timeout_ms` in all; any problem answers "none" (a miss)."""

    def __init__(self, config: RedisTierConfig, namespace: bytes, listen: bool = False) -> None:
        """`listen`: removal events are read; with `keyspace_events`, subscribe to Redis's."""
        self.keyspace = RedisKeyspace.build(config, namespace)
        self.namespace_digest = self.keyspace.namespace_digest
        self._stats = Counters(RedisLookupMetrics)
        self._conn = RedisConnection(config, timeout_s=config.lookup_timeout_ms / 1000.0,
                                     stats=self._stats)
        self.absent = DroppedKeys()  # keys Redis answered it does not hold (removal events)
        self.listener: RemovalListener | None = None
        if listen and config.keyspace_events:
            self.listener = RemovalListener(self._conn, self.keyspace, self.absent)

    def exists(self, keys: list[bytes]) -> list[bool]:
        replies = self._conn.execute([("EXISTS", self.keyspace.key(k)) for k in keys])
        found = [r == 1 for r in replies]  # an exception at a position: a miss
        # Only a reply of 0 says "gone"; an error or a timeout says nothing.
        self.absent.add([k for k, r in zip(keys, replies) if type(r) is int and r == 0])
        self._stats.add(lookups=1, keys_queried=len(keys), keys_found=sum(found))
        return found

    def stats(self) -> RedisLookupMetrics:
        return dataclasses.replace(self._stats.snapshot(), map_refreshes=self._conn.map_refreshes)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self._conn.close()
