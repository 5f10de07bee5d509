"""Crash, power-loss and several-process chaos for the disk tier (review section 4, items 1-3).

- kill -9 of a writer at each injected point (disk_chaos_child.KILL_POINTS), several seeds; after
  each, a fresh tier: every named key loads byte-exact, the dead writer's temp files are swept,
  and the ledger equals the bytes the names hold. KVPORT_DISK_CHAOS_SEEDS: seeds per point.
- Power loss (the tier does not fsync): the data of named files zeroed or cut short, metadata
  kept: misses only, never wrong bytes; bad names removed; the accounting adds up.
- Four processes on one small root: reads exact, usage within max_bytes under the ledger's lock,
  descriptors bounded, no stray files. KVPORT_DISK_CHAOS_SECONDS sets the workload's length
  (default 8 s; the report's minute-long run: 60).
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import random
import selectors
import subprocess
import sys
import time
from pathlib import Path

from disk_chaos import (
    NS, PAYLOAD, assert_accounted, dir_state, ids_of, key, load, run_size, store,
)
from disk_chaos import small_fs  # noqa: F401  (a fixture)
from disk_chaos_child import KILL_POINTS, NUM_KEYS
from polling import poll_until

from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.disk.location import DiskLocation
from kvport.connectors.offloading.tiers.disk.ledger import LEDGER_NAME
from kvport.connectors.offloading.tiers.disk.runs import header_size

HERE = Path(__file__).resolve().parent
CHILD = str(HERE / "disk_chaos_child.py")
SEEDS = range(int(os.environ.get("KVPORT_DISK_CHAOS_SEEDS", "3")))  # 25: 200 kills
MAX_BYTES = 10 * run_size(4)  # about a third of NUM_KEYS' entries: stores evict
ANSWER_S = 30.0  # one writer's run (300 ops at most), on 2 shared cores


def _env() -> dict[str, str]:
    """The children import disk_chaos and polling (tests/offloading, tests) and kvport as the
    test does."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parent), *sys.path[:0], env.get("PYTHONPATH", "")])
    return env


def _answer(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise AssertionError(f"the chaos zygote did not answer within {timeout_s} s")
    return proc.stdout.readline()


def _check_after_crash(root: Path, what: str) -> int:
    """A fresh tier after a writer died: its temp files swept, every named key exact, the
    ledger equal to the names' bytes. The number of keys named."""
    directory = DiskLocation(root, NS).dir
    before = dir_state(directory)
    fresh = DiskTier(root, MAX_BYTES, NS, num_threads=1)
    try:
        assert fresh.stats.snapshot().swept_temp_files == len(before.temps), what
        state = assert_accounted(fresh)
        named = ids_of(state, range(NUM_KEYS))
        # No name ever links to a run not written whole: every named key loads, exactly.
        assert load(fresh, named) == set(named), what
        assert_accounted(fresh)
        return len(named)
    finally:
        fresh.close()


def test_kill_9_at_each_point_leaves_exact_entries_and_no_temp_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    zygote = subprocess.Popen([sys.executable, CHILD, "zygote", str(root), str(MAX_BYTES)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=_env())
    assert zygote.stdin is not None
    killed: collections.Counter[str] = collections.Counter()
    named = 0
    try:
        for seed in SEEDS:
            for point in KILL_POINTS:
                zygote.stdin.write(f"{point} {seed}\n")
                zygote.stdin.flush()
                answer = _answer(zygote, ANSWER_S).split()
                assert answer[:2] == [point, str(seed)], answer
                assert answer[2:] in (["killed"], ["exited", "0"]), answer  # 3: wrong bytes
                killed[point] += answer[2] == "killed"
                named = max(named, _check_after_crash(root, f"{point} seed {seed}"))
    finally:
        zygote.stdin.close()
        zygote.wait(ANSWER_S)
    assert zygote.returncode == 0
    assert all(killed[p] >= 2 for p in KILL_POINTS), killed  # each point came, mostly
    assert named >= 8  # the writers stored something that survived
    print(json.dumps({"writers": len(SEEDS) * len(KILL_POINTS), "killed": killed,
                      "most_keys_named": named}))


def _damage(path: Path, how: str, rng: random.Random, n: int) -> set[int]:
    """Damage the run file of n entries at path as a power loss may (its pages lost, its
    metadata kept): the positions of the entries this makes bad."""
    size = path.stat().st_size
    h = header_size(n)
    if how == "intact":
        return set()
    if how == "cut":  # the size survived the crash shorter than written
        cut = rng.randrange(0, size)
        os.truncate(path, cut)
        return set(range(n)) if cut < h else {i for i in range(n) if h + (i + 1) * PAYLOAD > cut}
    with open(path, "r+b") as f:
        if how == "zero-all":  # the size kept, no data page written back
            f.write(bytes(size))
            return set(range(n))
        if how == "zero-header":
            f.write(bytes(h))
            return set(range(n))
        start = h + rng.randrange(0, n * PAYLOAD - 4096)  # one page of payloads lost
        start -= start % 4096
        f.seek(start)
        f.write(bytes(4096))
        return {i for i in range(n)
                if h + i * PAYLOAD < start + 4096 and h + (i + 1) * PAYLOAD > start}


def test_power_loss_of_named_files_data_is_misses_never_wrong_bytes(tmp_path: Path) -> None:
    rng = random.Random(30)
    disk = DiskTier(tmp_path, 1 << 24, NS, num_threads=1)
    runs: list[list[int]] = []
    for r in range(15):
        runs.append(list(range(10 * r, 10 * r + rng.randint(1, 4))))
        assert store(disk, runs[-1]) == []
    disk.close()
    hows = ["intact", "cut", "zero-all", "zero-header", "zero-page"] * 3
    bad: set[int] = set()
    for ids, how in zip(runs, hows):
        bad |= {ids[p] for p in _damage(disk.path(key(ids[0])), how, rng, len(ids))}
    every = [i for ids in runs for i in ids]
    assert 0 < len(bad) < len(every)
    fresh = DiskTier(tmp_path, 1 << 24, NS, num_threads=1)
    assert load(fresh, every) == set(every) - bad  # byte-exact, or a miss
    for i in every:
        assert fresh.location.exists(key(i)) == (i not in bad), i  # bad names removed
    assert load(fresh, every) == set(every) - bad
    assert fresh.stats.snapshot().rejected == len(bad)
    assert_accounted(fresh)
    assert_accounted(DiskTier(tmp_path, 1 << 24, NS, num_threads=1))


def _locked_usage(directory: Path) -> tuple[int, int, int]:
    """(the ledger's count, the bytes of every distinct file named or being written, the bytes
    the file system allocated them), read under the ledger's lock, so that no writer is between
    two steps."""
    fd = os.open(directory / LEDGER_NAME, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        files = {}
        for path in [*dir_state(directory).temps, *directory.glob("*/*.kvb")]:
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # a starting process's empty hard-link probe (dir_state)
                continue
            files[st.st_ino] = (st.st_size, st.st_blocks * 512)
        ledger = dir_state(directory).ledger
        return (ledger, sum(s for s, _ in files.values()), sum(b for _, b in files.values()))
    finally:
        os.close(fd)  # unlocks


def _pinned(directory: Path) -> int:
    """Bytes of run files every name of which is gone that processes still hold open."""
    held = {}
    prefix = str(directory)
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix) and target.endswith(" (deleted)"):
                    st = os.stat(fd)
                    held[st.st_ino] = st.st_blocks * 512
        except OSError:
            continue  # a process that ended, or a descriptor closed meanwhile
    return sum(held.values())


def test_four_processes_on_one_small_root(small_fs) -> None:  # noqa: F811
    seconds = float(os.environ.get("KVPORT_DISK_CHAOS_SECONDS", "8"))
    fs = small_fs("size=16m")
    base = os.statvfs(fs)
    used0 = (base.f_blocks - base.f_bfree) * base.f_frsize
    DiskTier(fs, MAX_BYTES, NS).close()  # the directory and ledger exist for the sampler
    directory = DiskLocation(fs, NS).dir
    workers = subprocess.Popen([sys.executable, CHILD, "workers", str(fs), str(MAX_BYTES),
                                str(seconds), "4"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_env())
    peak = {"ledger": 0, "files": 0, "allocated": 0, "pinned": 0, "fs": 0, "samples": 0}

    def sample() -> bool:
        ledger, files, allocated = _locked_usage(directory)
        assert ledger == files <= MAX_BYTES, (ledger, files, MAX_BYTES)
        vfs = os.statvfs(fs)
        used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize - used0
        for name, value in (("ledger", ledger), ("files", files), ("allocated", allocated),
                            ("pinned", _pinned(directory)), ("fs", used)):
            peak[name] = max(peak[name], value)
        peak["samples"] += 1
        return workers.poll() is not None

    start = time.monotonic()
    poll_until(sample, "the four disk workers' end", seconds + 60.0, interval_s=0.05)
    wall = time.monotonic() - start
    out, err = workers.communicate()
    assert workers.returncode == 0, err[-4000:]
    reports = [json.loads(line) for line in out.splitlines()]
    assert len(reports) == 4, out
    fresh = DiskTier(fs, MAX_BYTES, NS, num_threads=1)
    state = assert_accounted(fresh)
    named = ids_of(state, range(NUM_KEYS))
    assert load(fresh, named) == set(named)
    for r in reports:
        assert r["ops"] > 0 and r["peak_fds"] <= r["start_fds"] + 64 + 4, r
        assert r["failures"] == r["misses"] and r["rejected"] == 0, r  # misses are not errors
    # Runs another process evicted stay allocated while a process holds them open (closed at
    # its next store, or load SWEEP_EVERY_S apart): the review's bound, N x max_bytes plus a
    # run (this churn, the whole limit evicted every ~0.3 s, measured 1.9-2.1x).
    assert peak["fs"] <= 4 * MAX_BYTES + run_size(4), (peak, MAX_BYTES)
    print(json.dumps({"seconds": seconds, "wall_s": round(wall, 1), "max_bytes": MAX_BYTES,
                      "peak": peak, "workers": reports}))
