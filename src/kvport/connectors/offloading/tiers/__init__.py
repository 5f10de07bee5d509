"""Storage tiers of the offloading connector (worker side): `host.HostTier` (primary, preallocated
host memory) and `disk.DiskTier` (local files below it, written through from the host tier).

A tier exposes transfer functions `(src, dst) -> TransferOutcome` that run synchronously on a
worker thread; `kvport.connectors.offloading.worker.transfers` wraps them in thread-pool handlers. This
module holds the records both tiers share; the tiers themselves are imported from their modules
(`tiers.host`, `tiers.disk`) so that importing one does not import the other.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class TransferOutcome:
    """What one synchronous transfer did. `failed_indices` are positions in the destination spec
    (engine block positions for an ENGINE destination) that were not filled."""

    num_bytes: int
    failed_indices: list[int] = field(default_factory=list)


@dataclass
class TierStats:
    """Counters of one tier. Bytes count payload only (not file headers). Thread-safe updates go
    through `add`; `snapshot` returns a plain dict for `KVConnectorOutput.stats`."""

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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def set(self, **values: float) -> None:
        """Counters that are levels, not sums (occupancy), set at once."""
        with self._lock:
            for name, value in values.items():
                setattr(self, name, value)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            # Not dataclasses.asdict: it would deep-copy the lock.
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}


@dataclass
class DiskTierStats(TierStats):
    """TierStats plus what only the disk tier sees. `occupancy_*` are this process's runs;
    `shared_bytes` is every process's on the directory (the shared ledger)."""

    other_format: int = 0  # run files of another format version: misses, left alone
    rejected: int = 0  # names removed: a bad entry or run header, a symlink or FIFO at a name
    swept_temp_files: int = 0  # temp files of crashed writers removed at start
    shared_bytes: int = 0  # the ledger: run files of every process sharing the directory
