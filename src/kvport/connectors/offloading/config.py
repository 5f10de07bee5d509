"""OffloadingConnector configuration: `kv_connector_extra_config` with vLLM's offloading names,
validated and parsed once, when the connector is built.

`secondary_tiers` arrives as a list of dicts (JSON) and leaves `__post_init__` as a tuple of typed
tier records (`DiskTierConfig`, ...), so no other module reads a raw dict. Each tier type is one
`TierType` in `TIER_TYPES`: its record class, its keys, how many tiers of it one connector may
have, and its parser. A new tier type (say, a remote store below disk) adds a record and an entry
there; nothing else parses tier dicts.

Every value is checked for its type and range here, whether it came through
`parse_extra_config` or a record built in Python, and a bad one is a ValueError that names the
key and the value. No message shows a secret: URLs are shown without their password, and a tier
entry is shown with every URL redacted and secret-like values replaced (`redacted`).
"""

from __future__ import annotations

import dataclasses

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EVICTION_POLICIES = ("lru", "arc")
# How the host tier copies engine blocks (tiers/host/tier.py): "auto" is the native copy for a
# pool in host memory and torch ops on streams for a pool on a GPU.
HOST_COPIES = ("auto", "native", "numpy", "torch")
# A tenant name is part of every Redis key (kvport:<tenant>:...): an ACL key pattern can scope
# it, so it holds no character a glob treats specially.
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NAMESPACE_NAME = re.compile(r"[A-Za-z0-9_.:/@+-]{1,200}")
MAX_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class DiskTierConfig:
    """A local disk tier below the host tier, written through from it."""

    root_dir: str
    # The run files under root_dir of every process sharing it, headers included (a shared
    # ledger counts them: tiers/disk/ledger.py).
    max_bytes: int
    # Files 0o640 and directories 0o750 instead of 0o600 / 0o700: processes of other users in
    # the directory's group may read (and, through the group's write bit on directories, store).
    group_access: bool = False
    # The scheduler's stat of a key's name; a lookup still running after this is a miss (a hung
    # network file system must not stall the scheduler).
    lookup_timeout_ms: float = 200.0

    def __post_init__(self) -> None:
        if not isinstance(self.root_dir, str) or not self.root_dir:
            raise ValueError(f"root_dir must be a directory path, got {self.root_dir!r}")
        check_int("max_bytes", self.max_bytes, 1)
        check_bool("group_access", self.group_access)
        check_seconds("lookup_timeout_ms", self.lookup_timeout_ms, MAX_TIMEOUT_S * 1000)


@dataclass(frozen=True)
class RedisTierConfig:
    """A shared tier on Redis (or Redis Cluster) below the host tier (and the disk tier, if any),
    written through from the host tier. Redis owns eviction (`maxmemory` and an LRU policy)."""

    url: str  # redis://[user:password@]host:port/db, or rediss:// for TLS
    cluster: bool = False  # the URL names one node of a Redis Cluster
    # More nodes of the cluster ("host:port"), tried when the URL's node does not answer.
    startup_nodes: tuple[str, ...] = ()
    # Names of environment variables holding the ACL user and the password (they win over the
    # URL's): secrets stay out of configs and logs.
    username_env: str | None = None
    password_env: str | None = None
    tls_ca_file: str | None = None  # rediss://: the CA that signed the server's certificate
    # Part of every key: kvport:<tenant>:<namespace>:<key>, so that an ACL key pattern
    # (~kvport:<tenant>:*) gives each tenant its own keys. "" (default): kvport:<namespace>:...
    tenant: str = ""
    tenant_salt: str = ""  # part of the key namespace: tenants with different salts never share
    tenant_salt_env: str | None = None  # an env var holding the salt (wins over tenant_salt)
    # An env var holding a secret key: every value then carries a keyed MAC over its header and
    # payload, and a value without a valid one is never decoded (planted by someone who could
    # write keys but not knows the key). The key's id is part of the namespace.
    mac_key_env: str | None = None
    lookup_timeout_ms: float = 50.0  # the scheduler's existence query, in all; later: a miss
    io_timeout_s: float = 2.0  # a worker's reads and writes, per round trip; later: failed
    # Announce Redis's own removals of the tier's values (evicted, expired, deleted) as they
    # happen, from the server's keyevent notifications, instead of at the next lookup that finds
    # them gone. Needs `notify-keyspace-events` with E, e, x and g on the server (the operator's
    # setting: kvport only warns), one server (a cluster notifies per node), and KV events on.
    keyspace_events: bool = False

    def __post_init__(self) -> None:
        url = self.url
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
            shown = redacted_url(url) if isinstance(url, str) else url
            raise ValueError(f"url must be a redis:// or rediss:// URL, got {shown!r}")
        check_bool("cluster", self.cluster)
        nodes = self.startup_nodes
        if isinstance(nodes, list):
            nodes = tuple(nodes)
            object.__setattr__(self, "startup_nodes", nodes)  # frozen: its one normalization
        if not isinstance(nodes, tuple) or not all(isinstance(n, str) and _host_port(n)
                                                   for n in nodes):
            raise ValueError(f"startup_nodes must be a list of 'host:port' strings, got "
                             f"{redacted(nodes)!r}")
        if nodes and not self.cluster:
            raise ValueError("startup_nodes needs cluster: true (they are a cluster's nodes)")
        for name in ("username_env", "password_env", "tls_ca_file", "tenant_salt_env",
                     "mac_key_env"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {redacted(value)!r}")
        if not isinstance(self.tenant_salt, str):
            raise ValueError("tenant_salt must be a string")
        if not isinstance(self.tenant, str) or (self.tenant and not TENANT_NAME.fullmatch(
                self.tenant)):
            raise ValueError(f"tenant must be 1-64 letters, digits, '_', '.' or '-', got "
                             f"{self.tenant!r}")
        check_seconds("lookup_timeout_ms", self.lookup_timeout_ms, MAX_TIMEOUT_S * 1000)
        check_seconds("io_timeout_s", self.io_timeout_s, MAX_TIMEOUT_S)
        check_bool("keyspace_events", self.keyspace_events)
        if self.keyspace_events and self.cluster:
            raise ValueError("keyspace_events needs one Redis server: a cluster publishes each "
                             "key's notifications on its own node only")
        if url.startswith("redis://") and self.tls_ca_file is not None:
            raise ValueError("tls_ca_file needs a rediss:// url (TLS)")

    def __repr__(self) -> str:  # the URL's password never reaches a log or an error message
        return (f"RedisTierConfig(url={redacted_url(self.url)!r}, cluster={self.cluster}, "
                f"tenant={self.tenant!r}, tenant_salt={'***' if self.tenant_salt else ''!r})")


# A parsed secondary tier: the union of the tier records (one per type).
TierConfig = DiskTierConfig | RedisTierConfig


@dataclass(frozen=True)
class TierType:
    """How one `secondary_tiers` type is parsed: `keys` are required, `optional` may be left out
    (the record's default)."""

    record: type[TierConfig]
    keys: tuple[str, ...]
    max_count: int  # tiers of this type one connector may have
    parse: Callable[[Mapping[str, Any]], TierConfig]  # raises ValueError(message about one key)
    optional: tuple[str, ...] = ()
    rank: int = 0  # lookup order below the host tier: lower first, whatever the list's order


def _record_parser(record: type[TierConfig]) -> Callable[[Mapping[str, Any]], TierConfig]:
    def parse(entry: Mapping[str, Any]) -> TierConfig:
        return record(**{k: v for k, v in entry.items() if k != "type"})
    return parse


def redacted_url(url: str) -> str:
    """The URL without its password, for messages, logs and reports (never a secret)."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else f"{scheme}://{user}@{host}"


_SECRET_KEYS = ("password", "secret", "token", "salt", "key")


def redacted(value: Any) -> Any:
    """A config value as messages may show it: every string that holds a URL without its
    password, and the values of secret-like keys (password, salt, key, ...) as '***'."""
    if isinstance(value, str):
        return redacted_url(value)
    if isinstance(value, Mapping):
        return {k: "***" if isinstance(k, str) and any(s in k.lower() for s in _SECRET_KEYS)
                and not k.endswith("_env") and v else redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v) for v in value)
    return value


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_seconds(name: str, value: object, maximum: float, zero_ok: bool = False) -> None:
    """A duration: a finite number > 0 (or >= 0 with zero_ok) and below `maximum`."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
            or not (0 <= value if zero_ok else 0 < value) or value >= maximum):
        low = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{name} must be a number {low} and below {maximum:g}, got {value!r}")


def _host_port(node: str) -> bool:
    host, sep, port = node.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


TIER_TYPES: dict[str, TierType] = {
    # NOTE: one tier of each type: chaining disk tiers (host -> disk 1 -> disk 2) is not
    # implemented, and a second one must not be dropped silently, so it is an error.
    "disk": TierType(DiskTierConfig, ("root_dir", "max_bytes"), 1,
                     _record_parser(DiskTierConfig),
                     optional=("group_access", "lookup_timeout_ms"), rank=0),
    "redis": TierType(RedisTierConfig, ("url",), 1, _record_parser(RedisTierConfig),
                      optional=("cluster", "startup_nodes", "username_env", "password_env",
                                "tls_ca_file", "tenant", "tenant_salt", "tenant_salt_env",
                                "mac_key_env", "lookup_timeout_ms", "io_timeout_s",
                                "keyspace_events"), rank=1),
}


@dataclass(frozen=True)
class OffloadingConfig:
    cpu_bytes_to_use: int = 0  # host tier size in bytes (required, > 0)
    block_size: int | None = None  # offload block in tokens; None: the engine's block
    eviction_policy: str = "lru"
    store_threshold: int = 0  # store a block only after this many admitted requests asked for it
    # Given as a list of dicts ({"type": "disk", ...}); __post_init__ replaces it with a tuple
    # of TierConfig records, the only form the halves read.
    secondary_tiers: Sequence[Mapping[str, Any] | TierConfig] = ()
    # A hit held wholly in host memory is a synchronous load: copied before the step's forward,
    # so the request prefills in the step that admits it, batched with the others. False: every
    # load is asynchronous (the request waits a step for it).
    sync_host_loads: bool = True
    # A request whose hit run ends at a key another request's job is writing into host memory
    # (a promotion from disk or Redis, a store) waits for that write, asking again each step,
    # at most this many seconds; then it computes the rest. 0: never waits.
    inflight_wait_s: float = 1.0
    # An asynchronous load (a promotion from disk or Redis, then its copy) not done this long
    # after it started fails its blocks, which the engine recomputes (worker.py: late loads).
    load_timeout_s: float = 5.0
    # A write-through to disk or Redis not done this long after it started is given up: its
    # store no longer keeps the engine stepping; its host slots stay pinned until the write's
    # thread returns.
    write_timeout_s: float = 30.0
    # The step that computed a block ends only once it is written through to every lower tier
    # (waited for at most write_timeout_s), so the answer that ends a request comes after its
    # KV can be found there: what a prefill instance needs before a router sends the request to
    # a decode instance on the same Redis or disk. None: on for kv_producer, off otherwise.
    sync_write_through: bool | None = None
    # How long shutdown waits for stores and write-throughs in flight, in all.
    shutdown_timeout_s: float = 10.0
    # Names what this connector's disk and Redis entries are shared under, beyond the model
    # identity the engine derives: engines with different namespaces never share entries. vLLM
    # requires it where it cannot identify the model's weights (docs/vllm.md).
    namespace: str | None = None
    # Hybrid models: a sliding-window group's blocks are stored only where a hit can use them,
    # the window before a boundary a later request may hit at (geometry.py): the end of each
    # prompt, every block after it (decode), and every `sliding_store_interval` tokens (a shared
    # prefix hits at the last such boundary inside it). None: four of the largest window; 0:
    # every block (a hit anywhere, at the cost of storing every sliding block).
    sliding_store_interval: int | None = None
    # The host tier's copy path (HOST_COPIES); "torch" on a CPU pool runs the GPU path's ops.
    host_copy: str = "auto"

    def __post_init__(self) -> None:
        where = "OffloadingConnector"
        try:
            check_int("cpu_bytes_to_use", self.cpu_bytes_to_use, 1)
            if self.block_size is not None:
                check_int("block_size", self.block_size, 1)
            if self.eviction_policy not in EVICTION_POLICIES:
                raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got "
                                 f"{self.eviction_policy!r}")
            check_int("store_threshold", self.store_threshold, 0)
            if self.host_copy not in HOST_COPIES:
                raise ValueError(f"host_copy must be one of {HOST_COPIES}, got "
                                 f"{self.host_copy!r}")
            if self.sliding_store_interval is not None:
                check_int("sliding_store_interval", self.sliding_store_interval, 0)
            check_bool("sync_host_loads", self.sync_host_loads)
            if self.sync_write_through is not None:
                check_bool("sync_write_through", self.sync_write_through)
            check_seconds("inflight_wait_s", self.inflight_wait_s, MAX_TIMEOUT_S, zero_ok=True)
            for name in ("load_timeout_s", "write_timeout_s", "shutdown_timeout_s"):
                check_seconds(name, getattr(self, name), MAX_TIMEOUT_S)
            if self.namespace is not None and (not isinstance(self.namespace, str) or
                                               not NAMESPACE_NAME.fullmatch(self.namespace)):
                raise ValueError(f"namespace must be 1-200 letters, digits or _.:/@+-, got "
                                 f"{redacted(self.namespace)!r}")
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        # NOTE: object.__setattr__: the record is frozen, and this is its one normalization.
        object.__setattr__(self, "secondary_tiers", parse_tiers(self.secondary_tiers))

    @property
    def tiers(self) -> tuple[TierConfig, ...]:
        """The parsed secondary tiers, top down below the host tier: disk, then redis."""
        return self.secondary_tiers  # type: ignore[return-value]  # parsed in __post_init__

    @property
    def disk_tier(self) -> DiskTierConfig | None:
        return next((t for t in self.tiers if isinstance(t, DiskTierConfig)), None)

    @property
    def redis_tier(self) -> RedisTierConfig | None:
        return next((t for t in self.tiers if isinstance(t, RedisTierConfig)), None)

    def per_rank(self, tp_size: int) -> OffloadingConfig:
        """The config one of `tp_size` tensor-parallel workers runs with: cpu_bytes_to_use and
        the disk tier's max_bytes are the engine's, and each worker holds its shard of every
        block (each rank's disk entries live under their own namespace, accounted on their
        own)."""
        if tp_size == 1:
            return self
        tiers = tuple(dataclasses.replace(t, max_bytes=max(1, t.max_bytes // tp_size))
                      if isinstance(t, DiskTierConfig) else t for t in self.tiers)
        return dataclasses.replace(self, cpu_bytes_to_use=self.cpu_bytes_to_use // tp_size,
                                   secondary_tiers=tiers)


def parse_tiers(entries: object) -> tuple[TierConfig, ...]:
    """`secondary_tiers` as tier records. Entries may already be records (a config rebuilt with
    dataclasses.replace). Raises ValueError naming the entry, the bad key and the accepted keys."""
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"OffloadingConnector: secondary_tiers must be a list of tier dicts "
                         f"like {{'type': 'disk', ...}}, got {redacted(entries)!r}")
    records: tuple[TierConfig, ...] = tuple(
        e if isinstance(e, (DiskTierConfig, RedisTierConfig)) else _parse_entry(i, e)
        for i, e in enumerate(entries))
    for name, tier_type in TIER_TYPES.items():
        count = sum(isinstance(r, tier_type.record) for r in records)
        if count > tier_type.max_count:
            raise ValueError(f"OffloadingConnector: secondary_tiers has {count} {name} tiers, but "
                             f"at most {tier_type.max_count} {name} tier is supported; keep one")
    rank = {t.record: t.rank for t in TIER_TYPES.values()}
    return tuple(sorted(records, key=lambda r: rank[type(r)]))  # disk above redis


def _parse_entry(index: int, entry: object) -> TierConfig:
    where = f"OffloadingConnector: secondary_tiers[{index}]"
    if not isinstance(entry, Mapping) or entry.get("type") not in TIER_TYPES:
        raise ValueError(f"{where} must be a dict with 'type' one of {sorted(TIER_TYPES)}, "
                         f"got {redacted(entry)!r}")
    tier_type = TIER_TYPES[entry["type"]]
    accepted = sorted(("type", *tier_type.keys, *tier_type.optional))
    unknown = sorted(set(entry) - set(accepted))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; accepted: {accepted}")
    missing = [k for k in tier_type.keys if k not in entry]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; accepted: {accepted}")
    try:
        return tier_type.parse(entry)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}; accepted: {accepted}") from None
