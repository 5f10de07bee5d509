"""The disk tier on a genuinely full file system: a small tmpfs (the tests run as root and mount
one; a machine where that fails fails these tests, it does not skip them). Writes, links, mkdirs
and creates each get ENOSPC from the kernel; each makes the store a skipped one, counted, with no
name of a partial run and no temp file left; loads go on; stores resume once space frees."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from disk_chaos import NS, assert_accounted, dir_state, key, load, store
from disk_chaos import small_fs  # noqa: F401  (a fixture: mount fails the test, never skips)
from fault_tiers import wait_until
from offload_utils import (
    assert_nothing_leaked, make_llm, offload_config, prompts, run, run_one_by_one,
)

from kvport.connectors.offloading.tiers.disk.tier import DiskTier

LIMIT = 1 << 30  # far above the file system's size: the file system, not the limit, is full


def _fill(fs: Path) -> Path:
    """Fill the file system's data pages to the last byte: the filler's path."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = bytes(64 << 10)
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            while True:
                f.write(b"\0")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def _leave_inodes(fs: Path, n: int) -> list[Path]:
    """Create empty files until exactly n inodes are free: the fillers."""
    fillers = []
    while os.statvfs(fs).f_ffree > n:
        fillers.append(fs / f"inode-{len(fillers)}")
        fillers[-1].touch()
    assert os.statvfs(fs).f_ffree == n
    return fillers


@pytest.fixture()
def enospc(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the os calls that raised ENOSPC during the test (they still raise)."""
    seen: list[str] = []

    def watched(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    seen.append(name)
                raise
        return wrapper

    for name in ("open", "link", "mkdir", "writev", "pwrite"):
        monkeypatch.setattr(os, name, watched(name, getattr(os, name)))
    return seen


def test_data_pages_full_from_the_first_store_skips_stores_and_they_resume(
        small_fs: Callable[[str], Path], enospc: list[str]) -> None:
    """Full before the tier ever wrote its ledger: the ledger's first write and the run's
    writev fail with ENOSPC; each is a skipped store, never an OSError out of the store (the
    lost attempt's defect 3)."""
    fs = small_fs("size=2m")
    filler = _fill(fs)
    disk = DiskTier(fs, LIMIT, NS)  # its ledger cannot get its 8 bytes
    assert store(disk, [1, 2, 3]) == [0, 1, 2]
    assert store(disk, [4]) == [0]
    assert enospc.count("pwrite") == 3, enospc  # at the ledger's open, then at each reserve
    state = dir_state(disk.dir)
    assert (state.names, state.temps, state.stray) == ({}, [], [])
    assert disk.stats.snapshot().skipped_stores == 4
    filler.unlink()
    assert store(disk, [1, 2, 3]) == [] and load(disk, [1, 2, 3, 4]) == {1, 2, 3}
    _fill(fs)
    assert store(disk, [5, 6]) == [0, 1]  # the run's writev fails now (the ledger has its page)
    assert "writev" in enospc, enospc
    assert load(disk, [1, 2, 3, 5]) == {1, 2, 3}  # serving goes on
    s = disk.stats.snapshot()
    assert (s.skipped_stores, s.failures) == (6, 2)  # the failures: the misses of 4 and 5
    assert_accounted(disk)
    (fs / "filler").unlink()
    assert store(disk, [5, 6]) == [] and load(disk, [5, 6]) == {5, 6}
    assert_accounted(DiskTier(fs, LIMIT, NS))


def _new_prefix(disk: DiskTier, start: int) -> int:
    """An id from start on whose key's directory (its first hex byte) does not exist yet."""
    i = start
    while disk.path(key(i)).parent.exists():
        i += 1
    return i


def _old_prefix(disk: DiskTier, start: int, of: int) -> int:
    """An id from start on whose key shares key(of)'s directory."""
    i = start
    while disk.path(key(i)).parent != disk.path(key(of)).parent:
        i += 1
    return i


def test_inodes_full_makes_creates_mkdirs_and_links_fail_and_stores_skip(
        small_fs: Callable[[str], Path], enospc: list[str]) -> None:
    fs = small_fs("size=4m,nr_inodes=64")
    disk = DiskTier(fs, LIMIT, NS)
    assert store(disk, [0]) == []
    expected = {0}
    fillers = _leave_inodes(fs, 0)  # the temp file cannot be created
    assert store(disk, [_new_prefix(disk, 1)]) == [0]
    assert enospc[-1] == "open"
    fillers.pop().unlink()  # one inode: the temp file takes it, the key's directory gets none
    new = _new_prefix(disk, 1000)
    assert store(disk, [new]) == [0]
    assert "mkdir" in enospc, enospc
    assert store(disk, [_old_prefix(disk, 2000, of=0)]) == [0]  # the link gets none
    assert enospc[-1] == "link", enospc
    state = dir_state(disk.dir)
    assert set(state.names) == {key(0)} and not state.temps
    assert load(disk, [0, new]) == {0}
    assert disk.stats.snapshot().skipped_stores == 3
    for f in fillers:
        f.unlink()
    mixed = [new, _old_prefix(disk, 3000, of=0), _new_prefix(disk, 4000)]
    assert store(disk, mixed) == []
    expected |= set(mixed)
    assert load(disk, sorted(expected)) == expected
    assert_accounted(DiskTier(fs, LIMIT, NS))


def test_a_restart_on_a_full_file_system_serves_and_stores_resume(
        small_fs: Callable[[str], Path], enospc: list[str]) -> None:
    """An engine restarted while its disk is full (inodes and pages): the tier starts (its
    hard-link check cannot run, which is no reason to refuse), loads what is there, skips
    stores, and stores once space frees."""
    fs = small_fs("size=2m,nr_inodes=64")
    first = DiskTier(fs, LIMIT, NS)
    assert store(first, [1, 2]) == []
    first.close()
    filler = _fill(fs)
    fillers = _leave_inodes(fs, 0)
    disk = DiskTier(fs, LIMIT, NS)
    assert "open" in enospc, enospc
    assert load(disk, [1, 2]) == {1, 2}
    assert store(disk, [3]) == [0] and disk.stats.snapshot().skipped_stores == 1
    filler.unlink()
    for f in fillers:
        f.unlink()
    assert store(disk, [3]) == [] and load(disk, [1, 2, 3]) == {1, 2, 3}
    assert_accounted(DiskTier(fs, LIMIT, NS))


def test_the_engine_serves_on_a_full_file_system_and_its_stores_resume(
        small_fs: Callable[[str], Path], reference: list[list[int]]) -> None:
    """kvport's engine with its disk tier on a full tmpfs: outputs equal to no connector, the
    write-throughs skipped and counted; once space frees they are written, and loaded."""
    fs = small_fs("size=8m")
    filler = _fill(fs)
    llm = make_llm(offload_config(disk_dir=fs, disk_bytes=64 << 20))
    assert run(llm, prompts())[0] == reference
    disk = llm.get_metrics()["connector"]["disk"]
    assert disk["skipped_stores"] > 0 and disk["blocks_stored"] == 0, disk
    filler.unlink()
    assert llm.reset_prefix_cache(reset_connector=True)  # the host tier's copies gone too
    assert run(llm, prompts())[0] == reference
    wait_until(lambda: llm.get_metrics()["connector"]["disk"]["blocks_stored"] > 0)
    assert llm.reset_prefix_cache(reset_connector=True)
    tokens, _ = run_one_by_one(llm)
    assert tokens == reference
    assert llm.get_metrics()["connector"]["disk"]["blocks_loaded"] > 0
    assert_nothing_leaked(llm)
    llm.shutdown()
