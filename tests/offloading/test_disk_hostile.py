"""The disk tier in a directory someone else put things in (review D9, D12): a symlink or a FIFO
at a key's name, run files of another format version, directories of another user or too wide
a mode, and a fuzzed run header. Each is a miss or a refusal at start, never wrong bytes, an
exception out of a load, a hang, or a delete of what another version reads."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import threading
import tracemalloc
from pathlib import Path

import pytest
from disk_chaos import NS, PAYLOAD, assert_accounted, key, load, run_size, store
from fault_tiers import flip_byte
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.disk.location import DiskLocation
from kvport.connectors.offloading.tiers.disk.runs import (
    PAGE, RUN_FIXED, RUN_MAGIC, RUN_VERSION, RunHeader, header_size, read_run_header,
)
from kvport.connectors.offloading.tiers.value_format import Verdict

LIMIT = 64 * run_size(4)


def test_a_run_of_another_format_version_is_a_miss_for_every_key_and_left_alone(
        tmp_path: Path) -> None:
    """A fleet mid-upgrade shares the directory: a run file of another version is a miss for
    each of its keys, in one job or several, and none of its names is removed (the lost
    attempt's defect 4: the run's first key said "other format", its later keys "bad")."""
    first = DiskTier(tmp_path, LIMIT, NS)
    assert store(first, [0, 1, 2, 3]) == []
    assert store(first, [4]) == []
    first.close()
    flip_byte(first.path(key(0)), 8)  # the run format version: another release's run
    disk = DiskTier(tmp_path, LIMIT, NS)
    assert load(disk, [0, 1, 2, 3, 4]) == {4}
    assert load(disk, [3, 2]) == set()
    s = disk.stats.snapshot()
    assert (s.other_format, s.rejected) == (2, 0)  # once per job that opened the run
    for i in range(5):
        assert disk.location.exists(key(i)), i
    assert store(disk, [1]) == [] and load(disk, [1]) == set()  # held: the other version's
    assert_accounted(disk)


def _copy_of_a_run(tmp_path: Path, i: int) -> Path:
    """A valid run file of key(i) outside the tier's directory (what a symlink would reach)."""
    elsewhere = DiskTier(tmp_path / "elsewhere", LIMIT, NS)
    assert store(elsewhere, [i]) == []
    target = tmp_path / "target.kvb"
    shutil.copyfile(elsewhere.path(key(i)), target)
    return target


def test_a_symlink_at_a_name_is_never_followed_and_is_removed(tmp_path: Path) -> None:
    target = _copy_of_a_run(tmp_path, 7)
    disk = DiskTier(tmp_path / "root", LIMIT, NS)
    link = disk.path(key(7))
    link.parent.mkdir(mode=0o700)
    link.symlink_to(target)
    assert not disk.location.exists(key(7))  # the scheduler's lookup: not a hit
    again = DiskTier(tmp_path / "root", LIMIT, NS)  # the start's scan does not index it
    assert key(7) not in again
    assert load(again, [7]) == set()
    assert not os.path.lexists(link) and target.stat().st_size == run_size(1)
    assert again.stats.snapshot().rejected == 1
    link.symlink_to(target)
    assert store(again, [7]) == []  # a store removes it and writes its own entry
    assert stat.S_ISREG(os.lstat(link).st_mode) and load(again, [7]) == {7}
    assert again.stats.snapshot().rejected == 2
    assert_accounted(again)


def test_a_fifo_at_a_name_neither_hangs_a_load_nor_a_store(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, LIMIT, NS)
    assert store(disk, [1]) == []
    fifo = disk.path(key(2))
    fifo.parent.mkdir(mode=0o700, exist_ok=True)
    os.mkfifo(fifo)
    assert not disk.location.exists(key(2))
    got: list[set[int]] = []
    loader = threading.Thread(target=lambda: got.append(load(disk, [1, 2])), daemon=True)
    loader.start()
    loader.join(10.0)
    assert got == [{1}], "a load waited on a FIFO planted at a key's name"
    assert not os.path.lexists(fifo)
    os.mkfifo(fifo)
    assert DiskTier(tmp_path, LIMIT, NS).stats.snapshot().occupancy_blocks == 1  # not indexed
    assert store(disk, [2]) == [] and load(disk, [2]) == {2}
    assert disk.stats.snapshot().rejected == 2
    assert_accounted(disk)


def test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    disk = DiskTier(tmp_path / "root", LIMIT, NS)
    ledger = disk.dir / ".ledger"  # private too, and given its bytes at once (disk_ledger)
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600 and ledger.stat().st_size == 8
    assert store(disk, [1]) == []
    assert stat.S_IMODE(disk.path(key(1)).stat().st_mode) == 0o600
    assert stat.S_IMODE(disk.path(key(1)).parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(disk.dir.stat().st_mode) == 0o700
    disk.dir.chmod(0o777)  # our own directory, too wide: narrowed, with a warning
    DiskTier(tmp_path / "root", LIMIT, NS)
    assert stat.S_IMODE(disk.dir.stat().st_mode) == 0o700 and "had mode 777" in caplog.text
    os.chown(disk.dir, 54321, 54321)  # another user's: refused, unless its group is trusted
    with pytest.raises(PermissionError, match="belongs to uid 54321"):
        DiskTier(tmp_path / "root", LIMIT, NS)
    disk.dir.chmod(0o770)
    shared = DiskTier(tmp_path / "root", LIMIT, NS, group_access=True)
    assert load(shared, [1]) == {1}
    disk.dir.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by every user"):
        DiskTier(tmp_path / "root", LIMIT, NS, group_access=True)
    os.chown(disk.dir, os.geteuid(), os.getegid())
    moved = tmp_path / "moved"
    disk.dir.rename(moved)
    disk.dir.symlink_to(moved)  # a symlink as the namespace directory: refused
    with pytest.raises(OSError, match="a symlink is refused"):
        DiskTier(tmp_path / "root", LIMIT, NS)


# --- the run header parser, fuzzed ---------------------------------------------------------------

DIGEST = DiskLocation(Path("/nonexistent"), NS).namespace_digest
_U16, _U32, _U64 = (st.integers(0, (1 << b) - 1) for b in (16, 32, 64))


def _valid_run(n: int) -> bytearray:
    h = header_size(n)
    raw = bytearray(RUN_FIXED.pack(RUN_MAGIC, RUN_VERSION, 0, h, DIGEST, PAYLOAD, n))
    for i in range(n):
        raw += struct.pack("<16sQ", i.to_bytes(16, "little"), i)
    return raw + bytes(h - len(raw) + n * PAYLOAD)


def _parse(raw: bytes) -> RunHeader | Verdict:
    fd = os.memfd_create("run")
    try:
        os.write(fd, raw)
        return read_run_header(fd, DIGEST, PAYLOAD, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _check_bounded(raw: bytes) -> None:
    """The parser's verdict on raw: a header within the file or a Verdict, no exception, and
    no allocation beyond a small multiple of the file's size (a count in a damaged header must
    not make it read or allocate more)."""
    tracemalloc.start()
    try:
        got = _parse(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 4 * len(raw) + (256 << 10), (peak, len(raw))
    if isinstance(got, RunHeader):
        assert got.header_size == header_size(got.num_entries) <= len(raw)
        assert got.payload_bytes == PAYLOAD and len(got.entries) <= got.num_entries
    else:
        assert got in (Verdict.BAD, Verdict.OTHER_FORMAT)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), edits=st.lists(st.tuples(st.integers(0, 2 * PAGE), _U64),
                                              max_size=6),
       cut=st.integers(0, 1 << 20))
def test_a_damaged_run_header_is_a_verdict_never_an_exception(
        n: int, edits: list[tuple[int, int]], cut: int) -> None:
    """Bytes of a valid run changed anywhere in its first two pages, and its end cut off."""
    raw = _valid_run(n)
    for pos, value in edits:
        if pos < len(raw):
            raw[pos] = value & 0xFF
    _check_bounded(bytes(raw[:len(raw) - cut % (len(raw) + 1)]))


@settings(max_examples=300, deadline=None)
@given(version=st.sampled_from([RUN_VERSION, RUN_VERSION + 1, 0]), h=_U32, size=_U64, n=_U32,
       ns_ok=st.booleans(), tail=st.binary(max_size=3 * PAGE))
def test_any_fixed_fields_are_a_verdict_within_the_file(
        version: int, h: int, size: int, n: int, ns_ok: bool, tail: bytes) -> None:
    """Every count the fixed fields can claim (n near 2**32, a header of 4 GiB, a payload size
    of 2**64-1) with whatever follows."""
    ns = DIGEST if ns_ok else bytes(32)
    head = RUN_FIXED.pack(RUN_MAGIC, version, 0, h, ns, size, n)
    _check_bounded(head + tail)
    if ns_ok and size == PAYLOAD and 1 <= n <= 64 and h == header_size(n) and version == 1:
        assert isinstance(_parse(head + tail + bytes(h)), RunHeader)


def test_huge_counts_are_bad_without_reading_them() -> None:
    for n in (178_000_000, (1 << 32) - 1):
        h = min(header_size(n), (1 << 32) - PAGE)  # what the 32-bit field can claim
        head = RUN_FIXED.pack(RUN_MAGIC, RUN_VERSION, 0, h, DIGEST, PAYLOAD, n)
        _check_bounded(head + bytes(PAGE))
        assert _parse(head + bytes(PAGE)) is Verdict.BAD
    assert _parse(RUN_FIXED.pack(RUN_MAGIC, RUN_VERSION + 1, 0, 0, DIGEST, 0, 0)) is \
        Verdict.OTHER_FORMAT
    assert isinstance(_parse(bytes(_valid_run(3))), RunHeader)


def test_a_symlink_in_place_of_a_key_directory_is_removed_at_start(tmp_path: Path) -> None:
    """`<ns>/<key hex[:2]>` a symlink to another directory holding a valid run: O_NOFOLLOW
    guards only the last name, so the start removes such a link before any load or store goes
    through it."""
    target = _copy_of_a_run(tmp_path, 7)
    disk = DiskTier(tmp_path / "root", LIMIT, NS)
    elsewhere = tmp_path / "planted"
    elsewhere.mkdir()
    shutil.copyfile(target, elsewhere / disk.path(key(7)).name)
    disk.path(key(7)).parent.symlink_to(elsewhere)
    again = DiskTier(tmp_path / "root", LIMIT, NS)
    assert not os.path.lexists(disk.path(key(7)).parent)
    assert again.stats.snapshot().rejected == 1
    assert load(again, [7]) == set() and store(again, [7]) == []
    assert stat.S_ISDIR(os.lstat(disk.path(key(7)).parent).st_mode)
    assert (elsewhere / disk.path(key(7)).name).stat().st_nlink == 1  # nothing linked there
    assert_accounted(again)


def test_a_fifo_or_symlink_at_the_ledger_is_refused_at_start(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, LIMIT, NS)
    disk.close()
    ledger = disk.dir / ".ledger"
    ledger.unlink()
    os.mkfifo(ledger)
    with pytest.raises(OSError, match="is not a regular file"):
        DiskTier(tmp_path, LIMIT, NS)
    ledger.unlink()
    ledger.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        DiskTier(tmp_path, LIMIT, NS)
    assert not (tmp_path / "elsewhere").exists()
