"""Fault injection for the offloading tiers and transfer worker (tests only).

    FaultyTransfer   a transfer function wrapper: fail the Nth call, hold calls until released
    FaultyDisk       a DiskTier whose writes raise (full disk, I/O error, after a torn half write)
                     and whose stored entries (payload or run header) can be corrupted on disk
    wait_until       poll a condition with a deadline (tests never sleep to wait for threads)
    drop_page_cache  a file's pages out of the page cache: the next read of it is cold
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from polling import poll_until
from kvport.connectors.offloading.mediums import LoadStoreSpec
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.disk.location import key_digest
from kvport.connectors.offloading.tiers.disk.runs import PAGE, RECORD, RUN_FIXED

DEADLINE_S = 10.0


def wait_until(cond: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    """Poll cond (yielding the GIL to the transfer threads) until true, or fail."""
    poll_until(cond, "condition", timeout)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class FaultyTransfer:
    """Calls are numbered from 1 in the order they start. `fail_on`: numbers that raise OSError;
    `hold_on`: numbers that block until `release(n)` (or `release_all()`), then run normally."""

    def __init__(self, inner: Callable[[LoadStoreSpec, LoadStoreSpec], TransferOutcome] | None
                 = None, fail_on: set[int] | None = None, hold_on: set[int] | None = None) -> None:
        self.inner = inner or (lambda src, dst: TransferOutcome(len(dst)))
        self.fail_on = set(fail_on or ())
        self.hold_on = set(hold_on or ())
        self.num_calls = 0
        self.started: set[int] = set()  # call numbers that started
        self.finished: set[int] = set()  # call numbers that returned or raised
        self._gates: dict[int, threading.Event] = {n: threading.Event() for n in self.hold_on}
        self._lock = threading.Lock()

    def __call__(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        with self._lock:
            self.num_calls += 1
            n = self.num_calls
            self.started.add(n)
        try:
            if n in self._gates:
                self._gates[n].wait()
            if n in self.fail_on:
                raise OSError(errno.EIO, f"injected failure of call {n}")
            return self.inner(src, dst)
        finally:
            with self._lock:
                self.finished.add(n)

    def release(self, n: int) -> None:
        self._gates[n].set()

    def release_all(self) -> None:
        for gate in self._gates.values():
            gate.set()


class FaultyDisk(DiskTier):
    """`write_errno`: the next writes raise OSError(errno) after writing half the run file (a
    torn write), until set back to None."""

    write_errno: int | None = None

    def _write_file(self, tmp: str, keys: Sequence[bytes], header: bytes,
                    payloads: Sequence[memoryview]) -> int:
        if self.write_errno is None:
            return super()._write_file(tmp, keys, header, payloads)
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payloads[0][: len(payloads[0]) // 2])
        raise OSError(self.write_errno, os.strerror(self.write_errno))

    def entry_offset(self, key: bytes) -> int:
        """Where key's payload starts in the run file its name links to."""
        with open(self.path(key), "rb") as f:
            raw = f.read(PAGE)
            count = RUN_FIXED.unpack_from(raw)[6]
            header_size = RUN_FIXED.unpack_from(raw)[3]
            payload_bytes = RUN_FIXED.unpack_from(raw)[5]
            raw += f.read(header_size - PAGE)
        digests = [RECORD.unpack_from(raw, RUN_FIXED.size + i * RECORD.size)[0]
                   for i in range(count)]
        return header_size + digests.index(key_digest(key)) * payload_bytes

    def corrupt_payload(self, key: bytes, offset: int = 0) -> None:
        """Flip one payload byte of key's entry in place."""
        self._flip(self.path(key), self.entry_offset(key) + offset)

    def corrupt_header(self, key: bytes, offset: int = 16) -> None:
        """Flip one byte of the run header of key's file (default: the namespace digest's
        first; offset 8 is the format version, which makes the run another version's)."""
        self._flip(self.path(key), offset)

    @staticmethod
    def _flip(path: Path, pos: int) -> None:
        flip_byte(path, pos)


def evict_name(disk: DiskTier, key: bytes) -> None:
    """Remove key's name as another process's eviction does: through the directory's shared
    ledger (which frees the run's bytes with its last name). A bare unlink is an operator's rm,
    which the ledger learns only at the next restart."""
    disk.ledger.remove_names([disk.location.path_str(key)])


def flip_byte(path: Path, pos: int) -> None:
    """Flip one byte of a file in place, as a foreign writer would. Its mtime then moves on by
    1 ns: the write shows in the file's stamp even within one tick of the kernel's coarse clock
    (a checked entry is hashed again only once its file's stamp changed: disk_files)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
