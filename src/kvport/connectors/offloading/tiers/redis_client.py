"""The Redis tier's connection and its scheduler-side lookup (no torch, no host tier here).

Keys: `kvport:<namespace digest hex[:16]>:<key hex>`; the namespace is the geometry's (model hash
root, dtype, layout, block geometry: `OffloadGeometry.disk_namespace`) plus the tenant salt. No
hash tags: on a cluster the keys spread over every node's slots. Each value's header holds the
full namespace digest (redis_tier), so the 64 bits in the name need only keep tenants apart.

An operation is a batch of one-key commands: one pipeline (one round trip, counted in
`round_trips` when attempted) per server, per node holding a key on a cluster. We group keys by
the client's slot map rather than use redis-py's cluster pipeline, whose recovery resends failed
commands one by one, each waiting out the timeout again. redis-py's retries are off: a failure is
reported at once, and the caller takes it as a miss or an unwritten block.

Down state: a connection error or timeout marks the connection down for a backoff (0.2 s,
doubling up to 5 s). While down, calls fail at once without touching the network
(`skipped_down`); once the backoff elapsed one call probes (others still skip) and its success
ends the down state. Without it every scheduler step would wait out a timeout while Redis is
gone. A cluster shares one state (a dead node costs the timeout once per backoff); a failed node
or a MOVED reply also rebuilds the cluster client, which reloads the slot map.

Secrets: credentials are taken out of the URL and passed to redis-py separately (the env vars
named by `username_env`/`password_env` win), so no message carries them; our log lines use the
redacted URL and scrub the password from error texts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit, urlunsplit

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError
    from redis.retry import Retry
except ImportError as exc:  # the tier is configured (only then is this module imported)
    raise ImportError("the Redis tier needs redis-py: pip install 'kvport[redis]'") from exc

from kvport.connectors.offloading.config import RedisTierConfig, redacted_url

logger = logging.getLogger(__name__)

NAMESPACE_VERSION = b"kvport-redis-v1"
KEY_PREFIX = b"kvport:"
BACKOFF_START_S = 0.2
BACKOFF_CAP_S = 5.0
# Cluster replies that mean the client's slot map is stale (the positions fail).
TOPOLOGY_ERRORS = (MovedError, AskError, TryAgainError, ClusterDownError)

Command = tuple[Any, ...]  # (name, key, *args): every command names one key


def redis_namespace(geometry_namespace: bytes, tenant_salt: str) -> bytes:
    """The key namespace: the geometry's namespace plus the tenant salt. Length-prefixed, so no
    choice of salt can make two different (geometry, salt) pairs collide."""
    return b"|".join([NAMESPACE_VERSION, str(len(geometry_namespace)).encode(),
                      geometry_namespace, tenant_salt.encode()])


def namespace_digest(geometry_namespace: bytes, tenant_salt: str) -> bytes:
    return hashlib.sha256(redis_namespace(geometry_namespace, tenant_salt)).digest()


def value_key(namespace_digest: bytes, key: bytes) -> bytes:
    return KEY_PREFIX + namespace_digest.hex()[:16].encode() + b":" + key.hex().encode()


class RedisUnavailable(Exception):
    """The result at a position that was not attempted (down) or whose round trip failed."""


class _Adds(Protocol):
    def add(self, **deltas: float) -> None: ...


class Counters:
    """Thread-safe named counters with TierStats' `add` and `snapshot`."""

    def __init__(self, *names: str) -> None:
        self._values = dict.fromkeys(names, 0.0)
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._values[name] += value

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


_DOWN = RedisUnavailable("Redis is down (backing off)")


class RedisConnection:
    """A lazily built redis-py client with a down state. Construction reads the credentials (a
    named env var that is unset is a ValueError) and never touches the network."""

    def __init__(self, config: RedisTierConfig, *, timeout_s: float | None = None,
                 stats: _Adds | None = None) -> None:
        self.config = config
        self.url = redacted_url(config.url)  # for messages
        self.timeout_s = config.io_timeout_s if timeout_s is None else timeout_s
        self.stats: _Adds = stats if stats is not None else Counters(
            "round_trips", "timeouts", "errors", "skipped_down")
        self._bare_url, username, password = _split_credentials(config.url)
        username = _env(config, "username_env", "the Redis ACL user name") or username
        self._password = _env(config, "password_env", "the Redis password") or password
        self._username = username
        self._client: Any = None  # redis.Redis | RedisCluster, built on first use
        self._lock = threading.Lock()
        self._failures = 0  # consecutive failed attempts; > 0: down
        self._down_until = 0.0  # time.monotonic() before which calls are skipped
        self._probing = False  # one call is trying while down

    def __repr__(self) -> str:
        return f"RedisConnection({self.url!r}, cluster={self.config.cluster})"

    # --- client ---------------------------------------------------------------------------------

    def _build(self) -> Any:
        kw: dict[str, Any] = {
            "username": self._username, "password": self._password,
            "socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s,
            # No retries inside redis-py: a failure is reported at once; the down state paces.
            "retry": Retry(NoBackoff(), 0)}
        if self._bare_url.startswith("rediss://") and self.config.tls_ca_file:
            kw["ssl_ca_certs"] = self.config.tls_ca_file
        if self.config.cluster:
            return RedisCluster.from_url(self._bare_url, **kw)  # fetches the slot map
        return redis.Redis.from_url(self._bare_url, **kw)

    def _get_client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._build()
            return self._client

    def _reset_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    def close(self) -> None:
        """Close the sockets (never waits on the server). A later call reconnects."""
        self._reset_client()

    # --- down state -----------------------------------------------------------------------------

    def _admit(self) -> str | None:
        """None: skip (down); "probe": the one attempt after a backoff; "call": up."""
        with self._lock:
            if self._failures == 0:
                return "call"
            if self._probing or time.monotonic() < self._down_until:
                return None
            self._probing = True
            return "probe"

    def _count(self, exc: BaseException) -> None:
        timeout = isinstance(exc, (redis.TimeoutError, TimeoutError))
        self.stats.add(**{"timeouts" if timeout else "errors": 1})

    def _up(self) -> None:
        with self._lock:
            recovered = self._failures > 0
            self._failures = 0
        if recovered:
            logger.info("Redis tier %s reachable again", self.url)

    def _down(self, exc: BaseException) -> None:
        with self._lock:
            self._failures += 1
            backoff = min(BACKOFF_CAP_S, BACKOFF_START_S * 2 ** (self._failures - 1))
            self._down_until = time.monotonic() + backoff
            first = self._failures == 1
        (logger.warning if first else logger.debug)(
            "Redis tier %s unavailable (%s: %s); next attempt in %.1f s", self.url,
            type(exc).__name__, self._scrub(str(exc)), backoff)

    def _scrub(self, text: str) -> str:
        return text.replace(self._password, "***") if self._password else text

    @property
    def down(self) -> bool:
        with self._lock:
            return self._failures > 0

    # --- commands -------------------------------------------------------------------------------

    def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Run one-key commands as pipelines (one per node), without raising for Redis problems:
        each position holds its reply, the error reply (a ResponseError) or RedisUnavailable."""
        if not commands:
            return []
        admitted = self._admit()
        if admitted is None:
            self.stats.add(skipped_down=1)
            return [_DOWN] * len(commands)
        try:
            return self._execute(commands)
        finally:
            if admitted == "probe":
                with self._lock:
                    self._probing = False

    def _execute(self, commands: Sequence[Command]) -> list[Any]:
        try:
            batches = self._batches(self._get_client(), commands)
        except (redis.RedisError, OSError) as exc:
            self._count(exc)
            self._down(exc)
            self._reset_client()  # e.g. a cluster client that could not load its slot map
            return [RedisUnavailable(self._scrub(str(exc)))] * len(commands)
        results: list[Any] = [None] * len(commands)
        failed = [err for node, positions in batches
                  if (err := self._run_batch(node, commands, positions, results)) is not None]
        if failed:
            self._down(failed[0])  # once per call, however many nodes failed
        else:
            self._up()
        # A node failed (a failover may follow) or answered MOVED/ASK: the client's slot map may
        # be stale; the next call builds a client, which reloads it.
        if self.config.cluster and (failed or any(isinstance(r, TOPOLOGY_ERRORS)
                                                  for r in results)):
            self._reset_client()
        return results

    def _batches(self, client: Any, commands: Sequence[Command]) -> list[tuple[Any, list[int]]]:
        """(client of one node, positions) groups: all positions for a single server."""
        if not self.config.cluster:
            return [(client, list(range(len(commands))))]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, command in enumerate(commands):
            node = client.get_node_from_key(command[1])
            groups.setdefault(node.name, (client.get_redis_connection(node), []))[1].append(i)
        return list(groups.values())

    def _run_batch(self, node: Any, commands: Sequence[Command], positions: list[int],
                   results: list[Any]) -> BaseException | None:
        """One pipeline to one server; fills `results` at `positions`; the failure, if any."""
        pipe = node.pipeline(transaction=False)
        for i in positions:
            pipe.execute_command(*commands[i])
        self.stats.add(round_trips=1)
        try:
            replies = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as exc:
            self._count(exc)
            failure = RedisUnavailable(self._scrub(str(exc)))
            for i in positions:
                results[i] = failure
            return exc
        for i, reply in zip(positions, replies):
            results[i] = reply
        return None


class RedisLookup:
    """The scheduler's question "which of these keys does Redis hold?", answered in one round
    trip (per node) within `lookup_timeout_ms`; any problem answers "none" (a miss)."""

    def __init__(self, config: RedisTierConfig, namespace: bytes) -> None:
        self.namespace_digest = namespace_digest(namespace, config.tenant_salt)
        self._stats = Counters("lookups", "keys_queried", "keys_found", "round_trips", "timeouts",
                               "errors", "skipped_down")
        self._conn = RedisConnection(config, timeout_s=config.lookup_timeout_ms / 1000.0,
                                     stats=self._stats)

    def exists(self, keys: list[bytes]) -> list[bool]:
        replies = self._conn.execute([("EXISTS", value_key(self.namespace_digest, k))
                                      for k in keys])
        found = [r == 1 for r in replies]  # an exception at a position: a miss
        self._stats.add(lookups=1, keys_queried=len(keys), keys_found=sum(found))
        return found

    def stats(self) -> dict[str, float]:
        return self._stats.snapshot()

    def close(self) -> None:
        self._conn.close()


def _split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(url without user:password@, user, password): redis-py would let the URL's credentials
    win over explicit ones, and keep them where a message might show them."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    creds, _, hostport = parts.netloc.rpartition("@")
    user, sep, password = creds.partition(":")
    bare = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return bare, unquote(user) or None, unquote(password) if sep else None


def _env(config: RedisTierConfig, field: str, what: str) -> str | None:
    name: str | None = getattr(config, field)
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"Redis tier {redacted_url(config.url)}: {field} names the environment "
                         f"variable {name}, which is not set; set {name} to {what} (or remove "
                         f"{field} from the tier's config)")
    return value


def _close_quietly(client: Any) -> None:
    try:
        client.close()  # closes sockets; sends nothing
    except Exception:  # closing a broken client must not raise
        logger.debug("closing the Redis client failed", exc_info=True)
