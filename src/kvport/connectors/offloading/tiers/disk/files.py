"""The disk tier's run files kept open between load jobs, with what each one's header says and
which of its entries were checked.

`RunFiles` keeps each run's file open (and its parsed header) between jobs, at most `capacity`
of them: consecutive jobs over a run then read one open file, whose readahead state sees one
sequential stream (cold jobs of 8 entries: 0.78-0.81x of one file, 0.55-0.64x with a fresh open
per job), and a job pays no open, stat or header read. A run file is never written once its names
exist, so an entry checked once through an open run need not be hashed again while the file is
unchanged: `acquire` compares the file's stamp (size, mtime, ctime) with the one at open, and a
file written since, or a name of it removed, is dropped, its entries unchecked (disk_read says
what the check is for).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvport.connectors.offloading.tiers.disk.location import key_digest
from kvport.connectors.offloading.tiers.disk.runs import RunHeader

# Loads close the runs others evicted at most this often (a sweep of 64 open runs costs ~0.1 ms;
# every 20 ms bounds that to 0.5 % of a busy thread): until then, their space stays allocated.
SWEEP_EVERY_S = 0.02

# A run file's inode, shared by its names: the file's identity while any name or descriptor of it
# lives (a write into it changes its stamp, not its identity).
RunId = int
Stamp = tuple[int, int, int]  # (size, mtime ns, ctime ns): a write or an unlink changes it


def file_stamp(st: os.stat_result) -> Stamp:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass
class OpenRun:
    """An open run file, what its header says, and which of its entries were checked."""

    run_id: RunId
    fd: int
    stamp: Stamp  # the file's at open
    header: RunHeader
    links: int = 1  # its names at open (unchanged while the stamp is: an unlink moves ctime)
    # checked[position]: the entry was read through this descriptor and matched its xxh3.
    checked: bytearray = field(init=False)
    # key -> (position, payload xxh3), filled as keys are looked up: a key's digest once a run
    _by_key: dict[bytes, tuple[int, int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.checked = bytearray(self.header.num_entries if self.header is not None else 0)

    def entry(self, key: bytes) -> tuple[int, int] | None:
        """Where key's entry lies in the run and its xxh3; None if the run does not hold it."""
        found = self._by_key.get(key)
        if found is None:
            found = self.header.entries.get(key_digest(key))
            if found is not None:
                self._by_key[key] = found
        return found

    def entries(self, keys: list[bytes]) -> list[tuple[int, int] | None]:
        """entry(key) of each key (one lookup each for keys looked up before)."""
        get = self._by_key.get
        found = [get(key) for key in keys]
        if None in found:
            found = [f if f is not None else self.entry(k) for k, f in zip(keys, found)]
        return found

    @property
    def size(self) -> int:
        return self.stamp[0]


@dataclass
class _Cached:
    run: OpenRun
    users: int = 0  # jobs reading it now
    dropped: bool = False  # evicted or gone: closed when its last user releases it


class RunFiles:
    """Open run files shared by load jobs (module docstring). `acquire`/`add` hand a job a run
    it may read until it `release`s it; `drop` closes a run once no job reads it (its names were
    removed: the file's space is freed only with its last descriptor)."""

    def __init__(self, capacity: int = 64) -> None:
        assert capacity >= 1, capacity
        self.capacity = capacity
        self._runs: OrderedDict[RunId, _Cached] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._swept = float("-inf")  # monotonic time of the last close_unlinked sweep
        # A tier nobody closes (tests, tools) must not leak descriptors.
        self._finalizer = weakref.finalize(self, _close_all, self._runs)

    def acquire(self, run_id: RunId) -> OpenRun | None:
        """The open run, in use by the caller, unless it is not open here, every name of it is
        gone (another process evicted it: closed now) or the file changed since it was opened
        (written, or a name removed: dropped, its entries unchecked, so that the caller reopens
        it by name and reads its header again)."""
        with self._lock:
            cached = self._runs.get(run_id)
            if cached is None or cached.dropped:
                return None
            # every name gone (evicted by another process) is a change too: ctime moved
            if changed_since_open(cached.run):
                cached.run.checked[:] = bytes(len(cached.run.checked))
                self._drop_locked(run_id)
                return None
            cached.users += 1
            self._runs.move_to_end(run_id)
            return cached.run

    def add(self, run: OpenRun) -> OpenRun:
        """Keep a run the caller opened (in use by it). If another job added the same run
        meanwhile, the caller's descriptor is closed and that one handed out instead (still
        readable if it was dropped since: it closes with its last job)."""
        with self._lock:
            cached = self._runs.get(run.run_id)
            if cached is None:
                self._runs[run.run_id] = _Cached(run, users=1)
                self._trim_locked()
                return run
            os.close(run.fd)
            cached.users += 1
            self._runs.move_to_end(run.run_id)
            return cached.run

    def release(self, runs: Iterable[OpenRun]) -> None:
        with self._lock:
            for run in runs:
                cached = self._runs[run.run_id]  # kept until its last job released it
                assert cached.run is run and cached.users > 0, "a run released twice"
                cached.users -= 1
                if cached.dropped and cached.users == 0:
                    del self._runs[run.run_id]
                    os.close(run.fd)
            self._trim_locked()

    def drop(self, run_ids: Iterable[RunId]) -> None:
        with self._lock:
            for run_id in run_ids:
                if run_id in self._runs:
                    self._drop_locked(run_id)

    def close_unlinked(self, every_s: float = 0.0) -> int:
        """Close the runs no job reads whose every name is gone (another process evicted them):
        their space is freed only with their last descriptor. Not again within `every_s` of
        the last sweep. The number closed."""
        with self._lock:
            now = time.monotonic()
            if now - self._swept < every_s:
                return 0
            self._swept = now
            gone = []
            for run_id, cached in self._runs.items():
                if cached.users == 0:
                    try:
                        if os.fstat(cached.run.fd).st_nlink == 0:
                            gone.append(run_id)
                    except OSError:
                        gone.append(run_id)
            for run_id in gone:
                self._drop_locked(run_id)
            return len(gone)

    def close(self) -> None:
        """Close every run file: now those no job reads, the others when their job ends."""
        with self._lock:
            for run_id in list(self._runs):
                self._drop_locked(run_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)

    def _drop_locked(self, run_id: RunId) -> None:
        cached = self._runs[run_id]
        cached.dropped = True
        if cached.users == 0:
            del self._runs[run_id]
            os.close(cached.run.fd)

    def _trim_locked(self) -> None:
        """Close the least recently used runs no job reads, down to `capacity`."""
        excess = len(self._runs) - self.capacity
        if excess <= 0:  # the common case: no scan of every run at each job's release
            return
        for run_id in [k for k, c in self._runs.items() if c.users == 0][:excess]:
            os.close(self._runs.pop(run_id).run.fd)


def _close_all(runs: OrderedDict[RunId, _Cached]) -> None:
    for cached in runs.values():
        os.close(cached.run.fd)
    runs.clear()


def changed_since_open(run: OpenRun) -> bool:
    """Whether the run's file was written, or a name of it removed, since it was opened."""
    try:
        return file_stamp(os.fstat(run.fd)) != run.stamp
    except OSError:
        return True
