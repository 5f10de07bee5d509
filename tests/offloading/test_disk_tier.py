"""DiskTier, one entry at a time: checked entries shared across instances and restarts (runs of
several entries: test_disk_runs.py)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from fault_tiers import DEADLINE_S, FaultyDisk, drop_page_cache, evict_name, wait_until

from kvport.connectors.base import KVCacheSpec
from kvport.connectors.offloading.mediums import DiskBlocks, EngineBlocks, HostBlocks
from kvport.connectors.offloading.geometry import tier_namespace
from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.disk.runs import run_bytes
from kvport.connectors.offloading.tiers.host.tier import HostTier

NS = b"test-namespace"
PAYLOAD = 256
ENTRY = run_bytes(1, PAYLOAD)  # a run of one entry: a page of header, then the payload


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAYLOAD,), generator=torch.Generator().manual_seed(i),
                         dtype=torch.uint8)


def read(tier: DiskTier, k: bytes) -> torch.Tensor | None:
    out = torch.zeros(PAYLOAD, dtype=torch.uint8)
    return out if tier.read_into(k, out) else None


def test_empty_tier_misses_and_bad_root_raises(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * ENTRY, NS)
    assert not tier.location.exists(key(1))
    assert read(tier, key(1)) is None
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(OSError, match="not a directory"):
        DiskTier(tmp_path / "a-file", ENTRY, NS)
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        DiskTier(tmp_path, 0, NS)


def test_round_trip_survives_restart_and_file_layout(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 10 * ENTRY, NS)
    assert first.write(key(1), payload(1))
    path = first.path(key(1))
    ns_dir = hashlib.sha256(NS).hexdigest()[:16]
    assert path == tmp_path / ns_dir / key(1).hex()[:2] / f"{key(1).hex()}.kvb"
    assert path.stat().st_size == ENTRY
    second = DiskTier(tmp_path, 10 * ENTRY, NS)  # a restart: index rebuilt from the directory
    assert key(1) in second
    assert second.stats.snapshot().occupancy_blocks == 1
    got = read(second, key(1))
    assert got is not None and torch.equal(got, payload(1))
    assert path.exists()  # a load keeps the entry
    other_ns = DiskTier(tmp_path, 10 * ENTRY, b"other-model")
    assert not other_ns.location.exists(key(1))


def test_another_live_instances_new_entry_is_found_and_adopted(tmp_path: Path) -> None:
    a = DiskTier(tmp_path, 10 * ENTRY, NS)
    b = DiskTier(tmp_path, 10 * ENTRY, NS)
    assert a.write(key(2), payload(2))
    assert key(2) not in b
    assert b.location.exists(key(2))
    got = read(b, key(2))
    assert got is not None and torch.equal(got, payload(2))
    assert key(2) in b  # adopted by the load
    s = b.stats.snapshot()
    assert (s.blocks_loaded, s.bytes_loaded, s.occupancy_blocks) == (1, PAYLOAD, 1)


@pytest.mark.parametrize("where", ["payload", "header", "truncated"])
def test_corrupt_entry_is_a_miss_and_removed(tmp_path: Path, where: str) -> None:
    tier = FaultyDisk(tmp_path, 10 * ENTRY, NS)
    tier.write(key(3), payload(3))
    if where == "payload":
        tier.corrupt_payload(key(3), offset=100)
    elif where == "header":
        tier.corrupt_header(key(3))
    else:
        os.truncate(tier.path(key(3)), ENTRY - 1)
    assert read(tier, key(3)) is None
    assert not tier.path(key(3)).exists()
    assert not tier.location.exists(key(3))
    assert tier.stats.snapshot().failures == 1


def test_wrong_key_or_namespace_in_header_is_a_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * ENTRY, NS)
    tier.write(key(4), payload(4))
    tier.path(key(5)).parent.mkdir(exist_ok=True)
    os.replace(tier.path(key(4)), tier.path(key(5)))
    assert tier.location.exists(key(5))  # found by name ...
    assert read(tier, key(5)) is None  # ... but its header names another key
    assert not tier.path(key(5)).exists()


def test_torn_temp_files_are_ignored(tmp_path: Path) -> None:
    tier = FaultyDisk(tmp_path, 10 * ENTRY, NS)
    tier.write_errno = errno.EIO  # leaves half a temp file, then raises
    assert not tier.write(key(6), payload(6))
    assert tier.stats.snapshot().failures == 1
    assert not list(tier.dir.glob(".run.*"))  # our own half write was removed
    # A crash mid-write by another process: a temp file nobody will finish, an hour old.
    torn = tier.dir / ".run.999.1.0.tmp"
    torn.write_bytes(b"KVPORTRN" + b"\0" * 10)
    fresh = tier.dir / ".run.998.1.0.tmp"  # a live writer's: left alone
    fresh.write_bytes(b"KVPORTRN")
    os.utime(torn, (1e9, 1e9))
    restarted = DiskTier(tmp_path, 10 * ENTRY, NS)
    assert not restarted.location.exists(key(6))
    assert restarted.stats.snapshot().occupancy_blocks == 0
    assert not torn.exists() and fresh.exists()


def test_size_limit_evicts_least_recently_used(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 3 * ENTRY, NS)
    for i in (1, 2, 3):
        assert tier.write(key(i), payload(i))
    assert read(tier, key(1)) is not None  # 1 is now the most recently used; 2 is the victim
    assert tier.write(key(4), payload(4))
    assert not tier.path(key(2)).exists() and not tier.location.exists(key(2))
    assert all(tier.location.exists(key(i)) for i in (1, 3, 4))
    s = tier.stats.snapshot()
    assert (s.evictions, s.occupancy_blocks, s.occupancy_bytes) == (1, 3, 3 * ENTRY)
    # Larger than the tier: skipped and counted, and nothing else is lost.
    assert not tier.write(b"big", torch.zeros(4 * ENTRY, dtype=torch.uint8))
    s = tier.stats.snapshot()
    assert (s.skipped_stores, s.evictions, s.occupancy_blocks) == (1, 1, 3)
    assert all(key(i) in tier for i in (1, 3, 4))  # the index lost none of them either
    for i in (1, 3, 4):
        assert tier.location.exists(key(i)) and torch.equal(read(tier, key(i)), payload(i))
    assert not tier.location.exists(b"big")
    tier.check_integrity()


def test_room_held_by_writes_in_flight_skips_the_store_and_evicts_nothing(tmp_path: Path) -> None:
    # 4 entries of room: 1 stored, 2 being written (their room is reserved). An entry larger
    # than two fits only if a write in flight gave its room up, which it cannot: skipped, and
    # entry 1 survives.
    tier = GatedDisk(tmp_path, 4 * ENTRY, NS)
    assert tier.write(key(1), payload(1))
    writers = [threading.Thread(target=tier.write, args=(key(i), payload(i))) for i in (2, 3)]
    for t in writers:
        t.start()
    try:
        wait_until(lambda: tier.num_waiting == 2)
        assert not tier.write(key(5), torch.zeros(2 * ENTRY, dtype=torch.uint8))
        s = tier.stats.snapshot()
        assert (s.skipped_stores, s.evictions) == (1, 0)
        assert tier.location.exists(key(1)) and torch.equal(read(tier, key(1)), payload(1))
        # An entry that fits beside the writes in flight evicts only what it needs (nothing).
        assert tier.write(key(7), payload(7))
    finally:
        tier.release.set()
        for t in writers:
            t.join()
    assert all(tier.location.exists(key(i)) for i in (1, 2, 3, 7))
    assert tier.stats.snapshot().evictions == 0
    tier.check_integrity()


class GatedDisk(DiskTier):
    """Writes of key(2) and key(3) wait in _write_file until `release` is set (their room stays
    reserved meanwhile)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.release = threading.Event()
        self.num_waiting = 0

    def _write_file(self, tmp: str, keys: Sequence[bytes], header: bytes,
                    payloads: Sequence[memoryview]) -> tuple[int, int]:
        if key(2) in keys or key(3) in keys:
            self.num_waiting += 1
            assert self.release.wait(DEADLINE_S), "GatedDisk: never released"
        return super()._write_file(tmp, keys, header, payloads)


def test_restart_with_a_smaller_limit_trims_the_oldest(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 3 * ENTRY, NS)
    for i in (1, 2, 3):
        tier.write(key(i), payload(i))
        os.utime(tier.path(key(i)), (1e9 + i, 1e9 + i))
    smaller = DiskTier(tmp_path, 2 * ENTRY, NS)
    assert not tier.path(key(1)).exists()
    assert smaller.stats.snapshot().occupancy_blocks == 2
    smaller.check_integrity()


def test_restart_orders_entries_by_mtime(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 3 * ENTRY, NS)
    for i in (1, 2, 3):
        tier.write(key(i), payload(i))
    for age, i in ((300, 3), (200, 1), (100, 2)):  # oldest first: 3, 1, 2
        os.utime(tier.path(key(i)), (1e9 - age, 1e9 - age))
    restarted = DiskTier(tmp_path, 3 * ENTRY, NS)
    restarted.write(key(4), payload(4))
    assert not restarted.path(key(3)).exists()
    assert restarted.path(key(1)).exists() and restarted.path(key(2)).exists()


def test_full_disk_skips_the_store_and_counts_it(tmp_path: Path) -> None:
    tier = FaultyDisk(tmp_path, 10 * ENTRY, NS)
    tier.write_errno = errno.ENOSPC
    assert not tier.write(key(8), payload(8))
    s = tier.stats.snapshot()
    assert (s.skipped_stores, s.failures, s.blocks_stored) == (1, 0, 0)
    assert not tier.location.exists(key(8))
    assert not list(tmp_path.rglob("*.tmp"))  # the half-written temp file is gone
    tier.write_errno = None  # space again: serving goes on
    assert tier.write(key(8), payload(8))
    tier.check_integrity()


def test_host_disk_transfers_report_failed_positions(tmp_path: Path) -> None:
    pool = torch.randn(6, 2, 2, 4, 2, 8)
    host = HostTier.for_pool(pool, num_slots=4, blocks_per_slot=2)
    disk = DiskTier(tmp_path, 1 << 20, NS)
    host.store(EngineBlocks([0, 1, 2, 3]), HostBlocks([0, 1]))
    out = disk.store_from_host(host, HostBlocks([0, 1]), DiskBlocks([key(1), key(2)]))
    assert out.failed_indices == [] and out.num_bytes == 2 * host.slot_bytes
    # Promote key 2 and a missing key 9 into slots 3 and 2, then into other engine blocks.
    out = disk.load_to_host(host, DiskBlocks([key(2), key(9)]), HostBlocks([3, 2]))
    assert out.failed_indices == [1]
    before = pool.clone()
    host.load(HostBlocks([3]), EngineBlocks([5, 4]))
    assert torch.equal(pool[5], before[2]) and torch.equal(pool[4], before[3])


def test_entries_of_a_short_file_fail_and_the_others_load(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, NS)
    for i in range(4):
        assert disk.write(key(i), payload(i))
    os.truncate(disk.path(key(2)), ENTRY - 10)  # torn: the last 10 bytes never written
    host = HostTier(4, PAYLOAD)
    loaded = disk.load_to_host(host, DiskBlocks([key(i) for i in range(4)]),
                               HostBlocks([3, 2, 1, 0]))
    assert loaded.failed_indices == [2] and not disk.path(key(2)).exists()
    for i, slot in ((0, 3), (1, 2), (3, 0)):
        assert torch.equal(host.slot(slot), payload(i))
    disk.check_integrity()


def test_namespace_covers_geometry() -> None:
    spec = KVCacheSpec(num_blocks=8, block_size=16, num_layers=4, num_kv_heads=2, head_dim=32,
                       dtype="float32", layout="blocks-layers-kv-tokens-heads-dim")
    a = tier_namespace(b"root", spec, 256)
    assert a != tier_namespace(b"root", spec, 128)
    assert a != tier_namespace(b"other", spec, 256)


def test_concurrent_writers_keep_the_limit(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 5 * ENTRY, NS)

    def write_range(start: int) -> None:
        for i in range(start, start + 20):
            tier.write(key(i), payload(i))

    threads = [threading.Thread(target=write_range, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.check_integrity()
    s = tier.stats.snapshot()
    assert s.occupancy_blocks <= 5 and s.occupancy_bytes <= 5 * ENTRY
    assert s.blocks_stored + s.skipped_stores == 80
    assert len(list(tier.dir.rglob("*.kvb"))) == s.occupancy_blocks


# ---- jobs of entries, as promotions read them: cold (page cache dropped) and warm ---------------

@pytest.mark.parametrize("cold", [True, False])
def test_a_job_of_entries_loads_exactly(tmp_path: Path, cold: bool) -> None:
    """Entries of runs of one, read cold or warm: bad entries of every kind fail at their
    position and are removed, the others fill their slots."""
    disk = FaultyDisk(tmp_path, 1 << 20, NS)
    n = 12
    for i in range(n):
        assert disk.write(key(i), payload(i))
    disk.corrupt_payload(key(3), offset=100)
    disk.corrupt_header(key(5))
    os.truncate(disk.path(key(7)), ENTRY - 1)  # torn: shorter than header + payload
    evict_name(disk, key(9))  # gone (another process evicted it)
    for i in range(n):
        if cold and i != 9:
            drop_page_cache(disk.path(key(i)))
    host = HostTier(n + 2, PAYLOAD)
    slots = [n + 1 - i for i in range(n)]  # consecutive, descending: any order works
    out = disk.load_to_host(host, DiskBlocks([key(i) for i in range(n)]), HostBlocks(slots))
    assert out.failed_indices == [3, 5, 7, 9]
    assert out.num_bytes == (n - 4) * PAYLOAD
    for i in range(n):
        if i not in (3, 5, 7, 9):
            assert torch.equal(host.slot(slots[i]), payload(i)), i
    for i in (3, 5, 7, 9):
        assert not disk.path(key(i)).exists() and key(i) not in disk
    s = disk.stats.snapshot()
    assert (s.blocks_loaded, s.failures) == (n - 4, 4)
    disk.check_integrity()


def test_a_key_twice_in_one_job_fills_both_slots(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, NS)
    assert disk.write(key(1), payload(1))
    drop_page_cache(disk.path(key(1)))
    host = HostTier(2, PAYLOAD)
    out = disk.load_to_host(host, DiskBlocks([key(1), key(1)]), HostBlocks([0, 1]))
    assert out.failed_indices == []
    assert torch.equal(host.slot(0), payload(1)) and torch.equal(host.slot(1), payload(1))


def test_store_writes_header_and_payload_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 16 << 20, NS)
    big = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)  # several MiB: one writev
    assert disk.write(key(1), big)
    assert disk.path(key(1)).stat().st_size == run_bytes(1, big.numel())
    out = torch.zeros_like(big)
    assert disk.read_into(key(1), out) and torch.equal(out, big)
    # the entry directories are made when a write finds none (not by a mkdir per write)
    assert disk.write(key(2), payload(2))
    shutil.rmtree(disk.path(key(2)).parent)  # removed from under the tier: made again
    assert disk.write(key(2), payload(2))
    assert disk.stats.snapshot().blocks_stored == 3  # the name was gone: written again
    got = read(disk, key(2))
    assert got is not None and torch.equal(got, payload(2))
    assert not list(tmp_path.rglob("*.tmp"))
    disk.check_integrity()
