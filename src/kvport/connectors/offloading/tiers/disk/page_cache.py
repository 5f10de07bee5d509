"""Whether the page cache holds a whole byte range of a file, asked of the kernel without
touching the file: `cachestat` (Linux 6.5+), one system call, no mapping, no readahead.

The disk tier reads a run's entries in calls of at most 1 MiB, so that a cold read streams
(the kernel's readahead turns it into large device requests); a range the cache holds whole can
be read with one call instead. Where the kernel lacks the call (older kernels, seccomp filters,
not Linux), `holds_whole` says False and the tier reads as if the range were cold.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys
import tempfile
from typing import Any

PAGE = mmap.PAGESIZE  # cachestat counts the kernel's pages (16 or 64 KiB on some arm64)
_SYS_CACHESTAT = 451  # one number on every Linux architecture (the unified syscall table)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


def _syscall() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None


_call = _syscall()


def holds_whole(fd: int, offset: int, size: int) -> bool:
    """Whether every page of [offset, offset + size) of the file open at fd is in the page
    cache; False where the kernel cannot tell."""
    held = _cached_pages(fd, offset, size)
    return held is not None and held[0] >= held[1]


def has_holes(fd: int, offset: int, size: int) -> bool:
    """Whether the page cache holds some of [offset, offset + size) of the file open at fd, but
    not as one run from its start: pages missing between cached ones, or at its start. False
    for a range held whole, not at all, or only as a prefix (what a sequential reader's
    readahead leaves), and where the kernel cannot tell."""
    held = _cached_pages(fd, offset, size)
    if held is None or held[0] == 0 or held[0] >= held[1]:
        return False
    prefix = _cached_pages(fd, offset, held[0] * PAGE - offset % PAGE)
    return prefix is None or prefix[0] != held[0]


def _cached_pages(fd: int, offset: int, size: int) -> tuple[int, int] | None:
    """(pages of the range in the page cache, pages the range spans); None where the kernel
    cannot tell."""
    global _call
    if _call is None or size <= 0:
        return None
    first, last = offset // PAGE, (offset + size - 1) // PAGE
    span = _Range(first * PAGE, (last - first + 1) * PAGE)
    stat = _Stat()
    if _call(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
            _call = None  # not on this kernel: never asked again
        return None
    return stat.nr_cache, last - first + 1


def available() -> bool:
    """Whether this kernel answers (asked of a temporary file)."""
    with tempfile.TemporaryFile() as f:
        f.write(b"x")
        f.flush()
        holds_whole(f.fileno(), 0, 1)
    return _call is not None
