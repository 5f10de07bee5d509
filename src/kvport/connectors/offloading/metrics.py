"""The OffloadingConnector's metrics as frozen records: what each tier, the worker half and the
scheduler half count, cumulative since start.

    worker side    TierMetrics per tier (DiskTierMetrics, RedisTierMetrics) and WorkerMetrics,
                   snapshots of thread-safe counters, sent to the scheduler half with every
                   step's worker metadata
    scheduler side ConnectorMetrics: each tier's record with what only this half knows (the host
                   tier's slots and hits, the lookups of disk and Redis, hit tokens per tier),
                   RequestMetrics and the workers' WorkerMetrics

Records cross module boundaries; dicts exist only at the two edges: `LLM.get_metrics()`
(base.plain_data) and vLLM's stats (kvport.vllm.stats, which names fields by attribute paths that a
test resolves against these records).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class TierMetrics:
    """A tier's transfers. Bytes count payload only (not file headers)."""

    bytes_stored: int = 0
    blocks_stored: int = 0
    bytes_loaded: int = 0
    blocks_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    evictions: int = 0
    skipped_stores: int = 0  # not stored for lack of space (full disk, entry larger than the tier)
    failures: int = 0  # I/O errors, missing or corrupt entries on load
    occupancy_bytes: int = 0
    occupancy_blocks: int = 0


@dataclass(frozen=True)
class DiskTierMetrics(TierMetrics):
    """`occupancy_*` are this process's runs; `shared_bytes` every process's on the directory."""

    other_format: int = 0  # run files of another format version: misses, left alone
    already_present: int = 0  # write-throughs of entries the directory held already
    rejected: int = 0  # names removed: a bad entry or run header, a symlink or FIFO at a name
    swept_temp_files: int = 0  # temp files of crashed writers removed at start
    shared_bytes: int = 0  # the ledger: run files of every process sharing the directory


@dataclass(frozen=True)
class RedisTierMetrics(TierMetrics):
    """Per call: round_trips, timeouts, errors, skipped_down; per block: the rest. Occupancy
    and evictions stay 0 (Redis's own)."""

    round_trips: int = 0
    timeouts: int = 0
    errors: int = 0
    vanished: int = 0  # gone between the lookup and the load (evicted, deleted)
    corrupt: int = 0  # bad header, checksum or length; deleted
    refused_stores: int = 0  # Redis answered a SET with an error (OOM under noeviction, READONLY)
    skipped_down: int = 0  # calls not attempted: the connection is down
    already_present: int = 0  # stores of values Redis held already: not sent again
    other_format: int = 0  # another format version: a miss, left alone
    forged: int = 0  # no valid MAC under a MAC key; deleted
    wrong_type: int = 0  # a key of another type under a kvport name; deleted
    redirects: int = 0  # positions a cluster sent elsewhere (MOVED, ASK), followed in the call


@dataclass(frozen=True)
class RedisLookupMetrics:
    """The scheduler's Redis lookups: one batched EXISTS per request and server."""

    lookups: int = 0
    keys_queried: int = 0
    keys_found: int = 0
    round_trips: int = 0
    timeouts: int = 0
    errors: int = 0
    skipped_down: int = 0
    redirects: int = 0
    map_refreshes: int = 0


@dataclass(frozen=True)
class WorkerMetrics:
    """The worker half's own counters (summed over tensor-parallel workers)."""

    num_late_loads: int = 0  # async loads whose promotions passed load_timeout_s
    num_late_writes: int = 0  # write-throughs that passed write_timeout_s
    num_replaced_threads: int = 0  # transfer threads started in place of stuck ones
    num_dropped_at_shutdown: int = 0  # stores or write-throughs still running at shutdown's end

    def plus(self, other: WorkerMetrics) -> WorkerMetrics:
        return WorkerMetrics(*(getattr(self, f.name) + getattr(other, f.name)
                               for f in fields(self)))


@dataclass(frozen=True)
class HostMetrics(TierMetrics):
    """The host tier: the worker's copies, and the scheduler's slots (occupancy and evictions
    are the manager's)."""

    num_slots: int = 0
    lookups: int = 0  # admitted requests that asked the host tier
    hits: int = 0  # offload blocks they found there
    num_rejected_stores: int = 0  # prepare_store calls that found no room
    num_deferred_blocks: int = 0  # blocks admission control held back
    hit_tokens: int = 0


@dataclass(frozen=True)
class DiskMetrics(DiskTierMetrics):
    """The disk tier: the workers' transfers, the scheduler's lookups and hits."""

    lookup_timeouts: int = 0  # lookups the scheduler stopped waiting for (lookup_timeout_ms)
    lookup_skipped: int = 0  # lookups not made while one ran late
    hit_tokens: int = 0


@dataclass(frozen=True)
class RedisMetrics(RedisTierMetrics):
    """The Redis tier: the workers' transfers, the scheduler's lookups (`lookup_*`) and hits."""

    lookup_lookups: int = 0
    lookup_keys_queried: int = 0
    lookup_keys_found: int = 0
    lookup_round_trips: int = 0
    lookup_timeouts: int = 0
    lookup_errors: int = 0
    lookup_skipped_down: int = 0
    lookup_redirects: int = 0
    lookup_map_refreshes: int = 0
    hit_tokens: int = 0

    @classmethod
    def of(cls, tier: RedisTierMetrics, lookup: RedisLookupMetrics,
           hit_tokens: int) -> RedisMetrics:
        return cls(**_values(tier), lookup_lookups=lookup.lookups,
                   lookup_keys_queried=lookup.keys_queried, lookup_keys_found=lookup.keys_found,
                   lookup_round_trips=lookup.round_trips, lookup_timeouts=lookup.timeouts,
                   lookup_errors=lookup.errors, lookup_skipped_down=lookup.skipped_down,
                   lookup_redirects=lookup.redirects, lookup_map_refreshes=lookup.map_refreshes,
                   hit_tokens=hit_tokens)


@dataclass(frozen=True)
class RequestMetrics:
    """The scheduler half's counters of requests and jobs."""

    num_queried_tokens: int = 0  # prompt tokens beyond the local hit, asked of the connector
    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    num_redis_hit_tokens: int = 0
    num_load_jobs: int = 0
    num_sync_loads: int = 0  # of num_load_jobs: host hits copied before the step's forward
    num_failed_loads: int = 0
    num_store_jobs: int = 0
    num_failed_stores: int = 0
    num_flushed_jobs: int = 0  # jobs of preempted requests finished before their blocks' reuse
    num_busy_answers: int = 0  # None answers: the request's own stores were still pending
    # Admissions whose block hashes were not one per engine block: not loaded nor stored.
    num_mismatched_hashes: int = 0
    num_skipped_write_throughs: int = 0  # stores kept in host memory only
    # of num_store_jobs: blocks a request's final step completed, offered when it finished
    num_final_block_stores: int = 0
    # Requests whose kv_transfer_params could not be read: run with no load and no store.
    num_bad_transfer_params: int = 0
    num_limited_hits: int = 0  # hits cut short by a request's max_load_tokens or kv_load_tiers
    num_late_jobs: int = 0  # jobs the workers gave up waiting for, not reported yet
    num_inflight_waits: int = 0  # None answers: another request was writing the next blocks
    num_inflight_timeouts: int = 0  # requests that reached inflight_wait_s


@dataclass(frozen=True)
class DecisionMetrics:
    """What the scheduler half decided (scheduler/decisions.py): admitted prompts' tokens by
    where their KV came from, and how stores to the host tier ended, in blocks."""

    prompt_tokens_device: int = 0  # the engine's own prefix cache
    prompt_tokens_host: int = 0
    prompt_tokens_disk: int = 0
    prompt_tokens_redis: int = 0
    prompt_tokens_computed: int = 0
    host_stored_blocks: int = 0
    host_present_blocks: int = 0  # held already: nothing to copy
    host_refused_blocks: int = 0  # no room (offered again)
    host_deferred_blocks: int = 0  # held back by admission control (store_threshold)
    host_failed_blocks: int = 0
    # Now, as fractions of the host tier's slots: held by loads and stores in flight.
    host_read_usage: float = 0.0
    host_write_usage: float = 0.0
    host_usage: float = 0.0


@dataclass(frozen=True)
class ConnectorMetrics:
    offload_block_tokens: int
    host: HostMetrics
    requests: RequestMetrics
    worker: WorkerMetrics
    disk: DiskMetrics | None = None  # None: no disk tier
    redis: RedisMetrics | None = None  # None: no Redis tier
    decisions: DecisionMetrics = DecisionMetrics()


class Counters(Generic[R]):
    """Thread-safe counters of one record type: `add` (sums), `set` (levels), `snapshot`."""

    def __init__(self, record: type[R]) -> None:
        self._record = record
        self._values: dict[str, Any] = _values(record())
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._values[name] += value  # KeyError: not a field of the record

    def set(self, **values: float) -> None:
        """Counters that are levels, not sums (occupancy), set at once."""
        with self._lock:
            for name, value in values.items():
                if name not in self._values:
                    raise KeyError(name)
                self._values[name] = value

    def snapshot(self) -> R:
        with self._lock:
            return self._record(**self._values)


def extend(record: type[R], base: Any, **extra: Any) -> R:
    """A record of a subclass of `base`'s type: base's fields, then `extra` (which may replace
    some of them). A name that is not a field of `record` is a TypeError."""
    return record(**{**_values(base), **extra})


def _values(record: Any) -> dict[str, Any]:
    """A record's fields, shallow (not dataclasses.asdict: nested records stay records)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}
