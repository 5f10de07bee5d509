"""Redis tier rows of `kvport bench transfer` (only with `redis_url`).

`redis_mib` MiB of host slots of size S are stored to Redis (HOST->REDIS,
`RedisTier.store_from_host`) and loaded back into other slots (REDIS->HOST,
`RedisTier.load_to_host`), one call per job of `job_blocks` blocks, jobs one after another.
Baseline, on the same server in the same run: redis-py itself doing the same pipelined SETs and
GETs of the same payloads in the same job batches (one pipeline per job, transaction=False, the
tier's client settings), without the tier's own work (the value's header and its checksum, the
copy of the slot into the value, the check of every value read and the copy into the slot).
Each round runs both sides back to back (the order alternates between rounds, so drift hits
both), stores first, then loads; the keys are deleted before every round, so every SET writes a
new key. Reported: GiB/s (median of `repeats`) and the ratio tier / redis-py (median of the
rounds' ratios). Keys: the tier's format (`RedisTier.key`) under a namespace and tenant salt of
this run alone (random), so they never meet real KV; only those keys are deleted (never
FLUSHDB/FLUSHALL), also when the run fails.
"""

from __future__ import annotations

import dataclasses

import hashlib
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvport.bench.common.redis import REDIS_IO_TIMEOUT_S, delete_keys, redis_client
from kvport.bench.transfer.config import MIB, TransferBenchConfig
from kvport.bench.transfer.rows import RedisDirection, RedisRow, RedisRows, RedisServerFacts
from kvport.bench.transfer.timing import gib_s
from kvport.connectors.offloading.config import RedisTierConfig, redacted_url
from kvport.connectors.offloading.mediums import HostBlocks, RedisBlocks
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.tiers.redis.tier import RedisTier

REDIS_NAMESPACE = b"kvport-bench-transfer"  # + the side and the size: no real KV namespace
DIRECTIONS = ("store", "load")


def bench_redis(cfg: TransferBenchConfig) -> RedisRows:
    """The Redis tier's rows and the server's facts; every key written is deleted at the end."""
    assert cfg.redis_url is not None, "the config's rows need a URL"
    client = redis_client(cfg.redis_url)
    written: set[bytes] = set()  # every key a SET may have created, added before the SET
    try:
        facts = server_facts(client, cfg.redis_url)
        # this run's tenant salt: no other run, and no engine, reads or writes these keys
        salt = f"kvport-bench-{secrets.token_hex(8)}"
        rows = tuple(RedisBench(cfg, cfg.redis_url, size, client, salt, written).row()
                     for size in cfg.sizes())
    finally:
        try:
            delete_keys(client, written)
            written.clear()
        finally:
            client.close()
    return RedisRows(facts, rows)


def server_facts(client: Any, url: str) -> RedisServerFacts:
    """Version and memory policy of the server (RuntimeError naming the URL if it does not
    answer, or is a cluster node)."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    try:
        info = client.info("server")
    except redis.RedisError as exc:
        raise RuntimeError(f"cannot reach Redis at {redacted_url(url)}: {exc}") from None
    if info.get("redis_mode") == "cluster":
        raise RuntimeError("kvport bench transfer measures one Redis server; "
                           f"{redacted_url(url)} is a cluster node")
    maxmemory, policy = None, None
    try:  # an ACL user may not run CONFIG
        config = client.config_get("maxmemory*")
        maxmemory, policy = int(config.get("maxmemory", 0)), config.get("maxmemory-policy")
    except redis.RedisError:
        pass
    return RedisServerFacts(redacted_url(url), info.get("redis_version"), maxmemory, policy,
                            redis.__version__, bool(HIREDIS_AVAILABLE))


class RedisBench:
    """One value size: `redis_mib` MiB of host slots stored from `host` and loaded into `back`,
    by the tier and by redis-py, keys of both sides noted in `written` before they are set."""

    def __init__(self, cfg: TransferBenchConfig, url: str, size: int, client: Any, salt: str,
                 written: set[bytes]) -> None:
        self.cfg, self.size, self.client, self.written = cfg, size, client, written
        self.n = max(1, cfg.redis_mib * MIB // size)
        self.num_bytes = self.n * size
        self.host, self.back = HostTier(self.n, size), HostTier(self.n, size)
        gen = torch.Generator().manual_seed(cfg.seed + size)
        self.host.buffer.copy_(torch.randint(0, 256, self.host.buffer.shape, dtype=torch.uint8,
                                             generator=gen))
        self.tier = RedisTier(RedisTierConfig(url, tenant_salt=salt,
                                              io_timeout_s=REDIS_IO_TIMEOUT_S),
                              REDIS_NAMESPACE + b"|tier|%d" % size)
        keys = [hashlib.sha256(b"%d/%d" % (size, i)).digest() for i in range(self.n)]
        self.tier_keys = {self.tier.key(k) for k in keys}
        # redis-py's keys: the tier's format and length, under a namespace of their own
        naming = RedisTier(RedisTierConfig(url, tenant_salt=salt),
                           REDIS_NAMESPACE + b"|redis-py|%d" % size)
        self.base_keys = [naming.key(k) for k in keys]
        naming.close()
        self.payloads = [self.host.slot(i).numpy().data for i in range(self.n)]  # no copy
        self.jobs = [(list(range(i, min(self.n, i + cfg.job_blocks))), keys[i:i + cfg.job_blocks])
                     for i in range(0, self.n, cfg.job_blocks)]

    def row(self) -> RedisRow:
        try:
            times = self._rounds()
        finally:
            self.tier.close()
        store, load = (self._direction(times[d]) for d in DIRECTIONS)
        return RedisRow(self.size, self.n, self.cfg.job_blocks, self.num_bytes, store, load,
                        dataclasses.asdict(self.tier.stats.snapshot()))

    def _rounds(self) -> dict[str, dict[str, list[float]]]:
        """Seconds per direction and side; round 0 is a warm-up (connections, first
        allocations) whose loaded slots must equal the stored ones."""
        sides: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
            "tier": (self._tier_store, self._tier_load),
            "redis_py": (self._base_store, self._base_load)}
        times: dict[str, dict[str, list[float]]] = {d: {side: [] for side in sides}
                                                    for d in DIRECTIONS}
        for r in range(self.cfg.repeats + 1):
            self._clear()
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for d, direction in enumerate(DIRECTIONS):
                for side in order:
                    start = time.perf_counter()
                    sides[side][d]()
                    if r > 0:
                        times[direction][side].append(time.perf_counter() - start)
            if r == 0 and not torch.equal(self.back.buffer, self.host.buffer):
                raise RuntimeError(f"Redis tier bench, {self.size} B values: the loaded slots "
                                   f"differ from the stored ones")
        return times

    def _direction(self, by_side: dict[str, list[float]]) -> RedisDirection:
        tier_s, base_s = by_side["tier"], by_side["redis_py"]
        return RedisDirection(gib_s(self.num_bytes, statistics.median(tier_s)),
                              gib_s(self.num_bytes, statistics.median(base_s)),
                              statistics.median(b / t for t, b in zip(tier_s, base_s)),
                              tier_s, base_s)

    def _check(self, what: str, failed: list[int]) -> None:
        if failed:
            raise RuntimeError(
                f"Redis tier bench, {self.size} B values: {what} failed for {len(failed)} "
                f"value(s); tier counters {self.tier.stats.snapshot()}. A full Redis refuses or "
                f"evicts them: give it more maxmemory than 2 x --redis-mib "
                f"({2 * self.cfg.redis_mib} MiB), or pass a smaller --redis-mib")

    def _tier_store(self) -> None:
        for slots, ks in self.jobs:
            done = self.tier.store_from_host(self.host, HostBlocks(slots), RedisBlocks(ks))
            self._check("store", done.failed_indices)

    def _tier_load(self) -> None:
        for slots, ks in self.jobs:
            done = self.tier.load_to_host(self.back, RedisBlocks(ks), HostBlocks(slots))
            self._check("load", done.failed_indices)

    def _base_store(self) -> None:
        for slots, _ in self.jobs:
            pipe = self.client.pipeline(transaction=False)
            for s in slots:
                pipe.execute_command("SET", self.base_keys[s], self.payloads[s])
            replies = pipe.execute(raise_on_error=False)
            self._check("redis-py SET", [i for i, r in enumerate(replies)
                                         if r is not True and r != b"OK"])

    def _base_load(self) -> None:
        for slots, _ in self.jobs:
            pipe = self.client.pipeline(transaction=False)
            for s in slots:
                pipe.execute_command("GET", self.base_keys[s])
            replies = pipe.execute(raise_on_error=False)
            self._check("redis-py GET", [i for i, r in enumerate(replies)
                                         if not isinstance(r, bytes) or len(r) != self.size])

    def _clear(self) -> None:
        delete_keys(self.client, self.written)
        self.written.clear()
        self.written.update(self.tier_keys)  # the next round's SETs create them again
        self.written.update(self.base_keys)
