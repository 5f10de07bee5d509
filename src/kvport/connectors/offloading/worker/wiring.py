"""The standard wiring of the tiers on transfer handlers: which function moves each (source,
destination) medium pair, on how many threads, and which directions run queued jobs together.

    ENGINE -> HOST     host.store                    (offload: a COPY)
    HOST -> ENGINE     host.load, unless too late    (a load: a COPY)
    HOST -> medium     tier.store_from_host          (write-through to disk, Redis)
    medium -> HOST     tier.load_to_host             (promotion); a tier with
                       tier.load_batch_to_host also runs the jobs queued together in one call

The copies run on a thread per direction (ThreadPoolHandler) where the host tier copies with
host pointers (native, numpy), and on device streams (streams.StreamHandler) where it copies
with torch ops: a pool on a GPU, whose copies are enqueued behind the engine's forward.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from kvport.connectors.offloading.config import OffloadingConfig, RedisTierConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import DISK, ENGINE, HOST, REDIS
from kvport.connectors.offloading.metrics import Counters
from kvport.connectors.offloading.tiers import DroppedKeys, TransferOutcome
from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.worker.streams import StreamHandler, queue_for
from kvport.connectors.offloading.worker.threads import ThreadPoolHandler
from kvport.connectors.offloading.worker.transfers import BatchFn, TransferFn, TransferRouter

if TYPE_CHECKING:
    from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
    from kvport.connectors.offloading.tiers.host.tier import HostTier


class LowerTier(Protocol):
    """A tier below the host tier (disk, Redis): it moves whole offload blocks between host slots
    and its own entries, by key. Runs on worker threads; never raises for its medium's faults
    (those are failed positions, counted in its stats). It may also have
    `load_batch_to_host(host, [(src, dst), ...]) -> [outcome, ...]`: several promotions in one
    call (`batch_routes`), and `protect(keys)` / `unprotect(keys)`: entries a planned promotion
    will read, kept from eviction until then (the worker's `_keep_entries`)."""

    @property
    def stats(self) -> Counters[Any]:
        """Its counters (metrics.Counters of DiskTierMetrics, RedisTierMetrics)."""

    @property
    def dropped(self) -> DroppedKeys:
        """Keys it dropped by itself since the last `take` (its removal events)."""

    def store_from_host(self, host: HostTier, src: HostBlocks, dst: Any) -> TransferOutcome: ...

    def load_to_host(self, host: HostTier, src: Any, dst: HostBlocks) -> TransferOutcome: ...

    def close(self) -> None:
        """Release connections (after the transfers stopped); must not block for long."""


def load_unless_late(host: HostTier, src: HostBlocks, dst: EngineBlocks) -> TransferOutcome:
    """HOST -> ENGINE, unless the destination's deadline has passed: then nothing is written
    and every block fails (the step that wanted it has recomputed it)."""
    if dst.deadline is not None and time.monotonic() > dst.deadline:
        return TransferOutcome(0, list(range(len(dst))))
    return host.load(src, dst)


def tier_routes(host: HostTier,
                lower: Mapping[str, LowerTier]) -> dict[tuple[str, str], TransferFn]:
    """The transfer functions of the standard wiring: ENGINE<->HOST copies, and HOST<->medium
    for each lower tier (medium name -> tier)."""
    routes: dict[tuple[str, str], TransferFn] = {
        (ENGINE, HOST): host.store,  # type: ignore[dict-item]
        (HOST, ENGINE): functools.partial(load_unless_late, host)}
    for medium, tier in lower.items():
        routes[(HOST, medium)] = functools.partial(tier.store_from_host, host)
        routes[(medium, HOST)] = functools.partial(tier.load_to_host, host)
    return routes


def batch_routes(host: HostTier, lower: Mapping[str, LowerTier]) -> dict[tuple[str, str], BatchFn]:
    """The promotions (medium -> HOST) whose tier loads several jobs in one call."""
    routes: dict[tuple[str, str], BatchFn] = {}
    for medium, tier in lower.items():
        load_batch = getattr(tier, "load_batch_to_host", None)
        if load_batch is not None:
            routes[(medium, HOST)] = functools.partial(load_batch, host)
    return routes


# Threads per direction between host memory and a lower tier. Disk: one; a job's entries are one
# extent of a run file read in file order, and a second thread reading another job at the same
# time breaks the device's stream into smaller requests (warm reads are bound by memory either
# way). Redis: two, so that one job's round trip overlaps another's. Measurements:
# docs/offloading.md, "Tuning constants".
LOWER_THREADS = {DISK: 1, REDIS: 2}

# A batch of promotions is what the tier's last call moved in BATCH_SECONDS at its rate,
# between one job and BATCH_MAX_BYTES (BATCH_BYTES before the first call): its jobs are reported
# together when it ends, so BATCH_SECONDS bounds what the first job waits for the others (well
# under an engine step). When the bytes turn cold after warm loads, one batch at the stale rate
# is read from the device; the next is sized anew. Larger calls amortize each call's fixed cost
# (the hand-off to the thread, the tier's plan, its read helper waking up). Measurements:
# docs/offloading.md, "Tuning constants".
BATCH_SECONDS = 0.015
BATCH_BYTES = 32 << 20
BATCH_MAX_BYTES = 128 << 20


def build_tier_worker(host: HostTier, lower: Mapping[str, LowerTier] | None = None,
                      host_threads: int = 1, lower_threads: int | None = None,
                      ) -> TransferRouter:
    """The standard wiring (`tier_routes`, `batch_routes`) on thread pools, one per direction;
    `lower_threads` None: LOWER_THREADS per medium.

    NOTE: one host thread per direction is enough: one native copy reaches the memory
    bandwidth (tiers/host/block_copy.c)."""
    worker = TransferRouter()
    batches = batch_routes(host, lower or {})
    first_blocks, max_blocks = (max(1, size // host.slot_bytes)
                                for size in (BATCH_BYTES, BATCH_MAX_BYTES))
    on_streams = host.strategy == "torch"
    for (src, dst), fn in tier_routes(host, lower or {}).items():
        if on_streams and ENGINE in (src, dst):
            worker.register_handler(src, dst, StreamHandler(
                fn, queue_for(host.device), f"{src.lower()}-{dst.lower()}"))
            continue
        medium = dst if src == HOST else src
        threads = (host_threads if ENGINE in (src, dst) else
                   lower_threads or LOWER_THREADS.get(medium, 2))
        batch = batches.get((src, dst))
        sizes = ({} if batch is None else
                 {"max_batch_blocks": max_blocks, "batch_seconds": BATCH_SECONDS,
                  "first_batch_blocks": first_blocks})
        worker.register_handler(src, dst, ThreadPoolHandler(
            fn, threads, f"{src.lower()}-{dst.lower()}", batch=batch, **sizes))
    return worker


def make_lower_tiers(config: OffloadingConfig, geometry: OffloadGeometry) -> dict[str, LowerTier]:
    """The configured tiers below host, top down (disk, then Redis), by medium."""
    lower: dict[str, LowerTier] = {}
    disk = config.disk_tier
    if disk is not None:
        lower[DISK] = DiskTier(disk.root_dir, disk.max_bytes, geometry.namespace,
                               group_access=disk.group_access)
    if config.redis_tier is not None:
        lower[REDIS] = _redis_tier(config.redis_tier, geometry.namespace)
    return lower


def _redis_tier(config: RedisTierConfig, namespace: bytes) -> LowerTier:
    # Imported here: redis-py is an optional dependency (kvport[redis]).
    from kvport.connectors.offloading.tiers.redis.tier import RedisTier

    return RedisTier(config, namespace)
