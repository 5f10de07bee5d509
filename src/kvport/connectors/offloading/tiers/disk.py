"""Disk tier: each store job's entries in one run file, each key a hard link to it.

Layout: `<root>/<namespace digest hex[:16]>/<key hex[:2]>/<key hex>.kvb` names the run file
(format: disk_runs) holding the key's entry; every name of a run is a hard link to the same
file. The scheduler asks whether a key is held by its name alone (`DiskLocation.exists`).

Store (a HOST -> DISK job): the keys whose names do not exist yet are written as one run, with
one writev, to a temp file (`.run.<pid>.<thread>.<n>.tmp`), which then gets each key's name
(`os.link`) and loses its own: readers of any process see a key's whole entry or no name. A
name that appeared meanwhile (another writer of the same key) is kept; that entry of our run is
dead weight. No fsync (entries must survive the process, not a power cut); a torn or corrupt
entry is a miss and its name removed.

Load (a DISK -> HOST job; disk_load): the runs holding the job's keys (the index says which; a
key it does not know is opened by name), each kept open with its parsed header between jobs
(disk_files' RunFiles), then each extent of consecutive entries is read with sequential
`preadv`s straight into the host slots and checked piece by piece (disk_read): an entry once,
while its file is unchanged, since run files are never written once named. Cold, the kernel's
readahead turns these into large device requests, as for one sequential file (one file per entry
was at most one request of the entry's size: 0.47-0.72x of one file cold at 720 KiB, 0.83-1.14x
now).

Index and size limit: runs in LRU order (a load or a store of a key held refreshes its run). The
limit counts run files (header included) this process knows; the least recently used run is
evicted whole, all its names removed, since its space is freed only with its last name (keys of
a job are a request's consecutive blocks and are wanted together). At start the tier lists its
directory and groups names into runs by inode, oldest run first: one stat per name, no file
read. A run of another live process is adopted, with the keys loaded from it, when a load reads
it; processes sharing a directory each enforce their own view of the limit.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvport.connectors.offloading.mediums import DiskBlocks, HostBlocks
from kvport.connectors.offloading.tiers import TierStats, TransferOutcome
from kvport.connectors.offloading.tiers.disk_format import (  # noqa: F401  (re-exported)
    DiskLocation, ScannedName, check_pairs, checksum, disk_namespace, key_digest, unlink_quietly,
)
from kvport.connectors.offloading.tiers.disk_files import RunFiles, RunId
from kvport.connectors.offloading.tiers.disk_index import RunIndex
from kvport.connectors.offloading.tiers.disk_load import DiskLoader, publish_occupancy
from kvport.connectors.offloading.tiers.disk_runs import pack_run_header, run_bytes, write_run
from kvport.connectors.offloading.tiers.host import HostTier

logger = logging.getLogger(__name__)

_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
_STALE_TEMP_SECONDS = 3600.0  # a temp file this old has no live writer: remove it at start


class DiskTier:
    """Run files under `root_dir`, at most `max_bytes` of them known to this process.
    `num_threads` (torch's count by default, as the host tier's copies): threads, the caller's
    included, that read a large extent the page cache holds (disk_read.SPLIT_BYTES)."""

    def __init__(self, root_dir: str | os.PathLike[str], max_bytes: int, namespace: bytes,
                 num_threads: int | None = None) -> None:
        self.index = RunIndex(max_bytes)  # checks max_bytes
        num_threads = torch.get_num_threads() if num_threads is None else num_threads
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        root = Path(root_dir)
        if not root.is_dir():
            raise OSError(errno.ENOENT, f"disk tier root_dir {str(root)!r} is not a directory")
        self.location = DiskLocation(root, namespace)
        self.namespace_digest = self.location.namespace_digest
        self.dir = self.location.dir
        self.dir.mkdir(exist_ok=True)
        self.stats = TierStats()
        self.files = RunFiles()  # run files kept open between load jobs
        self.loader = DiskLoader(self.location, self.index, self.files, self.stats,
                                 num_threads - 1)
        self._check_hard_links()
        self._rebuild_index()

    @property
    def max_bytes(self) -> int:
        return self.index.max_bytes

    def path(self, key: bytes) -> Path:
        return self.location.path(key)

    def _check_hard_links(self) -> None:
        """Refuse, at construction, a directory whose file system cannot hard-link (FAT, some
        network file systems): every key's name is a link to its run file."""
        a = self.location.temp_path_str()
        b = self.location.temp_path_str()
        try:
            os.close(os.open(a, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.link(a, b)
        except OSError as exc:
            raise OSError(exc.errno, f"disk tier root_dir {str(self.dir.parent)!r}: cannot create "
                          f"hard links there ({exc.strerror}); the disk tier names each key by a "
                          f"hard link to its run file: use a directory on ext4, xfs, btrfs or "
                          f"tmpfs") from exc
        finally:
            unlink_quietly(a)
            unlink_quietly(b)

    def _rebuild_index(self) -> None:
        runs: dict[RunId, list[ScannedName]] = {}
        for name in self.location.scan(_STALE_TEMP_SECONDS):
            runs.setdefault(name.inode, []).append(name)
        for names in sorted(runs.values(), key=lambda n: n[0].mtime_ns):  # oldest run first
            self.index.add(names[0].inode, names[0].size, [n.key for n in names])
        self._make_room(0)  # a restart with a smaller max_bytes trims the oldest runs

    def _update_occupancy(self) -> None:
        publish_occupancy(self.index, self.stats)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the accounting is off (tests call it after every scenario)."""
        self.index.check()

    def close(self) -> None:
        """Close the run files kept open and end the read helpers (no load may run any more)."""
        self.loader.close()
        self.files.close()

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def _make_room(self, size: int, keep: frozenset[RunId] = frozenset()) -> bool:
        """Reserve room for a run of `size` bytes (RunIndex.make_room), removing the names of
        the runs evicted for it; False if it cannot fit."""
        eviction = self.index.make_room(size, keep)
        if eviction is None:
            return False
        self._update_occupancy()
        for key in eviction.keys:  # a job reading the run already keeps reading it
            unlink_quietly(self.location.path_str(key))
        self.files.drop(eviction.runs)  # its space is freed with its last descriptor
        self.stats.add(evictions=len(eviction.keys))
        return True

    # --- store ----------------------------------------------------------------------------------

    def write(self, key: bytes, payload: torch.Tensor) -> bool:
        """Store one payload ((n,) uint8, contiguous) under key, as a run of one. False if
        skipped or failed (counted). An existing entry is kept (same key = same bytes)."""
        return not self._store([key], [payload.numpy().data])

    def store_from_host(self, host: HostTier, src: HostBlocks, dst: DiskBlocks) -> TransferOutcome:
        """HOST -> DISK (write-through): slot src.slot_ids[i] is written as dst.keys[i]; the
        keys not held yet go into one run file."""
        check_pairs(src.slot_ids, dst.keys)
        failed = self._store(dst.keys, _slot_views(host, src.slot_ids))
        return TransferOutcome((len(dst.keys) - len(failed)) * host.slot_bytes, failed)

    def _store(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[int]:
        """Write the entries whose keys have no name yet as one run: the positions not stored
        (skipped for room or a full disk, or failed: counted; nothing half-written stays)."""
        start = time.perf_counter()
        todo = [i for i, key in enumerate(keys) if not self._held(key)]
        if not todo:
            return []
        # The runs of this job's held keys stay: the job counts them as stored.
        keep = frozenset(r for r in self.index.runs_of(keys) if r is not None)
        size = run_bytes(len(todo), payloads[0].nbytes)
        if not self._make_room(size, keep):
            self.stats.add(skipped_stores=len(todo))
            return todo
        try:
            return self._write_run(keys, payloads, todo, size, start)
        finally:
            self.index.release(size)

    def _held(self, key: bytes) -> bool:
        """Whether key's name exists (refreshing its run); a name gone (another process evicted
        it) is dropped from the index, so the key is written again."""
        held = os.path.exists(self.location.path_str(key))
        self.index.refresh(key, held)
        if not held:
            self._update_occupancy()
        return held

    def _write_run(self, keys: Sequence[bytes], payloads: Sequence[memoryview], todo: list[int],
                   size: int, start: float) -> list[int]:
        run_keys = [keys[i] for i in todo]
        run_payloads = [payloads[i] for i in todo]
        header = pack_run_header(self.namespace_digest, run_keys, run_payloads)
        tmp = self.location.temp_path_str()
        try:
            run_id = self._write_file(tmp, run_keys, header, run_payloads)
        except OSError as exc:
            unlink_quietly(tmp)
            self._count_write_error(exc, len(todo))
            return todo
        linked: list[bytes] = []
        failed: list[int] = []
        try:
            for i, key in zip(todo, run_keys):
                try:
                    if self._link(tmp, key):
                        linked.append(key)
                except OSError as exc:
                    self._count_write_error(exc, 1)
                    failed.append(i)
        finally:
            unlink_quietly(tmp)  # the run lives on under its keys' names (or is freed now)
        if linked:
            self.index.add(run_id, size, linked)
            self._update_occupancy()
        payload_bytes = payloads[0].nbytes
        self.stats.add(bytes_stored=len(linked) * payload_bytes, blocks_stored=len(linked),
                       store_seconds=time.perf_counter() - start)
        return failed

    def _write_file(self, tmp: str, keys: Sequence[bytes], header: bytes,
                    payloads: Sequence[memoryview]) -> RunId:
        """Write the run to a new file at tmp (a seam for fault injection: tests' fault_tiers)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_run(fd, header, payloads)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return st.st_ino

    def _link(self, tmp: str, key: bytes) -> bool:
        """Give the run at tmp key's name: False if the name exists (another writer's entry of
        the same key, kept)."""
        path = self.location.path_str(key)
        try:
            try:
                os.link(tmp, path)
            except FileNotFoundError:  # the name's directory is new: mkdir only then
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.link(tmp, path)
        except FileExistsError:
            return False
        return True

    def _count_write_error(self, exc: OSError, num_keys: int) -> None:
        if exc.errno in _FULL_DISK:
            self.stats.add(skipped_stores=num_keys)
            logger.warning("disk tier full (%s): store of %d entries skipped", exc, num_keys)
        else:
            self.stats.add(failures=num_keys)
            logger.warning("disk tier store of %d entries failed: %s", num_keys, exc)

    # --- load -----------------------------------------------------------------------------------

    def read_into(self, key: bytes, out: torch.Tensor) -> bool:
        """Fill out ((n,) uint8, contiguous) with key's payload; False (counted; out may be
        garbage) if missing, unreadable or corrupt (its name removed)."""
        return self.loader.load([key], [out.numpy().data])[0]

    def load_to_host(self, host: HostTier, src: DiskBlocks, dst: HostBlocks) -> TransferOutcome:
        """DISK -> HOST (promotion): entry src.keys[i] fills slot dst.slot_ids[i]."""
        check_pairs(src.keys, dst.slot_ids)
        return self.load_batch_to_host(host, [(src, dst)])[0]

    def load_batch_to_host(self, host: HostTier,
                           jobs: Sequence[tuple[DiskBlocks, HostBlocks]]) -> list[TransferOutcome]:
        """Several DISK -> HOST jobs read as one (the transfer thread takes the jobs queued
        together: tier_wiring): consecutive entries of a run are read with one call even where
        they belong to different jobs. Each job's outcome, in order."""
        keys: list[bytes] = []
        slots: list[int] = []
        for src, dst in jobs:
            check_pairs(src.keys, dst.slot_ids)
            keys += src.keys
            slots += dst.slot_ids
        done = self.loader.load(keys, _slot_views(host, slots))
        outcomes = []
        first = 0
        for src, _ in jobs:
            failed = [i for i, ok in enumerate(done[first:first + len(src.keys)]) if not ok]
            outcomes.append(TransferOutcome((len(src.keys) - len(failed)) * host.slot_bytes,
                                            failed))
            first += len(src.keys)
        return outcomes


def _slot_views(host: HostTier, slot_ids: Sequence[int]) -> list[memoryview]:
    """Each slot's bytes as a memoryview (slices of one view of the buffer: 0.2 us a slot, where
    a slot tensor's .numpy() costs 3)."""
    flat = host.buffer.numpy().data.cast("B")
    n = host.slot_bytes
    return [flat[s * n:(s + 1) * n] for s in slot_ids]
