"""The disk tier's index: which run files this process knows, the keys each holds, and their
sizes in least-recently-used order. Thread-safe; it decides which runs to evict, the tier
(disk.py) removes the names, closes the files and keeps the shared ledger (disk_ledger), which
counts the runs of every process on the directory.

A run's bytes stay on disk until its last name goes, so room is made by evicting runs whole, and
a key is indexed under one run: the run its name links to (as far as this process knows). Keys a
planned promotion will read are protected: their runs are not evicted until the load ended.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvport.connectors.offloading.tiers.disk.files import RunId


@dataclass
class _Run:
    size: int  # file bytes, header included: what the run holds on disk until its last name goes
    keys: set[bytes] = field(default_factory=set)  # keys whose names link to it, as known here


@dataclass(frozen=True)
class Eviction:
    """What making room evicted: the runs, and the names of their keys to remove."""

    runs: list[RunId]
    keys: list[bytes]


class RunIndex:
    """The runs this process knows, least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._runs: OrderedDict[RunId, _Run] = OrderedDict()
        self._key_run: dict[bytes, RunId] = {}
        self._used = 0  # sum of the runs' sizes
        self._protected: dict[bytes, int] = {}  # key -> loads that will read it
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._key_run

    def occupancy(self) -> tuple[int, int]:
        """(keys, bytes) indexed."""
        with self._lock:
            return len(self._key_run), self._used

    def num_keys(self, run_id: RunId) -> int:
        """Keys indexed under the run (0 if unknown)."""
        with self._lock:
            run = self._runs.get(run_id)
            return len(run.keys) if run is not None else 0

    def runs_of(self, keys: Sequence[bytes]) -> list[RunId | None]:
        with self._lock:
            return [self._key_run.get(key) for key in keys]

    def add(self, run_id: RunId, size: int, keys: Sequence[bytes]) -> None:
        """Index keys under their run of `size` bytes now (a new run is counted; a known one
        refreshed, its size updated: another writer may have cut it short)."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                run = self._runs[run_id] = _Run(size)
                self._used += size
            else:
                self._runs.move_to_end(run_id)
                self._used += size - run.size
                run.size = size
            if run.keys.issuperset(keys):  # a load of keys indexed here: only a refresh
                return
            for key in keys:
                if self._key_run.get(key, run_id) != run_id:
                    self._remove_key(key)  # its name links to another run now
                run.keys.add(key)
                self._key_run[key] = run_id

    def remove(self, key: bytes) -> None:
        """Forget key (its name is gone); a run left with no key is no longer counted."""
        with self._lock:
            self._remove_key(key)

    def refresh(self, key: bytes, held: bool) -> None:
        """A store found key's name (`held`: its run becomes the most recently used) or found
        it gone (another process evicted it: forgotten, so it is written again)."""
        with self._lock:
            run_id = self._key_run.get(key)
            if run_id is None:
                return
            if held:
                self._runs.move_to_end(run_id)
            else:
                self._remove_key(key)

    def make_room(self, need: int, keep: frozenset[RunId] = frozenset()) -> Eviction | None:
        """Evict the least recently used runs that free at least `need` bytes, never one in
        `keep` (runs holding keys of the store that asks) nor one holding a protected key;
        None, evicting nothing, if they cannot (`need` <= 0: nothing to evict)."""
        with self._lock:
            keep = keep | {self._key_run[k] for k in self._protected if k in self._key_run}
            victims: list[RunId] = []
            freed = 0
            for run_id, run in self._runs.items():  # least recently used first
                if freed >= need:
                    break
                if run_id not in keep:
                    victims.append(run_id)
                    freed += run.size
            if freed < need:
                return None
            names: list[bytes] = []
            for run_id in victims:
                run = self._runs.pop(run_id)
                self._used -= run.size
                for key in run.keys:
                    del self._key_run[key]
                names += run.keys
            return Eviction(victims, names)

    def protect(self, keys: Sequence[bytes]) -> None:
        """A load will read these keys: their runs are not evicted until `unprotect`."""
        with self._lock:
            for key in keys:
                self._protected[key] = self._protected.get(key, 0) + 1

    def unprotect(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                left = self._protected.get(key, 0) - 1
                if left > 0:
                    self._protected[key] = left
                else:
                    self._protected.pop(key, None)

    def check(self) -> None:
        """Raise RuntimeError if the accounting is off (tests call it after every scenario)."""
        with self._lock:
            total = sum(run.size for run in self._runs.values())
            listed = sum(len(run.keys) for run in self._runs.values())
            consistent = listed == len(self._key_run) and all(
                run.keys and all(self._key_run.get(k) == run_id for k in run.keys)
                for run_id, run in self._runs.items())
            if (total != self._used or self._used > self.max_bytes or self._protected
                    or not consistent):
                raise RuntimeError(f"disk tier accounting: used {self._used}, runs' sum {total}, "
                                   f"max {self.max_bytes}, {len(self._protected)} protected "
                                   f"keys, keys {len(self._key_run)} (runs list {listed})")

    def _remove_key(self, key: bytes) -> None:  # with the lock held
        run_id = self._key_run.pop(key, None)
        if run_id is None:
            return
        run = self._runs[run_id]
        run.keys.discard(key)
        if not run.keys:  # its last name known here: the file is gone (or another process's)
            del self._runs[run_id]
            self._used -= run.size
