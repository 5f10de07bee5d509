"""Redis tier rows of `kvport bench transfer` (only with `redis_url`).

`redis_mib` MiB of host slots of size S are stored to Redis (HOST->REDIS,
`RedisTier.store_from_host`) and loaded back into other slots (REDIS->HOST,
`RedisTier.load_to_host`), one call per job of `job_blocks` blocks, jobs one after another.
Baseline, on the same server in the same run: redis-py itself doing the same pipelined SETs and
GETs of the same payloads in the same job batches (one pipeline per job, transaction=False, the
tier's client settings), without the tier's own work (the 80-byte header and its xxh3 checksum,
the copy of the slot into the value, the check of every value read and the copy into the slot).
Each round runs both sides back to back (the order alternates between rounds, so drift hits
both), stores first, then loads; the keys are deleted before every round, so every SET writes a
new key. Reported: GiB/s (median of `repeats`) and the ratio tier / redis-py (median of the
rounds' ratios). Keys: the tier's format (`kvport:<namespace digest>:<key hex>`) under a
namespace and tenant salt of this run alone (random), so they never meet real KV; only those
keys are deleted (never FLUSHDB/FLUSHALL), also when the run fails.
"""

from __future__ import annotations

import dataclasses

import importlib.util
import secrets
import statistics
import time
from typing import Any

from kvport.bench.transfer_common import MIB, REDIS_INSTALL, TransferBenchConfig, gib_s
from kvport.connectors.offloading.config import redacted_url

# Both sides' socket timeout: generous, so a slow moment of a shared machine fails no job.
REDIS_IO_TIMEOUT_S = 30.0
REDIS_NAMESPACE = b"kvport-bench-transfer"  # + the side and the size: no real KV namespace


def check_redis(url: str) -> None:
    """ValueError (a bad argument: exit 2) unless redis-py is installed and `url` answers PING."""
    if importlib.util.find_spec("redis") is None:
        raise ValueError(f"the Redis tier needs redis-py: {REDIS_INSTALL}")
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"--redis-url must be a redis:// or rediss:// URL, got "
                         f"{redacted_url(url)!r}")
    import redis

    client = _redis_client(url, timeout_s=5.0)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ValueError(f"cannot reach Redis at {redacted_url(url)}: {exc}") from None
    finally:
        client.close()


def _redis_client(url: str, timeout_s: float = REDIS_IO_TIMEOUT_S) -> Any:
    """A redis-py client with the tier's settings (no retries), the bench's timeout."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0))


def _redis_server_facts(client: Any, url: str) -> dict[str, Any]:
    """Version and memory policy of the server (ConnectionError: a message naming the URL)."""
    import redis

    try:
        info = client.info("server")
    except redis.RedisError as exc:
        raise RuntimeError(f"cannot reach Redis at {redacted_url(url)}: {exc}") from None
    if info.get("redis_mode") == "cluster":
        raise RuntimeError("kvport bench transfer measures one Redis server; "
                           f"{redacted_url(url)} is a cluster node")
    from redis.utils import HIREDIS_AVAILABLE

    facts: dict[str, Any] = {"url": redacted_url(url), "redis_version": info.get("redis_version"),
                             "maxmemory": None, "maxmemory_policy": None,
                             # both sides parse replies with it: hiredis (C) or redis-py's own
                             "redis_py_version": redis.__version__,
                             "hiredis": bool(HIREDIS_AVAILABLE)}
    try:  # an ACL user may not run CONFIG
        config = client.config_get("maxmemory*")
        facts["maxmemory"] = int(config.get("maxmemory", 0))
        facts["maxmemory_policy"] = config.get("maxmemory-policy")
    except redis.RedisError:
        pass
    return facts


def _delete_keys(client: Any, keys: set[bytes]) -> None:
    """DEL exactly these keys (pipelined, in chunks): never a FLUSHDB on a server we were given."""
    todo = sorted(keys)
    for i in range(0, len(todo), 1000):
        client.delete(*todo[i:i + 1000])
    keys.clear()


def bench_redis(cfg: TransferBenchConfig) -> dict[str, Any]:
    """The Redis tier's rows and the server's facts; every key written is deleted at the end."""
    assert cfg.redis_url is not None
    client = _redis_client(cfg.redis_url)
    written: set[bytes] = set()  # every key a SET may have created, added before the SET
    try:
        facts = _redis_server_facts(client, cfg.redis_url)
        # this run's tenant salt: no other run, and no engine, reads or writes these keys
        salt = f"kvport-bench-{secrets.token_hex(8)}"
        rows = [_redis_row(cfg, size, client, salt, written) for size in cfg.sizes()]
    finally:
        try:
            _delete_keys(client, written)
        finally:
            client.close()
    return {"server": facts, "rows": rows}


def _redis_row(cfg: TransferBenchConfig, size: int, client: Any, salt: str,
               written: set[bytes]) -> dict[str, Any]:
    import hashlib

    import torch

    from kvport.connectors.offloading.config import RedisTierConfig
    from kvport.connectors.offloading.mediums import HostBlocks, RedisBlocks
    from kvport.connectors.offloading.tiers.host.tier import HostTier
    from kvport.connectors.offloading.tiers.redis.client import RedisKeyspace
    from kvport.connectors.offloading.tiers.redis.tier import RedisTier

    assert cfg.redis_url is not None
    n = max(1, cfg.redis_mib * MIB // size)
    num_bytes = n * size
    host, back = HostTier(n, size), HostTier(n, size)  # stored from host, loaded into back
    gen = torch.Generator().manual_seed(cfg.seed + size)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8, generator=gen))
    tier = RedisTier(RedisTierConfig(cfg.redis_url, tenant_salt=salt,
                                     io_timeout_s=REDIS_IO_TIMEOUT_S),
                     REDIS_NAMESPACE + b"|tier|%d" % size)
    # redis-py's keys: the tier's format and length, under a namespace of their own
    base = RedisKeyspace.build(RedisTierConfig(cfg.redis_url, tenant_salt=salt),
                               REDIS_NAMESPACE + b"|redis-py|%d" % size)
    keys = [hashlib.sha256(b"%d/%d" % (size, i)).digest() for i in range(n)]
    tier_keys = {tier.key(k) for k in keys}
    base_keys = [base.key(k) for k in keys]
    payloads = [host.slot(i).numpy().data for i in range(n)]  # the slots' bytes, no copy
    jobs = [(list(range(i, min(n, i + cfg.job_blocks))), keys[i:i + cfg.job_blocks])
            for i in range(0, n, cfg.job_blocks)]

    def check(what: str, failed: list[int]) -> None:
        if failed:
            raise RuntimeError(
                f"Redis tier bench, {size} B values: {what} failed for {len(failed)} value(s); "
                f"tier counters {tier.stats.snapshot()}. A full Redis refuses or evicts them: "
                f"give it more maxmemory than 2 x --redis-mib ({2 * cfg.redis_mib} MiB), "
                f"or pass a smaller --redis-mib")

    def tier_store() -> None:
        for slots, ks in jobs:
            done = tier.store_from_host(host, HostBlocks(slots), RedisBlocks(ks))
            check("store", done.failed_indices)

    def tier_load() -> None:
        for slots, ks in jobs:
            done = tier.load_to_host(back, RedisBlocks(ks), HostBlocks(slots))
            check("load", done.failed_indices)

    def base_store() -> None:
        for slots, _ in jobs:
            pipe = client.pipeline(transaction=False)
            for s in slots:
                pipe.execute_command("SET", base_keys[s], payloads[s])
            replies = pipe.execute(raise_on_error=False)
            check("redis-py SET", [i for i, r in enumerate(replies) if r is not True
                                   and r != b"OK"])

    def base_load() -> None:
        for slots, _ in jobs:
            pipe = client.pipeline(transaction=False)
            for s in slots:
                pipe.execute_command("GET", base_keys[s])
            replies = pipe.execute(raise_on_error=False)
            check("redis-py GET", [i for i, r in enumerate(replies)
                                   if not isinstance(r, bytes) or len(r) != size])

    def clear() -> None:
        _delete_keys(client, written)
        written.update(tier_keys)  # the next round's SETs create them again
        written.update(base_keys)

    sides = {"tier": (tier_store, tier_load), "redis_py": (base_store, base_load)}
    times: dict[str, dict[str, list[float]]] = {d: {side: [] for side in sides}
                                                for d in ("store", "load")}
    try:
        for r in range(cfg.repeats + 1):  # round 0: warm-up (connections, first allocations)
            clear()
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for d, direction in enumerate(("store", "load")):
                for side in order:
                    start = time.perf_counter()
                    sides[side][d]()
                    if r > 0:
                        times[direction][side].append(time.perf_counter() - start)
            if r == 0 and not torch.equal(back.buffer, host.buffer):
                raise RuntimeError(f"Redis tier bench, {size} B values: the loaded slots differ "
                                   f"from the stored ones")
    finally:
        tier.close()
    row: dict[str, Any] = {"offload_block_bytes": size, "num_values": n,
                           "job_blocks": cfg.job_blocks, "bytes_per_transfer": num_bytes}
    for direction, by_side in times.items():
        tier_s, base_s = by_side["tier"], by_side["redis_py"]
        row[direction] = {
            "tier_gib_s": gib_s(num_bytes, statistics.median(tier_s)),
            "redis_py_gib_s": gib_s(num_bytes, statistics.median(base_s)),
            # tier / redis-py bandwidth per round (both measured back to back), median
            "ratio": statistics.median(b / t for t, b in zip(tier_s, base_s)),
            "tier_s": tier_s, "redis_py_s": base_s}
    row["tier_stats"] = dataclasses.asdict(tier.stats.snapshot())
    return row
