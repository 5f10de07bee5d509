"""DiskTier's run files: a store job's entries in one file named by a hard link per key; loads
that read runs whole and keep them open; eviction and accounting by run; a state machine over
stores, loads, evictions by another process and restarts."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch
from fault_tiers import FaultyDisk, drop_page_cache, evict_name, flip_byte, wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvport.connectors.offloading.mediums import DiskBlocks, HostBlocks
from kvport.connectors.offloading.tiers.disk import page_cache
from kvport.connectors.offloading.tiers.disk import read as disk_read
from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.disk.files import OpenRun, RunFiles, file_stamp
from kvport.connectors.offloading.tiers.disk.runs import run_bytes
from kvport.connectors.offloading.tiers.host.tier import HostTier

NS = b"test-runs"
PAYLOAD = 4096 + 512  # not a whole number of pages: payloads start at any offset


def key(i: int) -> bytes:
    return hashlib.sha256(b"run-%d" % i).digest()


def payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAYLOAD,), generator=torch.Generator().manual_seed(i),
                         dtype=torch.uint8)


def host_with(ids: list[int], num_slots: int = 32) -> HostTier:
    host = HostTier(num_slots, PAYLOAD)
    for slot, i in enumerate(ids):
        host.slot(slot).copy_(payload(i))
    return host


def store(disk: DiskTier, ids: list[int]) -> list[int]:
    """Store payload(i) under key(i) for each i as one job: the failed positions."""
    host = host_with(ids, max(1, len(ids)))
    out = disk.store_from_host(host, HostBlocks(list(range(len(ids)))),
                               DiskBlocks([key(i) for i in ids]))
    return out.failed_indices


def load(disk: DiskTier, ids: list[int]) -> tuple[list[int], HostTier]:
    """Load key(i) for each i as one job, into slots in reverse order: (failed positions, host)."""
    host = HostTier(max(1, len(ids)), PAYLOAD)
    slots = list(reversed(range(len(ids))))
    out = disk.load_to_host(host, DiskBlocks([key(i) for i in ids]), HostBlocks(slots))
    for pos, i in enumerate(ids):
        if pos not in out.failed_indices:
            assert torch.equal(host.slot(slots[pos]), payload(i)), i
    return out.failed_indices, host


def test_a_job_is_one_run_file_with_a_name_per_key(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, NS)
    assert store(disk, [0, 1, 2, 3, 4]) == []
    stats = [disk.path(key(i)).stat() for i in range(5)]
    assert len({s.st_ino for s in stats}) == 1 and stats[0].st_nlink == 5
    assert stats[0].st_size == run_bytes(5, PAYLOAD)
    assert not list(disk.dir.glob(".run.*"))  # the temp name is gone once the keys have theirs
    # Keys held already are not written again: the next run holds only the new ones.
    assert store(disk, [3, 4, 5, 6]) == []
    new = disk.path(key(5)).stat()
    assert new.st_ino != stats[0].st_ino and new.st_nlink == 2
    assert new.st_size == run_bytes(2, PAYLOAD)
    s = disk.stats.snapshot()
    assert (s.blocks_stored, s.occupancy_blocks) == (7, 7)
    assert s.occupancy_bytes == run_bytes(5, PAYLOAD) + run_bytes(2, PAYLOAD)
    assert load(disk, [6, 0, 1, 2, 3, 4, 5])[0] == []
    disk.check_integrity()


# bytes a read call asks for: half an entry (an entry in two calls), one, three, all
@pytest.mark.parametrize("piece", [PAYLOAD // 2, PAYLOAD, 3 * PAYLOAD, 64 * PAYLOAD])
@pytest.mark.parametrize("cold", [True, False])
def test_a_job_across_runs_loads_exactly_and_bad_entries_fail_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool, piece: int) -> None:
    disk = FaultyDisk(tmp_path, 1 << 22, NS, piece_bytes=piece)
    assert store(disk, list(range(0, 8))) == []  # run A
    assert store(disk, list(range(8, 16))) == []  # run B
    assert store(disk, [16, 17]) == []  # run C
    disk.corrupt_payload(key(3), offset=PAYLOAD - 1)  # one entry of A
    os.truncate(disk.path(key(8)), run_bytes(8, PAYLOAD) - PAYLOAD - 1)  # B torn inside 14
    evict_name(disk, key(10))  # a name of B gone (another process evicted the key)
    disk.corrupt_header(key(16))  # C's header: every key of C fails
    if cold:
        for i in (0, 8, 16):
            drop_page_cache(disk.path(key(i)))
    ids = [1, 2, 3, 4, 9, 10, 11, 12, 13, 14, 15, 16, 17, 0, 5, 6, 7]  # not in file order
    failed, _ = load(disk, ids)
    bad = {3, 10, 14, 15, 16, 17}
    assert failed == [p for p, i in enumerate(ids) if i in bad]
    for i in bad:
        assert not disk.location.exists(key(i)) and key(i) not in disk
    for i in set(range(18)) - bad:
        assert disk.location.exists(key(i))
    s = disk.stats.snapshot()
    assert (s.blocks_loaded, s.failures) == (len(ids) - len(bad), len(bad))
    disk.check_integrity()


def test_a_name_removed_before_its_run_was_opened_is_a_miss(tmp_path: Path) -> None:
    """Another process removed a key's name before this one opened the run (through another
    key): the run, open and unchanged since, still holds the entry, but the key is a miss, as
    the scheduler's lookup by name says, and it is forgotten."""
    disk = DiskTier(tmp_path, 1 << 22, NS)
    assert store(disk, list(range(8))) == []
    evict_name(disk, key(2))
    assert load(disk, [0, 1])[0] == []  # opens the run: 7 names, 8 keys indexed
    assert load(disk, [1, 2, 3])[0] == [1]
    assert key(2) not in disk
    assert load(disk, [0, 1, 3])[0] == []  # the others still load from the open run
    disk.close()
    disk.check_integrity()


def test_eviction_takes_the_least_recently_used_run_whole(tmp_path: Path) -> None:
    room = 2 * run_bytes(3, PAYLOAD)
    disk = DiskTier(tmp_path, room, NS)
    assert store(disk, [0, 1, 2]) == [] and store(disk, [3, 4, 5]) == []
    assert load(disk, [1])[0] == []  # run A is now the most recently used
    assert store(disk, [6, 7, 8]) == []  # evicts run B, every name of it
    assert not any(disk.location.exists(key(i)) for i in (3, 4, 5))
    assert all(disk.location.exists(key(i)) for i in (0, 1, 2, 6, 7, 8))
    s = disk.stats.snapshot()
    assert (s.evictions, s.occupancy_blocks, s.occupancy_bytes) == (3, 6, room)
    # A run that cannot fit evicts nothing, stores nothing, and counts every entry skipped.
    assert store(disk, list(range(10, 20))) == list(range(10))
    s = disk.stats.snapshot()
    assert (s.evictions, s.skipped_stores, s.occupancy_blocks) == (3, 10, 6)
    assert all(key(i) in disk for i in (0, 1, 2, 6, 7, 8))
    disk.check_integrity()


def test_a_store_never_evicts_the_runs_of_its_own_held_keys(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2 * run_bytes(2, PAYLOAD), NS)
    assert store(disk, [0, 1]) == [] and store(disk, [2, 3]) == []
    # Keys 0 and 2 are held; room for 4 and 5 needs a run evicted, and both hold this job's
    # keys: skipped, rather than evicting what the job just counted as stored.
    assert store(disk, [0, 2, 4, 5]) == [2, 3]
    assert all(disk.location.exists(key(i)) for i in (0, 1, 2, 3))
    assert store(disk, [0, 4, 5]) == []  # run (2, 3) is not this job's: it goes
    assert all(disk.location.exists(key(i)) for i in (0, 1, 4, 5))
    disk.check_integrity()


def test_restart_groups_names_into_runs(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 1 << 20, NS)
    assert store(first, [0, 1, 2]) == [] and store(first, [3]) == []
    os.utime(first.path(key(3)), (1e9, 1e9))  # run B is the older one now
    restarted = DiskTier(tmp_path, run_bytes(3, PAYLOAD) + run_bytes(1, PAYLOAD), NS)
    s = restarted.stats.snapshot()
    assert (s.occupancy_blocks, s.occupancy_bytes) == (4, restarted.max_bytes)
    assert store(restarted, [4]) == []  # evicts the oldest run (B) only
    assert not restarted.location.exists(key(3))
    assert all(restarted.location.exists(key(i)) for i in (0, 1, 2, 4))
    assert load(restarted, [0, 1, 2, 4])[0] == []
    restarted.check_integrity()


def test_a_name_another_process_removed_is_written_again(tmp_path: Path) -> None:
    a = DiskTier(tmp_path, 1 << 20, NS)
    b = DiskTier(tmp_path, 1 << 20, NS)
    assert store(a, [0, 1]) == []
    assert store(b, [0, 1, 2]) == []  # b does not write what a holds
    assert b.path(key(2)).stat().st_nlink == 1
    evict_name(a, key(1))  # b evicted it, say
    assert store(a, [1]) == []  # a finds the name gone and writes it again
    assert a.stats.snapshot().blocks_stored == 3
    assert load(a, [0, 1, 2])[0] == []  # 2 is b's: adopted
    assert key(2) in a
    a.check_integrity()
    b.check_integrity()


def test_a_name_found_gone_frees_its_room_before_the_store_makes_room(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2 * run_bytes(1, PAYLOAD), NS)
    assert store(disk, [0]) == [] and store(disk, [1]) == []
    evict_name(disk, key(0))  # another process evicted run (0): its room is free again
    assert store(disk, [0]) == []  # written again, in that room: run (1) stays
    assert disk.location.exists(key(1)) and key(1) in disk
    assert disk.stats.snapshot().evictions == 0
    evict_name(disk, key(1))
    disk.ledger.add(disk.max_bytes)  # another process's writes hold every byte meanwhile
    assert store(disk, [1]) == [0]  # skipped for room: and no longer indexed either
    assert key(1) not in disk and key(0) in disk
    disk.ledger.add(-disk.max_bytes)
    disk.check_integrity()


def test_a_name_taken_meanwhile_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = DiskTier(tmp_path, 1 << 20, NS)
    b = DiskTier(tmp_path, 1 << 20, NS)
    assert store(a, [0]) == []
    monkeypatch.setattr(b, "_held", lambda k: False)  # b checked before a's name appeared
    assert store(b, [0, 1]) == []  # not a failure: key 0 is held, by a's run
    assert a.path(key(0)).stat().st_ino != b.path(key(1)).stat().st_ino
    assert a.path(key(0)).stat().st_nlink == 1
    assert key(0) not in b and key(1) in b
    assert load(b, [0, 1])[0] == []
    b.check_integrity()


def test_a_file_system_without_hard_links_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(OSError, match="cannot create hard links there .* use a directory on"):
        DiskTier(tmp_path, 1 << 20, NS)
    assert not list(tmp_path.rglob(".run.*"))


def test_a_read_error_fails_the_load_and_keeps_the_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskTier(tmp_path, 1 << 20, NS)
    assert store(disk, [0, 1, 2]) == []
    real = os.preadv

    def failing(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_read.os, "preadv", failing)
    assert load(disk, [0, 1, 2])[0] == [0, 1, 2]  # counted failed, and maybe transient:
    assert all(disk.location.exists(key(i)) and key(i) in disk for i in (0, 1, 2))
    monkeypatch.setattr(disk_read.os, "preadv", real)
    assert load(disk, [0, 1, 2])[0] == []  # ... the next load reads them
    assert disk.stats.snapshot().failures == 3
    disk.check_integrity()


def test_write_errors_leave_nothing_and_count(tmp_path: Path) -> None:
    disk = FaultyDisk(tmp_path, 1 << 20, NS)
    disk.write_errno = errno.EIO
    assert store(disk, [0, 1, 2]) == [0, 1, 2]
    disk.write_errno = errno.ENOSPC
    assert store(disk, [0, 1, 2]) == [0, 1, 2]
    s = disk.stats.snapshot()
    assert (s.failures, s.skipped_stores, s.occupancy_bytes) == (3, 3, 0)
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.kvb"))
    disk.write_errno = None
    assert store(disk, [0, 1, 2]) == [] and load(disk, [2, 1, 0])[0] == []
    disk.check_integrity()


# ---- run files kept open between jobs ------------------------------------------------------------

def test_runs_stay_open_between_jobs_and_close_when_evicted(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 2 * run_bytes(2, PAYLOAD), NS)
    assert store(disk, [0, 1]) == [] and store(disk, [2, 3]) == []
    assert load(disk, [0])[0] == [] and load(disk, [1, 2])[0] == []
    assert len(disk.files) == 2
    assert load(disk, [3, 0])[0] == []
    assert len(disk.files) == 2  # no new opens: both runs were open
    assert store(disk, [4, 5]) == []  # evicts run (2, 3): its file closes, its space goes
    assert len(disk.files) == 1
    evict_name(disk, key(0))
    evict_name(disk, key(1))  # another process evicted run (0, 1): every name gone
    failed, _ = load(disk, [0, 1])
    assert failed == [0, 1] and len(disk.files) == 0  # found gone, closed
    disk.close()
    disk.check_integrity()


def test_an_entry_is_hashed_once_until_its_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checked entry is not hashed again through its open run; a write into the file, or a
    name of it removed, makes the next load reopen it and check every entry again."""
    hashed: list[int] = []

    def counting(data: memoryview) -> int:
        hashed.append(data.nbytes)
        return real(data)

    real = disk_read.checksum
    monkeypatch.setattr(disk_read, "checksum", counting)
    disk = FaultyDisk(tmp_path, 1 << 20, NS)
    assert store(disk, [0, 1, 2, 3]) == []
    assert load(disk, [0, 1, 2])[0] == [] and len(hashed) == 3
    assert load(disk, [2, 1, 0, 3])[0] == [] and len(hashed) == 4  # only 3 was new
    assert load(disk, [0, 1, 2, 3])[0] == [] and len(hashed) == 4
    drop_page_cache(disk.path(key(0)))  # cold is no change of the file: still checked
    assert load(disk, [3, 0])[0] == [] and len(hashed) == 4
    disk.corrupt_payload(key(1), offset=7)  # another writer: the file's stamp changes
    assert load(disk, [0, 1, 2, 3])[0] == [1] and len(hashed) == 8
    assert not disk.path(key(1)).exists()  # removed: a name gone changes the stamp again
    assert load(disk, [0, 2, 3])[0] == [] and len(hashed) == 11
    assert load(disk, [0, 2, 3])[0] == [] and len(hashed) == 11
    disk.close()
    disk.check_integrity()


def test_a_run_written_while_a_job_reads_it_is_hashed_after_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job found the run unchanged when it began, and another writer changes it while the job
    reads: the entries read without a hash are hashed from the slots after all."""
    disk = FaultyDisk(tmp_path, 1 << 20, NS)
    assert store(disk, [0, 1, 2, 3]) == []
    assert load(disk, [0, 1, 2, 3])[0] == []  # every entry checked once
    real = os.preadv
    calls = 0

    def writer_meanwhile(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:  # after the job's start, before its reads
            disk.corrupt_payload(key(2), offset=11)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", writer_meanwhile)
    assert load(disk, [0, 1, 2, 3])[0] == [2]  # load() checks the others' bytes
    assert not disk.path(key(2)).exists()
    monkeypatch.setattr(os, "preadv", real)
    assert load(disk, [0, 1, 3])[0] == []
    disk.close()
    disk.check_integrity()


def test_a_piece_of_no_bytes_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="piece_bytes must be >= 1, got 0"):
        DiskTier(tmp_path, 1 << 20, NS, piece_bytes=0)


def test_checked_entries_the_cache_holds_are_read_in_one_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries checked before, at consecutive positions, whose pages the cache holds: one
    `preadv` for the job. Cold, first read, or with a gap: a call per entry (a piece is one
    entry here), so that cold reads stream."""
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset, *flags)

    held: list[bool] = []  # what the page cache was found to hold (this VM may drop idle pages)

    def asked(fd: int, offset: int, size: int) -> bool:
        held.append(page_cache.holds_whole(fd, offset, size))
        return held[-1]

    monkeypatch.setattr(disk_read, "holds_whole", asked)
    disk = DiskTier(tmp_path, 1 << 20, NS, piece_bytes=PAYLOAD)
    assert store(disk, [0, 1, 2, 3, 4]) == []
    monkeypatch.setattr(os, "preadv", counting)
    assert load(disk, [0, 1, 2, 3])[0] == [] and calls == [1, 1, 1, 1]  # first read: checked
    assert held == []  # nothing checked yet: the cache was not even asked
    calls.clear()
    assert load(disk, [0, 1, 2, 3])[0] == []
    assert len(held) == 1 and calls == ([4] if held[0] else [1, 1, 1, 1])  # asked once a job
    calls.clear()
    assert load(disk, [0, 1, 3])[0] == [] and calls == [1, 1, 1]  # a gap: not one extent
    calls.clear()
    assert load(disk, [0, 2, 2])[0] == [] and calls == [1, 1, 1]  # as many as 0..2: no extent
    calls.clear()
    assert load(disk, [1, 2, 3, 4])[0] == [] and calls == [1, 1, 1, 1]  # 4 not checked yet
    monkeypatch.setattr(os, "preadv", real)
    drop_page_cache(disk.path(key(0)))
    monkeypatch.setattr(os, "preadv", counting)
    calls.clear()
    assert load(disk, [0, 1, 2, 3])[0] == [] and calls == [1, 1, 1, 1]  # cold: streamed
    disk.close()
    disk.check_integrity()


def test_a_batch_of_jobs_is_read_as_one_and_each_job_fails_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs the transfer thread took together (load_batch_to_host): their entries of a run,
    consecutive across jobs, are read as one extent (here one call); each
    job gets its own outcome: a corrupt entry, a key never stored, fail in their job only."""
    disk = FaultyDisk(tmp_path, 1 << 20, NS)
    assert store(disk, [0, 1, 2, 3, 4, 5]) == []
    assert load(disk, [0, 1, 2, 3, 4, 5])[0] == []  # checked once
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", counting)
    host = HostTier(8, PAYLOAD)
    jobs = [(DiskBlocks([key(0), key(1)]), HostBlocks([7, 6])),
            (DiskBlocks([key(2), key(3), key(4)]), HostBlocks([0, 1, 2]))]
    outs = disk.load_batch_to_host(host, jobs)
    assert [(o.num_bytes, o.failed_indices) for o in outs] == [(2 * PAYLOAD, []),
                                                             (3 * PAYLOAD, [])]
    assert calls == [5]  # one extent, positions 0..4 (cached or not: one piece of 1 MiB)
    for slot, i in [(7, 0), (6, 1), (0, 2), (1, 3), (2, 4)]:
        assert torch.equal(host.slot(slot), payload(i)), i
    monkeypatch.setattr(os, "preadv", real)
    disk.close()  # reopened: every entry is checked again, so the damage is seen
    disk.corrupt_payload(key(3))
    jobs = [(DiskBlocks([key(0), key(1)]), HostBlocks([0, 1])),
            (DiskBlocks([key(2), key(3), key(99)]), HostBlocks([2, 3, 4])),
            (DiskBlocks([key(5)]), HostBlocks([5]))]
    outs = disk.load_batch_to_host(host, jobs)
    assert [o.failed_indices for o in outs] == [[], [1, 2], []]
    assert [o.num_bytes for o in outs] == [2 * PAYLOAD, PAYLOAD, PAYLOAD]
    assert not disk.path(key(3)).exists() and key(3) not in disk
    assert disk.load_batch_to_host(host, []) == []
    disk.close()
    disk.check_integrity()


def split_reads(monkeypatch: pytest.MonkeyPatch,
                fail_call: int | None = None) -> list[tuple[str, int, int]]:
    """Make every checked extent of 2 entries or more count as cached and large enough to split;
    record each `preadv` as (thread name, entries asked, first entry's offset). With
    `fail_call` the call with that index raises, on whichever thread makes it."""
    monkeypatch.setattr(disk_read, "SPLIT_BYTES", 2 * PAYLOAD)
    monkeypatch.setattr(disk_read, "holds_whole", lambda fd, offset, size: True)
    calls: list[tuple[str, int, int]] = []
    real = os.preadv

    def recording(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        calls.append((threading.current_thread().name, len(buffers), offset))
        if len(calls) - 1 == fail_call:
            raise OSError(errno.EIO, "injected")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(disk_read.os, "preadv", recording)
    return calls


def disk_helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvport-disk-read")]


def test_a_large_cached_extent_is_read_by_several_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From SPLIT_BYTES on, an extent the page cache holds is cut into ranges that the caller and
    its helpers read at once (parts.run_in_parts: which thread reads which range is a race),
    each into its own slots."""
    disk = DiskTier(tmp_path, 1 << 20, NS, num_threads=3)
    assert store(disk, list(range(7))) == []
    calls = split_reads(monkeypatch)
    pool = disk.loader._helpers
    assert pool is not None
    tasks: list[object] = []
    submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda fn, *a: tasks.append(fn) or submit(fn, *a))
    assert load(disk, list(range(7)))[0] == []  # first read: checked, entry by entry
    assert {c[0] for c in calls} == {threading.current_thread().name}
    calls.clear()
    assert load(disk, list(range(7)))[0] == []  # the slots hold the payloads (load checks)
    parts = sorted((offset, n) for _, n, offset in calls)
    first = parts[0][0]
    assert [((o - first) // PAYLOAD, n) for o, n in parts] == [(e, 1) for e in range(7)]
    assert {name for name, _, _ in calls} <= {threading.current_thread().name,
                                               *(t.name for t in disk_helpers())}
    assert len(tasks) == 2  # a task for each helper
    calls.clear()
    assert load(disk, [3])[0] == [] and len(calls) == 1  # one entry: nothing to split
    disk.close()
    wait_until(lambda: not disk_helpers())
    disk.check_integrity()
    one = DiskTier(tmp_path, 1 << 20, NS, num_threads=1)  # no helper: one call
    assert load(one, list(range(7)))[0] == []
    calls.clear()
    assert load(one, list(range(7)))[0] == [] and [c[1] for c in calls] == [7]
    one.close()
    one.check_integrity()


def test_a_split_read_has_one_part_per_thread_of_at_least_half_the_split_size() -> None:
    split, mib = disk_read.SPLIT_BYTES, 1 << 20
    assert disk_read.num_parts(split // mib - 1, mib, 1) == 1  # below SPLIT_BYTES: whole
    assert disk_read.num_parts(split // mib, mib, 1) == 2
    assert disk_read.num_parts(split // mib, mib, 0) == 1  # no helper
    assert disk_read.num_parts(64, mib, 31) == 64 * mib // (split // 2)  # many cores: 8 MiB+
    assert disk_read.num_parts(1, 64 * mib, 3) == 1  # one entry cannot be cut


def test_a_range_that_fails_to_read_makes_the_job_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range of a split read that fails (on the caller or a helper) leaves its slots
    unfilled: the job is then read again by the piece reads, and every slot gets its
    payload."""
    disk = DiskTier(tmp_path, 1 << 20, NS, num_threads=2)
    assert store(disk, list(range(6))) == []
    assert load(disk, list(range(6)))[0] == []  # checked
    calls = split_reads(monkeypatch, fail_call=3)
    assert load(disk, list(range(6)))[0] == []  # the payloads are all there (load checks)
    # six ranges of one entry at once, then the piece reads (one piece holds all six)
    assert sorted(c[1] for c in calls[:6]) == [1] * 6 and [c[1] for c in calls[6:]] == [6]
    assert disk.stats.snapshot().failures == 0
    disk.close()
    disk.check_integrity()


def test_a_span_cached_with_holes_is_read_ahead_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages missing between cached ones: the job's span is asked for at once
    (POSIX_FADV_WILLNEED). Not when cold, held whole, or held as a prefix (a sequential
    reader's readahead), nor for a job whose span is mostly entries it does not load; the
    entries load the same either way."""
    disk = DiskTier(tmp_path, 1 << 22, NS)
    ids = list(range(24))
    assert store(disk, ids) == []
    path = disk.path(key(0))
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, size: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, size))
        real(fd, offset, size, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    span = run_bytes(24, PAYLOAD)  # the whole file: header and entries
    fd = os.open(path, os.O_RDONLY)
    try:
        def cache_all_but(first: int, size: int) -> None:
            os.pread(fd, span, 0)
            real(fd, first, size, os.POSIX_FADV_DONTNEED)

        drop_page_cache(path)
        assert load(disk, ids)[0] == [] and asked == []  # cold
        assert load(disk, ids)[0] == [] and asked == []  # held whole
        cache_all_but(span // 2, span)
        assert load(disk, ids)[0] == [] and asked == []  # a prefix
        cache_all_but(span // 3, span // 3)
        assert load(disk, ids)[0] == []
        if page_cache.available():
            assert len(asked) == 1 and asked[0][1] == 24 * PAYLOAD  # the job's entries
        else:
            assert asked == []  # a kernel without cachestat: read as if cold
        asked.clear()
        cache_all_but(span // 3, span // 3)
        assert load(disk, [0, 23])[0] == [] and asked == []  # a gap: the span is not the job's

        def refusing(fd: int, offset: int, size: int, advice: int) -> None:
            if advice == os.POSIX_FADV_WILLNEED:
                asked.append((offset, size))
                raise OSError(errno.EINVAL, "no read-ahead here")
            real(fd, offset, size, advice)

        monkeypatch.setattr(os, "posix_fadvise", refusing)
        cache_all_but(span // 3, span // 3)
        assert load(disk, ids)[0] == []  # a hint refused: the reads find the pages anyway
        assert len(asked) == (1 if page_cache.available() else 0)
    finally:
        os.close(fd)
    disk.close()
    disk.check_integrity()


def run_file(tmp_path: Path, name: str) -> OpenRun:
    path = tmp_path / name
    path.write_bytes(b"x")
    st = path.stat()
    return OpenRun(st.st_ino, os.open(path, os.O_RDONLY), file_stamp(st), None)  # type: ignore[arg-type]


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_run_files_close_what_no_job_reads_beyond_capacity_and_when_dropped(
        tmp_path: Path) -> None:
    files = RunFiles(capacity=2)
    a, b, c = (run_file(tmp_path, n) for n in "abc")
    assert files.add(a) is a and files.add(b) is b and files.add(c) is c
    assert len(files) == 3  # all in use: none closed
    files.release([a, b, c])
    assert len(files) == 2 and not is_open(a.fd)  # the least recently used one went
    # Adding a run open already hands out the kept one and closes the caller's descriptor.
    twin = OpenRun(b.run_id, os.open(tmp_path / "b", os.O_RDONLY), b.stamp, None)  # type: ignore[arg-type]
    assert files.add(twin) is b and not is_open(twin.fd)
    files.drop([b.run_id])
    assert is_open(b.fd)  # still read by a job
    assert files.acquire(b.run_id) is None  # but handed to no new one
    files.release([b])
    assert not is_open(b.fd) and len(files) == 1
    assert files.acquire(c.run_id) is c
    files.close()  # c is read by a job: it closes when that job ends
    assert is_open(c.fd) and files.acquire(c.run_id) is None
    files.release([c])
    assert not is_open(c.fd) and len(files) == 0


def test_a_changed_run_another_job_still_reads_is_handed_out_unchecked(tmp_path: Path) -> None:
    """Two disk threads: job 1 reads a run while another writer changes the file; job 2 finds
    it changed and opens it again, and `add` hands it job 1's descriptor (one per run file).
    Its entries must be unchecked then, so job 2 hashes what it reads."""
    disk = FaultyDisk(tmp_path, 1 << 20, NS)
    assert store(disk, [0, 1]) == [] and load(disk, [0, 1])[0] == []  # both checked
    (inode,) = {disk.path(key(i)).stat().st_ino for i in (0, 1)}
    job1 = disk.files.acquire(inode)
    assert job1 is not None and bytes(job1.checked) == b"\x01\x01"
    disk.corrupt_payload(key(1), offset=5)
    assert disk.files.acquire(inode) is None  # job 2 finds it changed
    twin = OpenRun(inode, os.open(disk.path(key(0)), os.O_RDONLY),
                   file_stamp(disk.path(key(0)).stat()), job1.header)
    job2 = disk.files.add(twin)
    assert job2 is job1 and bytes(job2.checked) == b"\x00\x00"
    why = disk_read.read_entries(job2, [(p, memoryview(bytearray(PAYLOAD)), x) for p, x in
                                        sorted(job2.header.entries.values())])
    assert [w is not None and w.bad for w in why] == [False, True]  # 1 hashed: found bad
    disk.files.release([job1, job2])
    assert len(disk.files) == 0  # dropped: closed with its last job
    disk.close()


# ---- a state machine: stores, loads, another process's evictions, restarts ----------------------

class DiskRuns(RuleBasedStateMachine):
    """Model: the payload of every key whose name exists. Whatever happens, a key the model
    holds loads its own bytes, a key it does not is a miss, and the accounting holds."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile
        self._dir = tempfile.TemporaryDirectory()
        self.root = Path(self._dir.name)
        self.max_bytes = 3 * run_bytes(4, PAYLOAD)
        self.disk = DiskTier(self.root, self.max_bytes, NS)
        self.held: set[int] = set()
        self.damaged: set[int] = set()  # held keys whose entry another writer damaged

    def teardown(self) -> None:
        self.disk.close()
        self._dir.cleanup()

    def _sync_model(self) -> None:
        self.held = {i for i in range(12) if self.disk.location.exists(key(i))}
        self.damaged &= self.held

    @rule(ids=st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    def store(self, ids: list[int]) -> None:
        skipped = self.disk.stats.snapshot().skipped_stores
        failed = store(self.disk, ids)
        self._sync_model()
        # A run fits by evicting others, not those holding keys of this job: else skipped.
        assert {i for p, i in enumerate(ids) if p not in failed} <= self.held
        assert not self.held & {ids[p] for p in failed}
        assert self.disk.stats.snapshot().skipped_stores == skipped + len(failed)

    @rule(ids=st.lists(st.integers(0, 11), min_size=1, max_size=8))
    def load(self, ids: list[int]) -> None:
        failed, _ = load(self.disk, ids)  # checks every loaded slot's bytes
        assert failed == [p for p, i in enumerate(ids)
                          if i not in self.held or i in self.damaged]
        self._sync_model()  # damaged entries lost their names
        assert not self.damaged & set(ids)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def another_process_evicts(self, data: st.DataObject) -> None:
        """Another process sharing the directory evicts the run holding key i: every name."""
        i = data.draw(st.sampled_from(sorted(self.held)))
        run = self.disk.path(key(i)).stat().st_ino
        for j in sorted(self.held):
            if self.disk.path(key(j)).stat().st_ino == run:
                os.unlink(self.disk.path(key(j)))
                self.held.discard(j)
                self.damaged.discard(j)

    @precondition(lambda self: bool(self.held - self.damaged))
    @rule(data=st.data())
    def another_writer_damages(self, data: st.DataObject) -> None:
        """A payload byte of key i's entry is flipped in place, whether or not it was loaded (and
        checked) before: its next load fails and removes its name."""
        i = data.draw(st.sampled_from(sorted(self.held - self.damaged)))
        path = self.disk.path(key(i))
        flip_byte(path, FaultyDisk.entry_offset(self.disk, key(i)) + data.draw(
            st.integers(0, PAYLOAD - 1)))  # type: ignore[arg-type]
        self.damaged.add(i)

    @rule()
    def restart(self) -> None:
        self.disk.close()
        self.disk = DiskTier(self.root, self.max_bytes, NS)
        self._sync_model()

    @invariant()
    def accounting_holds(self) -> None:
        self.disk.check_integrity()
        names = list(self.disk.dir.rglob("*.kvb"))
        assert len(names) == len(self.held)
        runs = {p.stat().st_ino: p.stat().st_size for p in names}
        assert sum(runs.values()) <= self.max_bytes


TestDiskRuns = DiskRuns.TestCase
TestDiskRuns.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])
