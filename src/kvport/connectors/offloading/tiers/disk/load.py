"""The disk tier's load half: a job's keys read from the run files that hold them.

For each key the index's run is used while the index knows every name of that run (the common
case: no name is looked up); otherwise the key's name is stat'ed or opened, and the run it
links to is read (another process's run is adopted into the index once read from). Each run is
kept open with its parsed header between jobs (disk_files' RunFiles), and each run's entries are
read in position order, straight into the destination buffers (disk_read). A key whose name is
gone is forgotten; a key whose entry or run header is bad has its name removed. Both are misses,
never errors: the scheduler recomputes what a load does not deliver.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from kvport.connectors.offloading.metrics import Counters, DiskTierMetrics
from kvport.connectors.offloading.tiers.disk.files import (
    SWEEP_EVERY_S, OpenRun, RunFiles, RunId, file_stamp,
)
from kvport.connectors.offloading.tiers.disk.location import DiskLocation
from kvport.connectors.offloading.tiers.disk.index import RunIndex
from kvport.connectors.offloading.tiers.disk.ledger import Ledger
from kvport.connectors.offloading.tiers.disk.read import PIECE_BYTES, read_entries
from kvport.connectors.offloading.tiers.disk.runs import read_run_header
from kvport.connectors.offloading.tiers.value_format import Verdict

logger = logging.getLogger(__name__)
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def publish_occupancy(index: RunIndex, stats: Counters[DiskTierMetrics]) -> None:
    """The index's blocks and bytes as the tier's occupancy counters."""
    blocks, used = index.occupancy()
    stats.set(occupancy_blocks=blocks, occupancy_bytes=used)


class DiskLoader:
    """Loads entries for the disk tier, sharing its index, open runs, stats and directory;
    `num_helpers` threads share the reads of large cached extents with the caller's; no read
    call asks for more than `piece_bytes` (disk_read)."""

    def __init__(self, location: DiskLocation, index: RunIndex, files: RunFiles,
                 stats: Counters[DiskTierMetrics], ledger: Ledger, num_helpers: int = 0,
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.location = location
        self.ledger = ledger
        self.namespace_digest = location.namespace_digest
        self.index = index
        self.files = files
        self.stats = stats
        self.num_helpers = num_helpers
        self.piece_bytes = piece_bytes
        # threads start at the first split read (ThreadPoolExecutor starts them on demand)
        self._helpers = (ThreadPoolExecutor(num_helpers, "kvport-disk-read")
                         if num_helpers > 0 else None)

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    def load(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[bool]:
        """Read every key's entry into its buffer (module docstring): True where read and
        intact; failures are counted, and a bad entry's name removed."""
        if not keys:
            return []
        start = time.perf_counter()
        # runs other processes evicted: their space is freed at close (not on every job: cost)
        self.files.close_unlinked(SWEEP_EVERY_S)
        payload_bytes = outs[0].nbytes
        runs: dict[RunId, OpenRun] = {}  # the runs this job reads, in use until it ends
        # runs of this job whose header said no, and what it said: read once a job
        bad: dict[RunId, Verdict] = {}
        plan: dict[RunId, list[tuple[int, int, int]]] = {}  # run -> (position, index, xxh3)
        done = [False] * len(keys)
        try:
            for run_id, indices in _by_run(self.index.runs_of(keys)).items():
                run = (None if run_id is None else
                       runs.get(run_id) or self._known_run(run_id, runs))
                linked = True  # whether the index knows every name of run (see _planned)
                if run is not None:
                    linked = run.links == self.index.num_keys(run_id)
                    found = run.entries([keys[i] for i in indices])
                    if linked and None not in found:  # the common case: no name to look up
                        plan.setdefault(run_id, []).extend(
                            (entry[0], i, entry[1])
                            for i, entry in zip(indices, cast(list[tuple[int, int]], found)))
                        continue
                for i in indices:  # one by one: names to stat, keys to open by name
                    got = self._planned(keys[i], run, linked, payload_bytes, runs, bad)
                    if got is not None:
                        plan.setdefault(got[0].run_id, []).append((got[1][0], i, got[1][1]))
            for run_id, entries in plan.items():
                entries.sort()
                why = read_entries(runs[run_id], [(p, outs[i], x) for p, i, x in entries],
                                   self._helpers, self.num_helpers, self.piece_bytes)
                for (_, i, _), problem in zip(entries, why):
                    if problem is None:
                        done[i] = True
                    elif problem.bad:
                        self._reject(keys[i], problem.why)
                    else:
                        logger.warning("disk tier load of %s failed: %s", keys[i].hex()[:16],
                                       problem.why)
        finally:
            self.files.release(runs.values())
        num_loaded = sum(done)
        for run_id, entries in plan.items():  # index (adopting other processes' runs), refresh
            got = [keys[i] for _, i, _ in entries if done[i]]
            if got:
                self.index.add(run_id, runs[run_id].size, got)
        publish_occupancy(self.index, self.stats)
        self.stats.add(bytes_loaded=num_loaded * payload_bytes, blocks_loaded=num_loaded,
                       failures=len(keys) - num_loaded, load_seconds=time.perf_counter() - start)
        return done

    def _planned(self, key: bytes, run: OpenRun | None, linked: bool, payload_bytes: int,
                 runs: dict[RunId, OpenRun],
                 bad: dict[RunId, Verdict]) -> tuple[OpenRun, tuple[int, int]] | None:
        """The run and entry key is read from: in `run` (the one the index says, open) if its
        name still links there, else the run its name links to; None if none (the name gone:
        forgotten; a run that does not hold it: the name removed).

        `linked`: the index knows every name of `run`. If not (another process removed some,
        or shares the run) the name is stat'ed: removing a name changes the file's stamp, so a
        run open since then is reopened (RunFiles.acquire) and counted again."""
        if run is not None:
            if not linked and not os.path.exists(self.location.path_str(key)):
                self._forget(key)
                return None
            entry = run.entry(key)
            if entry is not None:
                return run, entry
        run = self._open(key, payload_bytes, runs, bad)
        if run is None:
            return None
        entry = run.entry(key)
        if entry is None:  # a renamed or foreign file
            self._reject(key, "its run file does not hold the key")
            return None
        return run, entry

    def _known_run(self, run_id: RunId, runs: dict[RunId, OpenRun]) -> OpenRun | None:
        """The run the index says holds a key, if the open files have it (in use by this job
        from now on); the caller looked in `runs` first."""
        run = self.files.acquire(run_id)
        if run is not None:
            runs[run_id] = run
        return run

    def _open(self, key: bytes, payload_bytes: int, runs: dict[RunId, OpenRun],
              bad: dict[RunId, Verdict]) -> OpenRun | None:
        """The run key's name links to, with its header read (once: kept open in `files`), in
        use by this job; None if the name is gone (dropped from the index), unreadable or its run
        bad (name removed)."""
        path = self.location.path_str(key)
        try:
            # Never through a symlink, and never blocking on a FIFO planted at the name.
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:  # evicted by another process, or never there
            self._forget(key)
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink at the name: not an entry of ours
                self._reject(key, "a symlink, not a run file")
            else:
                logger.warning("disk tier load of %s failed: %s", key.hex()[:16], exc)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                self._reject(key, "not a regular file")
                return None
            run_id = st.st_ino
            run = runs.get(run_id) or self.files.acquire(run_id)
            if run is not None:
                os.close(fd)
                runs[run_id] = run
                return run
            header = bad.get(run_id) or read_run_header(fd, self.namespace_digest,
                                                        payload_bytes, st.st_size)
        except OSError as exc:
            os.close(fd)
            logger.warning("disk tier load of %s failed: %s", key.hex()[:16], exc)
            return None
        if isinstance(header, Verdict):
            os.close(fd)
            # The verdict is the run's, for each of its keys: another version's run is a miss
            # for all of them (left to its readers), not "bad" from its second key on.
            first = run_id not in bad
            bad[run_id] = header
            if header is Verdict.OTHER_FORMAT:
                self.stats.add(other_format=int(first))
            else:
                self._reject(key, "bad run header")
            return None
        opened = OpenRun(run_id, fd, file_stamp(st), header, st.st_nlink)
        run = runs[run_id] = self.files.add(opened)
        return run

    def _reject(self, key: bytes, why: str) -> None:
        """A bad entry: its name removed, so no later lookup finds it."""
        path = self.location.path_str(key)
        logger.warning("disk tier entry %s rejected (%s); removed", path, why)
        self.ledger.remove_names([path])
        self.stats.add(rejected=1)
        self._forget(key)

    def _forget(self, key: bytes) -> None:
        self.index.remove(key)
        publish_occupancy(self.index, self.stats)


def _by_run(known: list[RunId | None]) -> dict[RunId | None, list[int]]:
    """The positions of a job's keys per run the index says holds them (None: not indexed), in
    job order; without a loop when they share one run (a job's keys are usually one store's)."""
    if known.count(known[0]) == len(known):
        return {known[0]: list(range(len(known)))}
    groups: dict[RunId | None, list[int]] = {}
    for i, run_id in enumerate(known):
        groups.setdefault(run_id, []).append(i)
    return groups
