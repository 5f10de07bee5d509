"""A Redis server a benchmark was given by URL: checked before anything runs, reached with the
Redis tier's client settings, and cleaned of exactly the keys the benchmark wrote (SCAN and DEL
of its own keys, never FLUSHDB or FLUSHALL on a server that may hold other data)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

from kvport.connectors.offloading.config import redacted_url

REDIS_INSTALL = "pip install 'kvport[redis]'"
# Every bench client's socket timeout: generous, so a slow moment of a shared machine fails no job.
REDIS_IO_TIMEOUT_S = 30.0
_DELETE_BATCH = 1000  # keys per DEL


def check_redis_url(url: str, name: str = "--redis-url") -> None:
    """ValueError naming `name` unless `url` is a redis:// or rediss:// URL (its password
    redacted in the message)."""
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"{name} must be a redis:// or rediss:// URL, got "
                         f"{redacted_url(url)!r}")


def require_redis_py(what: str) -> None:
    """ValueError saying how to install redis-py, which `what` needs, unless it is installed."""
    if importlib.util.find_spec("redis") is None:
        raise ValueError(f"{what} needs redis-py: {REDIS_INSTALL}")


def check_redis(url: str) -> None:
    """ValueError (a bad argument: exit 2) unless redis-py is installed and `url` answers PING."""
    require_redis_py("the Redis tier")
    check_redis_url(url)
    import redis

    client = redis_client(url, timeout_s=5.0)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ValueError(f"cannot reach Redis at {redacted_url(url)}: {exc}") from None
    finally:
        client.close()


def redis_client(url: str, timeout_s: float = REDIS_IO_TIMEOUT_S) -> Any:
    """A redis-py client with the tier's settings (no retries: a failed call fails, as the
    tier's do) and `timeout_s` for connecting and every reply."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0))


def delete_keys(client: Any, keys: Iterable[bytes]) -> None:
    """DEL exactly these keys, in batches."""
    todo = sorted(keys)
    for i in range(0, len(todo), _DELETE_BATCH):
        client.delete(*todo[i:i + _DELETE_BATCH])


def delete_matching(client: Any, pattern: bytes) -> int:
    """DEL every key matching `pattern` (SCAN, then DEL in batches); how many were deleted. The
    pattern must name keys of the benchmark's own alone (a random salt or tenant of its run)."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=_DELETE_BATCH):
        batch.append(key)
        if len(batch) == _DELETE_BATCH:
            deleted += int(client.delete(*batch))
            batch = []
    if batch:
        deleted += int(client.delete(*batch))
    return deleted
