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
limit counts the run files (header included) of every process on the directory, in a ledger they
share (disk_ledger); a store that needs room evicts this process's least recently used runs whole,
all its names removed, since its space is freed only with its last name (keys of a job are a
request's consecutive blocks and are wanted together), and never a run a planned promotion will
read (`protect`). At start the tier lists its directory and groups names into runs by inode,
oldest run first: one stat per name, no file read; it removes the temp files of writers that
died, and sets the ledger to what it found. A run of another live process is adopted, with the
keys loaded from it, when a load reads it.

Privacy: files are created 0o600 and directories 0o700 (0o640 / 0o750 with `group_access`);
`root_dir` is created if missing; the namespace directory must be this user's and writable by
nobody else (else the tier refuses to start: anyone who can write there can plant entries).
Names are opened with O_NOFOLLOW and O_NONBLOCK and must be regular files: a symlink or a FIFO at
a key's name is removed, never followed or waited on; a symlink in place of a key directory is
removed at start.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvport.connectors.offloading.mediums import DiskBlocks, HostBlocks
from kvport.connectors.offloading.metrics import Counters, DiskTierMetrics
from kvport.connectors.offloading.tiers import DroppedKeys, TransferOutcome
from kvport.connectors.offloading.tiers.disk.location import (  # noqa: F401  (re-exported)
    DiskLocation, ScannedName, check_pairs, checksum, key_digest, unlink_quietly,
)
from kvport.connectors.offloading.tiers.disk.files import SWEEP_EVERY_S, RunFiles, RunId
from kvport.connectors.offloading.tiers.disk.index import RunIndex
from kvport.connectors.offloading.tiers.disk.ledger import Ledger, remove_names_locked
from kvport.connectors.offloading.tiers.disk.load import DiskLoader, publish_occupancy
from kvport.connectors.offloading.tiers.disk.read import PIECE_BYTES
from kvport.connectors.offloading.tiers.disk.runs import pack_run_header, run_bytes, write_run
from kvport.connectors.offloading.tiers.disk.setup import (
    CREATE_FLAGS, FULL_DISK, check_hard_links, prepare_directory,
)
from kvport.connectors.offloading.tiers.host.tier import HostTier

logger = logging.getLogger(__name__)

_STALE_TEMP_SECONDS = 3600.0  # a temp file this old has no live writer: remove it at start


class DiskTier:
    """Run files under `root_dir`, at most `max_bytes` of them for every process on it together.
    `num_threads` (torch's count by default, as the host tier's copies): threads, the caller's
    included, that read a large extent the page cache holds (disk_read.SPLIT_BYTES).
    `piece_bytes`: the most one read call asks for, in whole entries (one entry if larger), each
    piece hashed as it lands (disk_read.PIECE_BYTES by default)."""

    def __init__(self, root_dir: str | os.PathLike[str], max_bytes: int, namespace: bytes,
                 num_threads: int | None = None, group_access: bool = False,
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.index = RunIndex(max_bytes)  # checks max_bytes
        num_threads = torch.get_num_threads() if num_threads is None else num_threads
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.piece_bytes = piece_bytes
        self.location = DiskLocation(root_dir, namespace, group_access)
        self.namespace_digest = self.location.namespace_digest
        self.dir = self.location.dir
        prepare_directory(self.location, root_dir, group_access)
        self.stats = Counters(DiskTierMetrics)
        self.dropped = DroppedKeys()  # evicted by this process, or found gone
        self.files = RunFiles()  # run files kept open between load jobs
        self.ledger = Ledger(self.dir, self.location.file_mode)
        self.loader = DiskLoader(self.location, self.index, self.files, self.stats, self.ledger,
                                 num_threads - 1, piece_bytes)
        check_hard_links(self.location)
        self._rebuild_index()

    @property
    def max_bytes(self) -> int:
        return self.index.max_bytes

    def path(self, key: bytes) -> Path:
        return self.location.path(key)

    def _rebuild_index(self) -> None:
        with self.ledger.locked() as entry:  # no process changes the directory meanwhile
            scan = self.location.scan(_STALE_TEMP_SECONDS)
            runs: dict[RunId, list[ScannedName]] = {}
            for name in scan.names:
                runs.setdefault(name.inode, []).append(name)
            writing = sum(size for inode, size in scan.writing.items() if inode not in runs)
            entry.used = sum(names[0].size for names in runs.values()) + writing
        if scan.swept:
            logger.warning("disk tier %s: removed %d temp files of writers that died",
                           self.dir, scan.swept)
        self.stats.add(swept_temp_files=scan.swept, rejected=scan.rejected)
        for names in sorted(runs.values(), key=lambda n: n[0].mtime_ns):  # oldest run first
            self.index.add(names[0].inode, names[0].size, [n.key for n in names])
        if not self._make_room(0):  # a restart with a smaller max_bytes trims the oldest runs
            logger.warning("disk tier %s: other processes' runs hold more than max_bytes=%d",
                           self.dir, self.max_bytes)
        self._update_occupancy()

    def _update_occupancy(self) -> None:
        publish_occupancy(self.index, self.stats)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the accounting is off (tests call it after every scenario)."""
        self.index.check()
        used = self.ledger.read_used()
        if used < self.index.occupancy()[1]:
            raise RuntimeError(f"disk tier ledger: {used} bytes in use, fewer than this "
                               f"process's runs ({self.index.occupancy()[1]})")

    def close(self) -> None:
        """Close the run files kept open and end the read helpers (no load may run any more)."""
        self.loader.close()
        self.files.close()
        self.ledger.close()

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def protect(self, keys: Sequence[bytes]) -> None:
        """A planned promotion will read these keys: their runs are kept until `unprotect`."""
        self.index.protect(keys)

    def unprotect(self, keys: Sequence[bytes]) -> None:
        self.index.unprotect(keys)

    def _make_room(self, size: int, keep: frozenset[RunId] = frozenset()) -> bool:
        """Whether a run of `size` bytes fits with every process's runs (the ledger), after
        evicting this process's least recently used runs it needs; nothing is reserved."""
        with self.ledger.locked() as entry:
            return self._evict_locked(entry, size, keep)

    def _evict_locked(self, entry: Any, size: int, keep: frozenset[RunId]) -> bool:
        """Evict (the ledger's lock held) until the ledger says a run of `size` fits. A run
        the index counts may free less than its size, or nothing: another process evicted it
        (or some of its names) meanwhile, so the ledger, not the index, says when to stop."""
        while True:
            eviction = self.index.make_room(entry.used + size - self.max_bytes, keep)
            if eviction is None:
                self.stats.set(shared_bytes=entry.used)
                return False
            if not eviction.keys:
                break
            self._update_occupancy()
            # A job reading the run already keeps reading it; the space is freed (and the
            # ledger's count falls) with the last name.
            entry.used -= remove_names_locked(
                [self.location.path_str(key) for key in eviction.keys])
            self.files.drop(eviction.runs)
            self.stats.add(evictions=len(eviction.keys))
            self.dropped.add(list(eviction.keys))
        self.stats.set(shared_bytes=entry.used)
        return True

    def _reserve(self, size: int, keep: frozenset[RunId], num_keys: int) -> str | None:
        """Room for a run of `size` bytes (evicting for it), counted in the ledger, and its temp
        file created at that size, all under the ledger's lock: the temp file's path, or None
        (no room, or the file could not be made: the run's `num_keys` are counted skipped or
        failed)."""
        with self.ledger.locked() as entry:
            if not self._evict_locked(entry, size, keep):
                self.stats.add(skipped_stores=num_keys)
                return None
            tmp = self.location.temp_path_str()
            try:
                fd = os.open(tmp, CREATE_FLAGS, self.location.file_mode)
                try:
                    os.ftruncate(fd, size)  # its full size: a crash leaves what was counted
                finally:
                    os.close(fd)
            except OSError as exc:
                unlink_quietly(tmp)
                self._count_write_error(exc, num_keys)
                return None
            entry.used += size
            self.stats.set(shared_bytes=entry.used)
        if entry.lost is not None:  # not counted (a full file system): the run is not written
            unlink_quietly(tmp)
            self._count_write_error(entry.lost, num_keys)
            return None
        return tmp

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
        if len(todo) < len(keys):
            self.stats.add(already_present=len(keys) - len(todo))
        # runs others evicted: their space is freed at close (before a write, always)
        self.files.close_unlinked(0.0 if todo else SWEEP_EVERY_S)
        if not todo:
            return []
        # The runs of this job's held keys stay: the job counts them as stored.
        keep = frozenset(r for r in self.index.runs_of(keys) if r is not None)
        size = run_bytes(len(todo), payloads[0].nbytes)
        tmp = self._reserve(size, keep, len(todo))
        if tmp is None:
            return todo
        return self._write_run(tmp, keys, payloads, todo, size, start)

    def _held(self, key: bytes) -> bool:
        """Whether key's name is a regular file (refreshing its run); a name gone (another
        process evicted it) is dropped from the index, so the key is written again, and one that
        is not a regular file (a symlink, a FIFO) is removed first."""
        path = self.location.path_str(key)
        try:
            held = stat.S_ISREG(os.lstat(path).st_mode)
        except FileNotFoundError:
            held = False
        else:
            if not held:
                self.ledger.remove_names([path])
                self.stats.add(rejected=1)
                logger.warning("disk tier: %s was not a regular file; removed", path)
        if not held and key in self.index:
            self.dropped.add([key])  # another process evicted it
        self.index.refresh(key, held)
        if not held:
            self._update_occupancy()
        return held

    def _write_run(self, tmp: str, keys: Sequence[bytes], payloads: Sequence[memoryview],
                   todo: list[int], size: int, start: float) -> list[int]:
        run_keys = [keys[i] for i in todo]
        run_payloads = [payloads[i] for i in todo]
        header = pack_run_header(self.namespace_digest, run_keys, run_payloads)
        try:
            run_id = self._write_file(tmp, run_keys, header, run_payloads)
        except OSError as exc:
            self.ledger.remove_names([tmp])  # nothing named it: its bytes are freed
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
            # The run lives on under its keys' names, or is freed now (and leaves the ledger).
            self.ledger.remove_names([tmp])
        if linked:
            self.index.add(run_id, size, linked)
            self._update_occupancy()
        payload_bytes = payloads[0].nbytes
        self.stats.add(bytes_stored=len(linked) * payload_bytes, blocks_stored=len(linked),
                       store_seconds=time.perf_counter() - start)
        return failed

    def _write_file(self, tmp: str, keys: Sequence[bytes], header: bytes,
                    payloads: Sequence[memoryview]) -> RunId:
        """Write the run into the temp file at tmp, created at its size by `_reserve` (a seam
        for fault injection: tests' fault_tiers)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise OSError(errno.EEXIST, f"the temp file {tmp} was replaced")
            write_run(fd, header, payloads)
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
                os.makedirs(os.path.dirname(path), mode=self.location.dir_mode, exist_ok=True)
                os.link(tmp, path)
        except FileExistsError:
            return False
        return True

    def _count_write_error(self, exc: OSError, num_keys: int) -> None:
        if exc.errno in FULL_DISK:
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
        together: worker/wiring.py): consecutive entries of a run are read with one call even where
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
