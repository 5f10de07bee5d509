"""Two disk tiers on one directory (two processes, as far as the shared ledger is concerned:
each tier has its own descriptor and lock of it): the limit holds for both together (D8)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disk_chaos import NS, assert_accounted, dir_state, key, load, run_size, store
from fault_tiers import evict_name

from kvport.connectors.offloading.tiers.disk import load as disk_load
from kvport.connectors.offloading.tiers.disk.tier import DiskTier


def test_eviction_goes_on_until_the_shared_ledger_says_the_run_fits(tmp_path: Path) -> None:
    """A runs out of date in A's index (B adopted it, then evicted it) frees nothing when A
    evicts it: A must not take its index's word that the new run now fits (the lost attempt's
    defect 1), but evict on, or skip the store, until the ledger says it fits."""
    limit = 3 * run_size(1)
    a = DiskTier(tmp_path, limit, NS)
    b = DiskTier(tmp_path, limit, NS)
    assert store(a, [1]) == [] and store(a, [2]) == []
    assert load(b, [1]) == {1}  # B adopts A's run of key 1
    assert store(b, [3]) == []  # full: runs 1, 2, 3
    assert store(b, [4]) == []  # B evicts its oldest, run 1: runs 2, 3, 4
    assert store(a, [5]) == []  # A's oldest (run 1) frees nothing: it must evict run 2 too
    state = dir_state(a.dir)
    assert state.named_bytes <= limit and state.ledger == state.named_bytes, state
    assert load(a, [5]) == {5} and load(b, [3, 4]) == {3, 4}
    assert a.stats.snapshot().shared_bytes <= limit
    assert store(a, [6]) == [1] or dir_state(a.dir).named_bytes <= limit
    a.check_integrity()
    b.check_integrity()
    assert_accounted(DiskTier(tmp_path, limit, NS))


def test_a_store_that_finds_only_others_runs_is_skipped_not_over_the_limit(
        tmp_path: Path) -> None:
    limit = 2 * run_size(1)
    a = DiskTier(tmp_path, limit, NS)
    b = DiskTier(tmp_path, limit, NS)
    assert store(b, [1]) == [] and store(b, [2]) == []
    assert store(a, [3]) == [0]  # A has nothing of its own to evict
    assert a.stats.snapshot().skipped_stores == 1
    assert dir_state(a.dir).named_bytes == limit
    assert_accounted(DiskTier(tmp_path, limit, NS))


def test_runs_another_process_evicted_are_closed_by_loads_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that only loads frees the space of runs others evicted (their last descriptor
    is its), sweeping at most every SWEEP_EVERY_S (0 here: every job)."""
    monkeypatch.setattr(disk_load, "SWEEP_EVERY_S", 0.0)
    limit = 4 * run_size(2)
    a = DiskTier(tmp_path, limit, NS)
    b = DiskTier(tmp_path, limit, NS)
    assert store(b, [1, 2]) == [] and store(b, [3]) == []
    assert load(a, [1, 3]) == {1, 3} and len(a.files) == 2  # both runs open in A
    evict_name(b, key(1))
    evict_name(b, key(2))  # run 1-2 has no name left: A's descriptor holds its space
    assert load(a, [3]) == {3}
    assert len(a.files) == 1
    assert_accounted(DiskTier(tmp_path, limit, NS))


def test_a_sweep_of_unlinked_runs_is_not_repeated_within_its_interval(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, NS)
    assert store(disk, [1]) == [] and store(disk, [2]) == []
    assert load(disk, [1, 2]) == {1, 2}
    assert disk.files.close_unlinked(3600.0) == 0  # nothing to close (the loads swept too)
    evict_name(disk, key(1))
    assert disk.files.close_unlinked(3600.0) == 0  # within the interval: no sweep
    assert disk.files.close_unlinked(0.0) == 1
