"""OffloadingConnector configuration: `kv_connector_extra_config` with vLLM's offloading names,
validated and parsed once, when the connector is built.

`secondary_tiers` arrives as a list of dicts (JSON) and leaves `__post_init__` as a tuple of typed
tier records (`DiskTierConfig`, ...), so no other module reads a raw dict. Each tier type is one
`TierType` in `TIER_TYPES`: its record class, its keys, how many tiers of it one connector may
have, and its parser. A new tier type (say, a remote store below disk) adds a record and an entry
there; nothing else parses tier dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EVICTION_POLICIES = ("lru", "arc")


@dataclass(frozen=True)
class DiskTierConfig:
    """A local disk tier below the host tier, written through from it."""

    root_dir: str
    max_bytes: int  # the entries this process knows, headers included


@dataclass(frozen=True)
class RedisTierConfig:
    """A shared tier on Redis (or Redis Cluster) below the host tier (and the disk tier, if any),
    written through from the host tier. Redis owns eviction (`maxmemory` and an LRU policy)."""

    url: str  # redis://[user:password@]host:port/db, or rediss:// for TLS
    cluster: bool = False  # the URL names one node of a Redis Cluster
    # Names of environment variables holding the ACL user and the password (they win over the
    # URL's): secrets stay out of configs and logs.
    username_env: str | None = None
    password_env: str | None = None
    tls_ca_file: str | None = None  # rediss://: the CA that signed the server's certificate
    tenant_salt: str = ""  # part of the key namespace: tenants with different salts never share
    lookup_timeout_ms: float = 50.0  # the scheduler's existence query; later: a miss
    io_timeout_s: float = 2.0  # a worker's reads and writes; later: failed (counted)

    def __repr__(self) -> str:  # the URL's password never reaches a log or an error message
        return (f"RedisTierConfig(url={redacted_url(self.url)!r}, cluster={self.cluster}, "
                f"tenant_salt={'***' if self.tenant_salt else ''!r})")


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


def _parse_disk(entry: Mapping[str, Any]) -> DiskTierConfig:
    root, max_bytes = entry["root_dir"], entry["max_bytes"]
    if not isinstance(root, str) or not root:
        raise ValueError(f"root_dir must be a directory path, got {root!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    return DiskTierConfig(root, max_bytes)


def _parse_redis(entry: Mapping[str, Any]) -> RedisTierConfig:
    url = entry["url"]
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
        shown = redacted_url(url) if isinstance(url, str) else url
        raise ValueError(f"url must be a redis:// or rediss:// URL, got {shown!r}")
    kw: dict[str, Any] = {}
    if "cluster" in entry:
        if not isinstance(entry["cluster"], bool):
            raise ValueError(f"cluster must be true or false, got {entry['cluster']!r}")
        kw["cluster"] = entry["cluster"]
    for name in ("username_env", "password_env", "tls_ca_file", "tenant_salt"):
        if name in entry:
            value = entry[name]
            if not isinstance(value, str) or (name != "tenant_salt" and not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
            kw[name] = value
    for name in ("lookup_timeout_ms", "io_timeout_s"):
        if name in entry:
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
            kw[name] = float(value)
    if url.startswith("redis://") and "tls_ca_file" in kw:
        raise ValueError("tls_ca_file needs a rediss:// url (TLS)")
    return RedisTierConfig(url, **kw)


def redacted_url(url: str) -> str:
    """The URL without its password, for messages, logs and reports (never a secret)."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else f"{scheme}://{user}@{host}"


TIER_TYPES: dict[str, TierType] = {
    # NOTE: one tier of each type: chaining disk tiers (host -> disk 1 -> disk 2) is not
    # implemented, and a second one must not be dropped silently, so it is an error.
    "disk": TierType(DiskTierConfig, ("root_dir", "max_bytes"), 1, _parse_disk, rank=0),
    "redis": TierType(RedisTierConfig, ("url",), 1, _parse_redis,
                      optional=("cluster", "username_env", "password_env", "tls_ca_file",
                                "tenant_salt", "lookup_timeout_ms", "io_timeout_s"), rank=1),
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

    def __post_init__(self) -> None:
        if (isinstance(self.cpu_bytes_to_use, bool) or not isinstance(self.cpu_bytes_to_use, int)
                or self.cpu_bytes_to_use <= 0):
            raise ValueError(f"OffloadingConnector: cpu_bytes_to_use must be a positive number of "
                             f"bytes, got {self.cpu_bytes_to_use!r}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"OffloadingConnector: block_size must be positive, got "
                             f"{self.block_size}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"OffloadingConnector: eviction_policy must be one of "
                             f"{EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if not isinstance(self.sync_host_loads, bool):
            raise ValueError(f"OffloadingConnector: sync_host_loads must be true or false, "
                             f"got {self.sync_host_loads!r}")
        wait = self.inflight_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 3600:
            raise ValueError(f"OffloadingConnector: inflight_wait_s must be a number of seconds "
                             f">= 0 and below 3600 (0: never wait), got {wait!r}")
        if self.store_threshold < 0:
            raise ValueError(f"OffloadingConnector: store_threshold must be >= 0, "
                             f"got {self.store_threshold}")
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


def parse_tiers(entries: object) -> tuple[TierConfig, ...]:
    """`secondary_tiers` as tier records. Entries may already be records (a config rebuilt with
    dataclasses.replace). Raises ValueError naming the entry, the bad key and the accepted keys."""
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"OffloadingConnector: secondary_tiers must be a list of tier dicts "
                         f"like {{'type': 'disk', ...}}, got {entries!r}")
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
                         f"got {entry!r}")
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
