"""The one-file baselines of the disk rows of `kvport bench transfer`, and the block device's
counters a cold side is watched with.

- checked: the file read in the tier's pieces, each entry hashed with the tier's xxh3 right after
  its piece landed: what the tier's first read of an entry costs at best;
- split: the file read in one part per thread the tier reads a large cached extent with, at
  once: the best plain read of the file with the tier's threads;
- the page cache dropped for a list of files (fsynced first: dirty pages cannot be dropped), and
  the device's read requests and their mean size while a side ran (/sys/dev/block), which tell
  whether the reads of neighbouring entries were merged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

from kvport.connectors.offloading.tiers.disk.location import checksum


def read_checked(path: Path, out: memoryview, entry_bytes: int, piece_bytes: int) -> None:
    """One file into out, a piece at a time (`piece_bytes` in whole entries, one entry if
    larger), each entry hashed right after its piece landed."""
    piece = max(1, piece_bytes // entry_bytes) * entry_bytes
    with open(path, "rb", buffering=0) as fh:
        for start in range(0, out.nbytes, piece):
            view = out[start:start + piece]
            fh.readinto(view)
            for e in range(0, view.nbytes, entry_bytes):
                checksum(view[e:e + entry_bytes])


def read_split(path: Path, out: memoryview, entry_bytes: int, pool: ThreadPoolExecutor,
               k: int) -> None:
    """`preadv` of the file into out, cut at whole entries into k parts read at once: k - 1 on
    the pool's threads, one on the caller's (what the tier does with an extent held in the page
    cache)."""
    entries = len(out) // entry_bytes
    bounds = [entries * g // k * entry_bytes for g in range(k)] + [len(out)]
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = [pool.submit(os.preadv, fd, [out[lo:hi]], lo)
                 for lo, hi in pairwise(bounds[1:])]
        os.preadv(fd, [out[:bounds[1]]], 0)
        for part in parts:
            part.result()
    finally:
        os.close(fd)


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def block_device_stat(path: Path) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the device holding `path` (None where there is none)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def count_requests(stat: Path | None, fn: Callable[[], object],
                   out: list[tuple[int, int]]) -> Callable[[], None]:
    """fn, recording (read requests, mean KiB per request) of the device while it ran."""
    def counted() -> None:
        before = _read_counters(stat)
        fn()
        after = _read_counters(stat)
        if before and after:
            reqs, sectors = after[0] - before[0], after[2] - before[2]
            out.append((reqs, sectors // 2 // max(reqs, 1)))
    return counted


def _read_counters(stat: Path | None) -> list[int] | None:
    if stat is None:
        return None
    try:
        return [int(x) for x in stat.read_text().split()]
    except (OSError, ValueError):
        return None
