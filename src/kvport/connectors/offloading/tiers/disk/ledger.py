"""The disk tier's shared ledger: the bytes of run files under one namespace directory, counted by
every process that shares the directory, so that together they stay within `max_bytes`.

The ledger is a file (`.ledger`, 8 bytes: the bytes in use, little endian) in the directory,
read and written under an exclusive `flock` (and a thread lock: flock does not order the threads
of one process). What counts: every run file with a name (its size), and every run being written
(its temp file, which the writer creates at its full size under the lock, before writing it).

    reserve  a writer makes room (its own least recently used runs evicted, under the lock) and
             adds its run's size, then creates the temp file, all under the lock
    free     a run's last name removed (by whoever removes it: eviction, a bad entry, a store
             that linked nothing, a dead writer's temp file swept) subtracts its size
    reset    a process that starts lists the directory (disk.py) and, under the lock, sets the
             ledger to what it found: the named runs and the temp files of live writers

Because every change happens under the lock, a run's last name is known to be the last (its
link count is 1 before the unlink) and is subtracted exactly once. A process killed between two
steps leaves a temp file at its run's full size, which the next process to start sweeps (its
writer's pid is in its name) and subtracts; so the ledger drifts by no crash, and a restart sets
it right in any case. The space of a run whose last name is gone but which a process still holds
open stays allocated until that process closes it (disk_files closes such runs at its next job).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("kvport.connectors.offloading.tiers.disk.tier")
LEDGER_NAME = ".ledger"
_USED = struct.Struct("<Q")


class Ledger:
    """The bytes in use under `directory`, shared by the processes on it (module docstring)."""

    def __init__(self, directory: Path, file_mode: int) -> None:
        self.path = directory / LEDGER_NAME
        self._mode = file_mode
        self._threads = threading.Lock()
        self._fd = -1
        self._open()

    def _open(self) -> int:
        """The ledger's descriptor (opened again after close: a closed tier may be used on).
        A new ledger gets its 8 bytes at once (under the lock: another process may be writing
        its first count), so that later writes overwrite allocated bytes; on a full file system
        it stays short, and writes that fail are counted as skipped stores (`locked`)."""
        if self._fd < 0:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(self.path, flags | os.O_NONBLOCK, self._mode)
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO planted there: refused
                os.close(fd)
                raise OSError(errno.EINVAL, f"disk tier ledger {str(self.path)!r} is not a "
                              f"regular file")
            self._fd = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < _USED.size:
                    os.pwrite(fd, _USED.pack(0), 0)
            except OSError as exc:
                logger.warning("disk tier ledger %s could not be written: %s", self.path, exc)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return self._fd

    @contextlib.contextmanager
    def locked(self) -> Iterator[_Entry]:
        """The ledger, held exclusively (other threads and processes wait) until the block ends;
        what the block sets is written when it ends. A write that fails (a full file system)
        raises nothing: `entry.lost` says so, the count on file stays the old one (a reserve
        must then be undone; a free not counted only overstates the use until a restart)."""
        with self._threads:
            fcntl.flock(self._open(), fcntl.LOCK_EX)
            try:
                entry = _Entry(self._read())
                yield entry
                if entry.used != entry.read:
                    try:
                        os.pwrite(self._fd, _USED.pack(max(0, entry.used)), 0)
                    except OSError as exc:
                        entry.lost = exc
                        logger.warning("disk tier ledger %s not written (%s): %d bytes in use "
                                       "not counted", self.path, exc, entry.used - entry.read)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def used(self) -> int:
        with self.locked() as entry:
            return entry.used

    def read_used(self) -> int:
        """The bytes in use as the file says now (no lock: a check, also after close)."""
        try:
            raw = self.path.read_bytes()
        except OSError:
            return 0
        return _USED.unpack(raw[:_USED.size])[0] if len(raw) >= _USED.size else 0

    def add(self, delta: int) -> None:
        with self.locked() as entry:
            entry.used += delta

    def remove_names(self, paths: list[str]) -> int:
        """Remove these names under the lock (remove_names_locked); the bytes freed."""
        with self.locked() as entry:
            freed = remove_names_locked(paths)
            entry.used -= freed
        return freed

    def _read(self) -> int:
        raw = os.pread(self._fd, _USED.size, 0)
        return _USED.unpack(raw)[0] if len(raw) == _USED.size else 0

    def close(self) -> None:
        with self._threads:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def remove_names_locked(paths: list[str]) -> int:
    """Remove these names (a missing one is fine), the ledger's lock held by the caller: the bytes
    of the runs whose last name went, for the caller to subtract. Symlinks and other non-files
    are removed without counting."""
    freed = 0
    for path in paths:
        try:
            st = os.lstat(path)
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError:
            logger.warning("disk tier could not remove %s", path, exc_info=True)
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            freed += st.st_size
    return freed


class _Entry:
    """The ledger's value inside `Ledger.locked`."""

    __slots__ = ("lost", "read", "used")

    def __init__(self, used: int) -> None:
        self.read = used
        self.used = used
        self.lost: OSError | None = None  # the write of `used` failed
