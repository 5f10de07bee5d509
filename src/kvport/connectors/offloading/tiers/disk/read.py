"""Reading load jobs' entries out of run files into host slots, each checked against its
record's xxh3 the first time this process reads it; the run files are open already (disk_files).

A job's entries of one run are read extent by extent (runs of consecutive positions), with
blocking `preadv`s in file order in pieces of `piece_bytes` (the disk tier's, PIECE_BYTES by
default), each piece hashed right after it
lands, while it is still in the cache. Cold, the kernel's sequential readahead streams the
extent in large device requests, as it does one sequential file (queueing the extent with
POSIX_FADV_WILLNEED first was slower: docs/offloading.md, "Tuning constants")

What the check is for: a run file is never written once its names exist, so an entry can only be
bad from before this process opened it: torn by a crash (no fsync), cut short, or a foreign or
damaged file. An entry checked once through an open run is therefore not hashed again while its
file is unchanged: `RunFiles.acquire` (disk_files) compares the file's size, mtime and ctime
with those at open, and a file written since (or a name of it removed) is reopened and every
entry checked anew; a file that changed while a job read it (compared again after the reads)
has that job's unhashed entries hashed from their slots after all. The trade: a device that
later returns other bytes than it stored, without an I/O error, goes unnoticed until the run is
reopened (at the latest when the process restarts). That makes a warm re-read the kernel's copy
alone (hashing each read: 0.66-0.74x of one sequential file; the same file read and hashed,
0.78-0.93x, was the ceiling). Tried and dropped for the hash itself: hashing in a mapping of the
file and copying with streaming stores (as fast, and a mapped page the device fails to read is a
SIGBUS), a helper thread hashing each piece.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvport.connectors.offloading.tiers.disk.files import OpenRun, changed_since_open
from kvport.connectors.offloading.tiers.disk.location import checksum
from kvport.connectors.offloading.tiers.disk.runs import IOV_MAX
from kvport.connectors.offloading.tiers.disk.page_cache import has_holes, holds_whole
from kvport.connectors.offloading.tiers.parts import run_in_parts

# The default piece: entries are read in pieces of whole entries up to this size (one entry if
# larger), and each is hashed right after its piece landed, while it is still in the cache; no
# read call asks for more than this. A DiskTier takes its own (`piece_bytes`).
PIECE_BYTES = 1 << 20
# A cached extent this large is read by several threads at once: the kernel's copy out of the
# page cache is one thread's memcpy, and two threads' reads held a rate one thread reached only
# in phases. Below it the hand-off to a helper outweighs the gain. Cold reads are never split: the
# device, not the copy, sets their pace, and two streams would break the kernel's readahead.
SPLIT_BYTES = 16 << 20

Entry = tuple[int, memoryview, int]  # (position in the run, destination slot, payload xxh3)


@dataclass(frozen=True)
class ReadProblem:
    """Why an entry was not loaded. `bad`: the entry itself is (short or corrupt), so its name
    goes; otherwise the read failed (an I/O error, maybe transient) and the entry stays."""

    why: str
    bad: bool


def read_entries(run: OpenRun, entries: Sequence[Entry], helpers: ThreadPoolExecutor | None = None,
                 num_helpers: int = 0,
                 piece_bytes: int = PIECE_BYTES) -> list[ReadProblem | None]:
    """Fill each entry's slot (entries sorted by position): per entry None if read and intact,
    else why not. Consecutive positions are read together, in pieces of at most `piece_bytes`
    (whole entries; one entry if larger), in one pass: at 720 KiB entries the Python per entry
    showed (a pass grouping extents first and then cutting pieces cost 2.7 us an entry, 5 %).
    `helpers` (with `num_helpers` threads) share the reads of a large extent held in the page
    cache (_read_held)."""
    payload = run.header.payload_bytes
    assert all(out.nbytes == payload for _, out, _ in entries), f"slots not of {payload} B"
    why: list[ReadProblem | None] = [None] * len(entries)
    unhashed: list[int] = []  # entries read without a hash: checked before
    if _read_held(run, entries, helpers, num_helpers):
        unhashed = list(range(len(entries)))
    else:
        _read_ahead_holes(run, entries)
        per_piece = max(1, min(IOV_MAX, piece_bytes // payload))
        piece: list[int] = []  # indices into entries: consecutive positions
        last = -2
        for k, (position, _, _) in enumerate(entries):
            if piece and (position != last + 1 or len(piece) == per_piece):
                _read_piece(run, entries, piece, why, unhashed, piece_bytes)
                piece = []
            piece.append(k)
            last = position
        if piece:
            _read_piece(run, entries, piece, why, unhashed, piece_bytes)
    if unhashed and changed_since_open(run):
        # Written while this job read it (acquire saw it unchanged): what the slots got may be
        # torn, so those entries are hashed after all, from the slots.
        for k in unhashed:
            if checksum(entries[k][1]) != entries[k][2]:
                why[k] = ReadProblem("checksum mismatch (the run file changed while read)",
                                     bad=True)
    return why


def _read_held(run: OpenRun, entries: Sequence[Entry], helpers: ThreadPoolExecutor | None,
               num_helpers: int) -> bool:
    """Whether the entries, checked before and at consecutive positions, were read whole with
    `preadv`s of up to IOV_MAX entries each: only where the page cache holds every page of them
    (page_cache.holds_whole), since a cold read streams only in calls of a piece. Warm
    720 KiB entries: a job of 91 read so ran 0.91-0.93x of one file's `readinto`, read an entry
    a call 0.83-0.86x. From SPLIT_BYTES on, this thread and up to num_parts - 1 helpers read it at
    once, range by range (parts.run_in_parts). False (nothing to trust in the slots) if not so, or
    if a call fell short or failed: the piece reads then read every entry and say why."""
    payload = run.header.payload_bytes
    first = entries[0][0]
    # each position the one after the last (a key asked twice in a job is not an extent)
    if (not all(position == first + i and run.checked[position]
                for i, (position, _, _) in enumerate(entries))
            or not holds_whole(run.fd, run.header.offset(first), len(entries) * payload)):
        return False
    views = [out for _, out, _ in entries]
    offset = run.header.offset(first)
    k = num_parts(len(entries), payload, num_helpers)
    if helpers is None or k < 2:
        return _read_exactly(run.fd, views, offset, payload)
    return all(run_in_parts(len(entries), k, lambda lo, hi: _read_exactly(
        run.fd, views[lo:hi], offset + lo * payload, payload), helpers))


def num_parts(num_entries: int, payload: int, num_helpers: int) -> int:
    """How many threads (the caller and helpers) read a cached extent at once: one per half of
    SPLIT_BYTES at most (many cores must not share a read in pieces that cost more to hand
    off than to copy); 1 below SPLIT_BYTES."""
    size = num_entries * payload
    if size < SPLIT_BYTES:
        return 1
    return max(1, min(num_helpers + 1, num_entries, size // (SPLIT_BYTES // 2)))


def _read_exactly(fd: int, views: Sequence[memoryview], offset: int, payload: int) -> bool:
    """Whether every view was filled from offset on, with calls of up to IOV_MAX views."""
    for b in range(0, len(views), IOV_MAX):
        batch = views[b:b + IOV_MAX]
        try:
            got = os.preadv(fd, batch, offset + b * payload)
        except OSError:
            return False
        if got != len(batch) * payload:
            return False
    return True


def _read_ahead_holes(run: OpenRun, entries: Sequence[Entry]) -> None:
    """Where the page cache holds the job's span with holes (pages dropped here and there, as
    this VM's DAMON `pageout` does to idle files: `page_cache.has_holes`), ask the kernel for
    all its missing pages at once (POSIX_FADV_WILLNEED reads only those), before the reads
    wait for them one miss at a time: 90 MiB with every other 4 MiB dropped, in one job, read
    in 27-32 ms instead of 55 (one file with the same holes: 56-59 ms), every other 1 MiB 20-23
    instead of 30. Not where the cached pages are a prefix of the span: that is what the
    kernel's readahead for the previous job of a sequential read leaves, and asking then
    broke its stream (cold jobs of 8 entries: 53 against 46 ms). Nor for a span much larger
    than the job's entries (a job with gaps)."""
    payload = run.header.payload_bytes
    start = run.header.offset(entries[0][0])
    size = run.header.offset(entries[-1][0]) + payload - start
    if size <= 2 * len(entries) * payload and has_holes(run.fd, start, size):
        try:
            os.posix_fadvise(run.fd, start, size, os.POSIX_FADV_WILLNEED)
        except OSError:  # a hint only: the reads find the pages either way
            pass


def _read_piece(run: OpenRun, entries: Sequence[Entry], piece: list[int],
                why: list[ReadProblem | None], unhashed: list[int], piece_bytes: int) -> None:
    """One piece with blocking `preadv`s, each entry checked as it lands, but for those checked
    before (listed in `unhashed`)."""
    payload = run.header.payload_bytes
    views = [entries[k][1] for k in piece]
    try:
        got = _read_fully(run.fd, views, run.header.offset(entries[piece[0]][0]), piece_bytes)
    except OSError as exc:
        for k in piece:
            why[k] = ReadProblem(f"read failed: {exc}", bad=False)
        return
    for j, k in enumerate(piece):
        position = entries[k][0]
        if (j + 1) * payload > got:
            why[k] = ReadProblem("the run file is shorter than its header says", bad=True)
        elif run.checked[position]:
            unhashed.append(k)  # matched before, and the file unchanged since (docstring)
        elif checksum(views[j]) != entries[k][2]:
            why[k] = ReadProblem("checksum mismatch", bad=True)
        else:
            run.checked[position] = 1


def _read_fully(fd: int, views: list[memoryview], offset: int, piece_bytes: int) -> int:
    """Bytes read into views from offset: all of them, or fewer at the end of the file. At most
    `piece_bytes` a call: the kernel streams a run of 1 MiB reads better than one read of a whole
    large entry (5.6 MiB entries cold: 0.79-0.87x of one file, 0.67-0.75x read whole)."""
    total = sum(v.nbytes for v in views)
    done = 0
    if total <= piece_bytes:  # the common case, one call (no _span: its Python shows per entry)
        done = os.preadv(fd, views, offset)
        if done <= 0 or done == total:
            return max(done, 0)
    while done < total:
        want = min(piece_bytes, total - done)
        got = os.preadv(fd, _span(views, done, want), offset + done)
        if got <= 0:
            break
        done += got
    return done


def _span(views: list[memoryview], skip: int, size: int) -> list[memoryview]:
    """The buffers' bytes [skip, skip + size)."""
    out = []
    for v in views:
        if size <= 0:
            break
        if skip >= v.nbytes:
            skip -= v.nbytes
            continue
        part = v[skip:skip + size]
        out.append(part)
        size -= part.nbytes
        skip = 0
    return out
