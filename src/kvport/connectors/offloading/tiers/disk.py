"""Disk tier: one file per offload block under a namespaced directory, shared across processes.

Layout: `<root>/<namespace digest hex[:16]>/<key hex[:2]>/<key hex>.kvb`; each file is a header
and the payload (the offload block's bytes, as the host tier holds them); see disk_format.

Writes go to a temp file in the entry's directory (`.<key hex>.<pid>.<thread>.tmp`) that is then
`os.replace`d onto the final name, so readers (this process or another) see either no entry or a
whole one. There is no fsync: entries must survive the process, not a power cut, and a torn file
left by a crash fails its checksum and is removed. A header or checksum mismatch is a miss and
removes the file.

Index: at start the tier lists its directory and orders entries by mtime (write time), oldest
first. No file is read: headers are checked lazily, on load, so a start costs one stat per entry.
Loads refresh recency in memory only (touching mtime would cost a metadata write per load).
Whether an entry exists is asked of the file system (`DiskLocation.exists`, which the scheduler
half uses), so an entry another live process wrote is found; a load adopts it into the index. The size limit covers the entries this process knows and is enforced at store time
by removing the least recently stored or loaded ones; processes sharing a directory each enforce
their own view.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from kvport.connectors.offloading.mediums import DiskBlocks, HostBlocks
from kvport.connectors.offloading.tiers import TierStats, TransferOutcome
from kvport.connectors.offloading.tiers.disk_format import (  # noqa: F401  (re-exported)
    FORMAT_VERSION, HEADER, HEADER_SIZE, MAGIC, SUFFIX, DiskLocation, checksum, disk_namespace,
    header_ok, pack_header,
)
from kvport.connectors.offloading.tiers.host import HostTier

logger = logging.getLogger(__name__)

_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
_STALE_TEMP_SECONDS = 3600.0  # a temp file this old has no live writer: remove it at start


class DiskTier:
    """Files under `root_dir`, at most `max_bytes` (header included) known to this process."""

    def __init__(self, root_dir: str | os.PathLike[str], max_bytes: int, namespace: bytes) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        root = Path(root_dir)
        if not root.is_dir():
            raise OSError(errno.ENOENT, f"disk tier root_dir {str(root)!r} is not a directory")
        self.max_bytes = max_bytes
        self.location = DiskLocation(root, namespace)
        self.namespace_digest = self.location.namespace_digest
        self.dir = self.location.dir
        self.dir.mkdir(exist_ok=True)
        self.stats = TierStats()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._used = 0  # sum of self._index's sizes
        self._reserved = 0  # bytes of writes in flight (room made, not yet in the index)
        self._lock = threading.Lock()
        self._nowait_ok = hasattr(os, "RWF_NOWAIT")  # reads that fail instead of waiting
        self._rebuild_index()

    # --- paths and index ----------------------------------------------------------------------

    def path(self, key: bytes) -> Path:
        return self.location.path(key)

    def _rebuild_index(self) -> None:
        now = time.time()
        found: list[tuple[float, bytes, int]] = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                    if entry.name.endswith(".tmp"):
                        # A torn write of a dead process; live writers finish far sooner.
                        if now - st.st_mtime > _STALE_TEMP_SECONDS:
                            os.unlink(entry.path)
                        continue
                    if entry.name.endswith(SUFFIX):
                        key = bytes.fromhex(entry.name[:-len(SUFFIX)])
                        found.append((st.st_mtime, key, st.st_size))
                except (OSError, ValueError):
                    continue  # removed meanwhile, or a foreign name: not ours
        for _, key, size in sorted(found):
            self._put(key, size)
        self._make_room(0)  # a restart with a smaller max_bytes trims the oldest entries

    # _put, _pop and _update_occupancy run with self._lock held (or before other threads exist).
    def _put(self, key: bytes, size: int) -> None:
        self._used += size - self._index.get(key, 0)
        self._index[key] = size
        self._index.move_to_end(key)

    def _pop(self, key: bytes) -> None:
        self._used -= self._index.pop(key, 0)

    def _update_occupancy(self) -> None:
        with self.stats._lock:
            self.stats.occupancy_blocks = len(self._index)
            self.stats.occupancy_bytes = self._used

    def check_integrity(self) -> None:
        """Raise RuntimeError if the accounting is off (tests call it after every scenario)."""
        with self._lock:
            total = sum(self._index.values())
            if total != self._used or self._reserved != 0 or self._used > self.max_bytes:
                raise RuntimeError(f"disk tier accounting: used {self._used}, index sum {total}, "
                                   f"reserved {self._reserved}, max {self.max_bytes}")

    def _drop(self, key: bytes) -> None:
        with self._lock:
            self._pop(key)
            self._update_occupancy()

    def close(self) -> None:
        """Nothing to release: every file is closed when its transfer ends."""

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    # --- store ----------------------------------------------------------------------------------

    def write(self, key: bytes, payload: torch.Tensor) -> bool:
        """Store payload ((n,) uint8, contiguous) under key. False if skipped or failed (counted);
        nothing half-written stays behind. An existing entry is kept (same key = same bytes)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        size = HEADER_SIZE + payload.numel()
        if not self._make_room(size):
            self.stats.add(skipped_stores=1)
            return False
        try:
            return self._write_reserved(key, payload, size)
        finally:
            with self._lock:
                self._reserved -= size

    def _write_reserved(self, key: bytes, payload: torch.Tensor, size: int) -> bool:
        start = time.perf_counter()
        data = payload.numpy().data  # memoryview over the tensor's bytes
        header = pack_header(self.namespace_digest, key, data)
        final = self.path(key)
        tmp = final.with_name(f".{final.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            final.parent.mkdir(exist_ok=True)
            self._write_file(tmp, header, data)
            os.replace(tmp, final)
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in _FULL_DISK:
                self.stats.add(skipped_stores=1)
                logger.warning("disk tier full (%s): store of %s skipped", exc, key.hex()[:16])
            else:
                self.stats.add(failures=1)
                logger.warning("disk tier store of %s failed", key.hex()[:16], exc_info=True)
            return False
        with self._lock:
            self._put(key, size)
            self._update_occupancy()
        self.stats.add(bytes_stored=data.nbytes, blocks_stored=1,
                       store_seconds=time.perf_counter() - start)
        return True

    def _write_file(self, tmp: Path, header: bytes, payload: memoryview) -> None:
        # A seam for fault injection (tests/offloading/fault_tiers.py).
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)

    def _make_room(self, size: int) -> bool:
        """Reserve room for an entry of `size` bytes, evicting the least recently used entries
        it needs; False, evicting nothing, if it cannot fit even in an empty index (larger than
        the tier, or the room is held by writes in flight)."""
        victims: list[bytes] = []
        with self._lock:
            # Decide first: only entries in the index can be evicted, writes in flight cannot.
            if self._reserved + size > self.max_bytes:
                return False
            while self._used + self._reserved + size > self.max_bytes:
                victim = next(iter(self._index))  # least recently used
                self._pop(victim)
                victims.append(victim)
            self._reserved += size
            self._update_occupancy()
        for victim in victims:
            _unlink(self.path(victim))  # a reader that opened it already keeps reading it
        self.stats.add(evictions=len(victims))
        return True

    # --- load -----------------------------------------------------------------------------------

    def prefetch(self, keys: list[bytes]) -> dict[bytes, int]:
        """Open the entries and ask the kernel to read them ahead (POSIX_FADV_WILLNEED), so a
        job's files are fetched from the device concurrently instead of one after the other.
        Returns key -> open fd for read_into (which closes it); missing entries are left out."""
        fds: dict[bytes, int] = {}
        for key in dict.fromkeys(keys):  # a key twice in one job: one fd
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except OSError:
                continue
            fds[key] = fd
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return fds

    def read_into(self, key: bytes, out: torch.Tensor, fd: int | None = None,
                  cached_only: bool = False) -> bool | None:
        """Fill out ((n,) uint8, contiguous) with key's payload (from `fd` if given: it is then
        closed). False on a missing entry, an I/O error or a header/checksum mismatch (the bad
        file is removed); out may then be garbage. With `cached_only`, None (and nothing
        counted) when the entry is not wholly in the page cache: the read would wait for the
        device."""
        path = self.path(key)
        start = time.perf_counter()
        data = out.numpy().data
        raw = bytearray(HEADER_SIZE)
        try:
            # One preadv fills header and payload: 3 syscalls per entry (open, preadv, close),
            # which is what per-file overhead comes down to at small entry sizes.
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
            try:
                if cached_only:
                    if not self._nowait_ok:
                        return None
                    try:
                        got = os.preadv(fd, [raw, data], 0, os.RWF_NOWAIT)
                    except BlockingIOError:
                        return None
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
                        self._nowait_ok = False  # this file system cannot tell: always wait
                        return None
                    if got != HEADER_SIZE + data.nbytes:
                        return None  # partly cached (or short: the waiting read decides)
                else:
                    got = os.preadv(fd, [raw, data], 0)
            finally:
                os.close(fd)
            if not header_ok(self.namespace_digest, bytes(raw), key, data.nbytes):
                return self._reject(key, path, "bad header")
            if got != HEADER_SIZE + data.nbytes:
                return self._reject(key, path, f"{got} bytes, not {HEADER_SIZE + data.nbytes}")
            if checksum(data) != HEADER.unpack_from(raw)[7]:
                return self._reject(key, path, "checksum mismatch")
        except FileNotFoundError:
            self._drop(key)
            self.stats.add(failures=1)
            return False
        except OSError:
            logger.warning("disk tier load of %s failed", key.hex()[:16], exc_info=True)
            self.stats.add(failures=1)
            return False
        with self._lock:
            self._put(key, HEADER_SIZE + data.nbytes)
            self._update_occupancy()
        self.stats.add(bytes_loaded=data.nbytes, blocks_loaded=1,
                       load_seconds=time.perf_counter() - start)
        return True

    def _reject(self, key: bytes, path: Path, why: str) -> bool:
        logger.warning("disk tier entry %s rejected (%s); removed", path, why)
        _unlink(path)
        self._drop(key)
        self.stats.add(failures=1)
        return False

    # --- transfers (run on worker threads) ------------------------------------------------------

    def store_from_host(self, host: HostTier, src: HostBlocks, dst: DiskBlocks) -> TransferOutcome:
        """HOST -> DISK (write-through): slot src.slot_ids[i] is written as dst.keys[i]."""
        _check_pairs(src.slot_ids, dst.keys)
        failed = [i for i, (s, k) in enumerate(zip(src.slot_ids, dst.keys))
                  if not self.write(k, host.slot(s))]
        return TransferOutcome((len(dst.keys) - len(failed)) * host.slot_bytes, failed)

    def load_to_host(self, host: HostTier, src: DiskBlocks, dst: HostBlocks) -> TransferOutcome:
        """DISK -> HOST (promotion): entry src.keys[i] fills slot dst.slot_ids[i].

        Entries wholly in the page cache are read first, without waiting (RWF_NOWAIT). The
        others are then prefetched together (so the device fetches them concurrently) and read.
        NOTE: prefetching every entry up front cost 15 us per warm 720 KiB entry (the kernel
        walks the file's cached pages), 20 % of its read time."""
        _check_pairs(src.keys, dst.slot_ids)
        failed: list[int] = []
        cold: list[int] = []
        for i, (k, s) in enumerate(zip(src.keys, dst.slot_ids)):
            done = self.read_into(k, host.slot(s), cached_only=True)
            if done is None:
                cold.append(i)
            elif not done:
                failed.append(i)
        cold_keys = [src.keys[i] for i in cold]
        fds = self.prefetch(cold_keys) if len(cold) > 1 else {}
        try:
            failed += [i for i in cold
                       if not self.read_into(src.keys[i], host.slot(dst.slot_ids[i]),
                                             fds.pop(src.keys[i], None))]
        finally:
            for fd in fds.values():  # left open only if a read raised
                os.close(fd)
        return TransferOutcome((len(src.keys) - len(failed)) * host.slot_bytes, sorted(failed))


def _check_pairs(src: list[int] | list[bytes], dst: list[int] | list[bytes]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"source has {len(src)} blocks, destination {len(dst)}")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("disk tier could not remove %s", path, exc_info=True)
