"""The Redis tier's keys and its connection (one server, or a cluster's servers), for the tier
(tier.py) and the scheduler's lookup (lookup.py). No torch and no host tier here.

Keys (`RedisKeyspace`): `kvport:[<tenant>:]<namespace digest hex[:16]>:<key hex>`. The namespace
is the geometry's (model hash root, dtype, layout, block geometry) plus the format version, the
tenant salt and the MAC key's id, so engines that must not share KV never meet under one name.
The tenant (a name) comes first so that an ACL key pattern, `~kvport:<tenant>:*`, scopes a
tenant's keys; the digest's 64 bits keep namespaces apart within it. Each value's header holds
the full namespace digest (value_format), checked before anything is decoded. No hash tags: on a
cluster the keys spread over every server's slots.

An operation (`RedisConnection.execute`) is a batch of one-key commands: one pipeline (one round
trip, counted in `round_trips`) per server holding a key, the servers' pipelines at once, each
within the call's deadline (redis_node: the whole round trip, not each socket read). Nothing
raises: a position holds its reply, its error reply, or RedisUnavailable. On a cluster a MOVED
reply moves its slot and the command goes to the new owner within the same call, an ASK reply
sends it once to the importing server behind ASKING (redis_cluster); a second redirect is a miss.

Down state: per server (redis_node.Health); a cluster's slot map has one too (no server gave a
map: every call skips at once until the backoff ends). A dead master costs its slots' hits only.

Secrets: credentials are taken out of the URL and passed to redis-py separately (the env vars
named by `username_env`/`password_env` win), the tenant salt and the MAC key may come from env
vars too, and no message carries any of them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

try:
    import redis  # noqa: F401  (the tier is configured: only then is this module imported)
    from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError
except ImportError as exc:
    raise ImportError("the Redis tier needs redis-py: pip install 'kvport[redis]'") from exc

from kvport.connectors.offloading.config import RedisTierConfig, redacted_url
from kvport.connectors.offloading.metrics import Counters, RedisLookupMetrics
from kvport.connectors.offloading.tiers.redis.cluster import SlotMap
from kvport.connectors.offloading.tiers.redis.node import (
    REDIS_FAILURES, Command, DeadlineExceeded, RedisNode, node_pool, url_pool,
)
from kvport.connectors.offloading.tiers.value_format import (
    FORMAT_VERSION, ValueCodec, derive_mac_key, mac_key_id,
)

logger = logging.getLogger(__name__)

NAMESPACE_VERSION = b"kvport-redis-v1"
KEY_PREFIX = b"kvport:"
# Cluster replies that mean the slot map is stale (those positions fail unless followed).
TOPOLOGY_ERRORS = (MovedError, AskError, TryAgainError, ClusterDownError)
MAX_PARALLEL_NODES = 8  # servers one call reaches at once (the others wait for a thread)
THREAD_GRACE_S = 0.5  # past the deadline, how long a call waits for a cut-off server's thread


def redis_namespace(geometry_namespace: bytes, tenant_salt: str, key_id: bytes = b"") -> bytes:
    """The key namespace: the geometry's, the value format, the tenant salt and the MAC key's
    id. Length-prefixed, so no choice of salt can make two different tuples collide."""
    parts = [NAMESPACE_VERSION, b"format%d" % FORMAT_VERSION, geometry_namespace,
             tenant_salt.encode(), key_id]
    return b"|".join(b"%d:%s" % (len(p), p) for p in parts)


@dataclass(frozen=True)
class RedisKeyspace:
    """Where one connector's values live on Redis, and how they are checked."""

    namespace_digest: bytes
    prefix: bytes  # kvport:[tenant:]<ns16>:
    codec: ValueCodec

    @classmethod
    def build(cls, config: RedisTierConfig, geometry_namespace: bytes) -> RedisKeyspace:
        """Reads the salt and the MAC key from their env vars if named (unset: ValueError)."""
        salt = _env(config, "tenant_salt_env", "the tenant salt") or config.tenant_salt
        secret = _env(config, "mac_key_env", "a secret for the values' MAC")
        mac_key = derive_mac_key(secret) if secret else None
        digest = hashlib.sha256(redis_namespace(
            geometry_namespace, salt, mac_key_id(mac_key) if mac_key else b"")).digest()
        tenant = config.tenant.encode() + b":" if config.tenant else b""
        prefix = KEY_PREFIX + tenant + digest.hex()[:16].encode() + b":"
        return cls(digest, prefix, ValueCodec(digest, mac_key))

    def key(self, key: bytes) -> bytes:
        """The Redis key of an offload block's key."""
        return self.prefix + key.hex().encode()


class RedisUnavailable(Exception):
    """The result at a position that was not attempted (down) or whose round trip failed."""


_DOWN = RedisUnavailable("Redis is down (backing off)")
_NO_MAP = RedisUnavailable("no server of the cluster serves this key's slot")


class RedisConnection:
    """The servers of one tier (one, or a cluster's), with their down states. Construction reads
    the credentials (a named env var that is unset is a ValueError) and touches no network."""

    def __init__(self, config: RedisTierConfig, *, timeout_s: float | None = None,
                 stats: Counters[Any] | None = None) -> None:
        self.config = config
        self.url = redacted_url(config.url)  # for messages
        self.timeout_s = config.io_timeout_s if timeout_s is None else timeout_s
        # round_trips, timeouts, errors, skipped_down, redirects: the caller's record has them
        self.stats = stats if stats is not None else Counters(RedisLookupMetrics)
        bare_url, username, password = _split_credentials(config.url)
        username = _env(config, "username_env", "the Redis ACL user name") or username
        self._password = _env(config, "password_env", "the Redis password") or password
        base = url_pool(bare_url, username, self._password, self.timeout_s, config.tls_ca_file)
        seed = (base.connection_kwargs.get("host", "127.0.0.1"),
                int(base.connection_kwargs.get("port", 6379)))
        self._node: RedisNode | None = None  # one server
        self._slots: SlotMap | None = None  # a cluster
        if config.cluster:
            seeds = [seed] + [_split_host_port(n) for n in config.startup_nodes]
            self._slots = SlotMap(seeds, lambda h, p: RedisNode(f"{h}:{p}",
                                                                node_pool(base, h, p)))
        else:
            self._node = RedisNode(f"{seed[0]}:{seed[1]}", base)
        self._threads: ThreadPoolExecutor | None = None  # a call reaching several servers
        self._threads_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RedisConnection({self.url!r}, cluster={self.config.cluster})"

    def single_client(self, timeout_s: float) -> redis.Redis:
        """A client of the tier's one server (its credentials and TLS), whose socket waits at
        most `timeout_s`: for Pub/Sub and server questions, outside the command pipelines."""
        assert self._node is not None, "a client of one server; a cluster has several"
        base = self._node.pool
        kwargs = {**base.connection_kwargs, "socket_timeout": timeout_s,
                  "socket_connect_timeout": timeout_s}
        return redis.Redis(connection_pool=redis.ConnectionPool(
            connection_class=base.connection_class, **kwargs))

    @property
    def db(self) -> int:
        """The database number of the tier's one server."""
        assert self._node is not None, "a cluster has only database 0"
        return int(self._node.pool.connection_kwargs.get("db", 0) or 0)

    def close(self) -> None:
        """Close the sockets (never waits on a server). A later call reconnects."""
        if self._node is not None:
            self._node.close()
        if self._slots is not None:
            self._slots.close()

    @property
    def down(self) -> bool:
        """Every server this tier knows is down (or, on a cluster, no map could be had)."""
        if self._node is not None:
            return self._node.health.is_down
        assert self._slots is not None
        return self._slots.health.is_down and not self._slots.loaded

    # --- commands -------------------------------------------------------------------------------

    def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Run one-key commands, each server's as one pipeline, within `timeout_s` in all."""
        if not commands:
            return []
        deadline = time.monotonic() + self.timeout_s
        results: list[Any] = [None] * len(commands)
        if self._node is not None:
            self._run({self._node: list(range(len(commands)))}, commands, results, deadline)
            return results
        assert self._slots is not None
        self._slots.refresh_if_due(deadline)
        groups: dict[RedisNode, list[int]] = {}
        unrouted = 0
        for i, command in enumerate(commands):
            node = self._slots.node_for(command[1])
            if node is None:
                results[i] = _NO_MAP
                unrouted += 1
            else:
                groups.setdefault(node, []).append(i)
        if unrouted:
            self.stats.add(skipped_down=1)
        self._run(groups, commands, results, deadline)
        self._follow_redirects(commands, results, deadline)
        return results

    def _follow_redirects(self, commands: Sequence[Command], results: list[Any],
                          deadline: float) -> None:
        """Send each MOVED position to its slot's new owner, each ASK position to the importing
        server behind ASKING: once (a second redirect stays an error reply: a miss)."""
        assert self._slots is not None
        moved: dict[RedisNode, list[int]] = {}
        asked: dict[RedisNode, list[int]] = {}
        for i, r in enumerate(results):
            if isinstance(r, MovedError):
                moved.setdefault(self._slots.moved(r.slot_id, r.host, r.port), []).append(i)
            elif isinstance(r, AskError):
                asked.setdefault(self._slots.node_at(r.host, r.port), []).append(i)
            elif isinstance(r, (TryAgainError, ClusterDownError)):
                self._slots.mark_stale()
        if moved or asked:
            self.stats.add(redirects=sum(map(len, moved.values())) +
                           sum(map(len, asked.values())))
            self._run(moved, commands, results, deadline)
            self._run(asked, commands, results, deadline, asking=True)

    def _run(self, groups: dict[RedisNode, list[int]], commands: Sequence[Command],
             results: list[Any], deadline: float, asking: bool = False) -> None:
        """One pipeline per server (at once when several), filling `results` at each server's
        positions; a server down is skipped, one that fails goes down."""
        work: list[tuple[RedisNode, list[int], str]] = []
        for node, positions in groups.items():
            admitted = node.health.admit()
            if admitted is None:
                self.stats.add(skipped_down=1)
                for i in positions:
                    results[i] = _DOWN
            else:
                work.append((node, positions, admitted))
        if not work:
            return
        batches = [[c for i in positions for c in ((("ASKING",), commands[i]) if asking
                                                   else (commands[i],))]
                   for _, positions, _ in work]
        self.stats.add(round_trips=len(work))
        if len(work) == 1:
            outcomes = [_call(work[0][0], batches[0], deadline)]
        else:
            outcomes = self._call_many([node for node, _, _ in work], batches, deadline)
        for (node, positions, admitted), outcome in zip(work, outcomes):
            try:
                if isinstance(outcome, BaseException):
                    self._failed(node, positions, outcome, results)
                else:
                    node.health.up()
                    replies = outcome[1::2] if asking else outcome
                    for i, reply in zip(positions, replies):
                        results[i] = reply
            finally:
                node.health.done(admitted)

    def _call_many(self, nodes: list[RedisNode], batches: list[list[Command]],
                   deadline: float) -> list[list[Any] | BaseException]:
        with self._threads_lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(MAX_PARALLEL_NODES, "kvport-redis")
        futures = [self._threads.submit(_call, node, batch, deadline)
                   for node, batch in zip(nodes, batches)]
        wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()) + THREAD_GRACE_S)
        return [f.result() if f.done() else DeadlineExceeded("no thread to run the call in time")
                for f in futures]

    def _failed(self, node: RedisNode, positions: list[int], exc: BaseException,
                results: list[Any]) -> None:
        timeout = isinstance(exc, (redis.TimeoutError, TimeoutError))
        self.stats.add(**{"timeouts" if timeout else "errors": 1})
        why = f"{type(exc).__name__}: {self._scrub(str(exc))}"
        node.health.down(f"{self.url} ({node.name}): {why}")
        failure = RedisUnavailable(why)
        for i in positions:
            results[i] = failure
        if self._slots is not None:
            self._slots.mark_stale()  # a failover may follow: ask for the map again

    def _scrub(self, text: str) -> str:
        return text.replace(self._password, "***") if self._password else text

    @property
    def map_refreshes(self) -> int:
        return self._slots.num_refreshes if self._slots is not None else 0


def _call(node: RedisNode, batch: list[Command], deadline: float) -> list[Any] | BaseException:
    try:
        return node.call(batch, deadline)
    except REDIS_FAILURES as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - redis-py's internals: a miss, never a crash
        logger.warning("Redis tier: unexpected %s from redis-py talking to %s", type(exc).__name__,
                       node.name, exc_info=True)
        return exc


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


def _split_host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host, int(port)


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
