"""Helpers of the disk tier's chaos tests (test_disk_chaos, test_disk_full, test_disk_hostile):
payloads that are a function of their key, stores and loads that check every byte, and what a
namespace directory holds on disk (the truth the ledger must match).

A payload is `payload(i)` under `key(i)`: whoever loads a key knows the only bytes it may get,
so a load is byte-exact or a miss, never anything else.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvport.connectors.offloading.mediums import DiskBlocks, HostBlocks
from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.disk.location import SUFFIX, TEMP_PREFIX, TEMP_SUFFIX
from kvport.connectors.offloading.tiers.disk.ledger import LEDGER_NAME
from kvport.connectors.offloading.tiers.disk.runs import run_bytes
from kvport.connectors.offloading.tiers.host.tier import HostTier

NS = b"test-disk-chaos"
PAYLOAD = 4096 + 768  # not whole pages: entries start anywhere in a page


def key(i: int) -> bytes:
    return hashlib.sha256(b"chaos-%d" % i).digest()


def payload(i: int) -> torch.Tensor:
    """The only bytes key(i) may ever load."""
    return torch.randint(0, 256, (PAYLOAD,), generator=torch.Generator().manual_seed(i),
                         dtype=torch.uint8)


def run_size(n: int) -> int:
    return run_bytes(n, PAYLOAD)


def store(disk: DiskTier, ids: Sequence[int]) -> list[int]:
    """payload(i) under key(i) for each i, as one job: the positions not stored."""
    host = HostTier(max(1, len(ids)), PAYLOAD)
    for slot, i in enumerate(ids):
        host.slot(slot).copy_(payload(i))
    out = disk.store_from_host(host, HostBlocks(list(range(len(ids)))),
                               DiskBlocks([key(i) for i in ids]))
    return out.failed_indices


def load(disk: DiskTier, ids: Sequence[int]) -> set[int]:
    """Load key(i) for each i as one job: the ids loaded. Every loaded slot must hold exactly
    payload(i) (AssertionError otherwise: wrong bytes are never a miss)."""
    host = HostTier(max(1, len(ids)), PAYLOAD)
    out = disk.load_to_host(host, DiskBlocks([key(i) for i in ids]),
                            HostBlocks(list(range(len(ids)))))
    got = set()
    for pos, i in enumerate(ids):
        if pos not in out.failed_indices:
            assert torch.equal(host.slot(pos), payload(i)), f"key {i}: wrong bytes loaded"
            got.add(i)
    return got


@dataclass(frozen=True)
class DirState:
    """What a namespace directory holds: key names (id by key), the bytes of the distinct
    files they name, temp files, and anything else (stray)."""

    names: dict[bytes, int]  # key -> inode
    named_bytes: int
    temps: list[str]
    stray: list[str]
    ledger: int


def dir_state(directory: Path) -> DirState:
    names: dict[bytes, int] = {}
    sizes: dict[int, int] = {}
    temps: list[str] = []
    stray: list[str] = []
    ledger = 0
    for path in sorted(directory.rglob("*")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            # Gone since the listing: a process starting up probes hard links with two empty
            # temp files of its own, outside the ledger's lock (disk/setup.py).
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        name = path.name
        if name == LEDGER_NAME and path.parent == directory:
            raw = path.read_bytes()
            ledger = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else 0
        elif name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
            temps.append(str(path))
        elif name.endswith(SUFFIX) and stat.S_ISREG(st.st_mode):
            names[bytes.fromhex(name[:-len(SUFFIX)])] = st.st_ino
            sizes[st.st_ino] = st.st_size
        else:
            stray.append(str(path))
    return DirState(names, sum(sizes.values()), temps, stray, ledger)


def assert_accounted(disk: DiskTier) -> DirState:
    """The tier's own check, and its ledger equal to the bytes its directory's names hold (no
    other writer runs, and no temp file or stray file is left)."""
    disk.check_integrity()
    state = dir_state(disk.dir)
    assert not state.temps, state.temps
    assert not state.stray, state.stray
    assert state.ledger == state.named_bytes, (state.ledger, state.named_bytes)
    assert state.named_bytes <= disk.max_bytes, (state.named_bytes, disk.max_bytes)
    return state


def ids_of(state: DirState, candidates: range) -> list[int]:
    """The ids among candidates whose keys have a name."""
    return [i for i in candidates if key(i) in state.names]


def mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True,
                   capture_output=True)


@pytest.fixture()
def small_fs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """mount(options) -> a fresh tmpfs mounted with them; all unmounted at the end."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        mount_tmpfs(where, options)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=True)
