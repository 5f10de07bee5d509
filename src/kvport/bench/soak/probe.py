"""What `kvport bench soak` samples, each a frozen record: a process's resources (from /proc),
a disk tier root's use, and a Redis server's memory and evictions.

Every probe is cheap (one /proc read, one directory walk, one INFO) and never raises for a
process that just died or a file that just vanished: the soak kills its workload process at
random moments, so a probe races with exits and with the disk tier's own renames and unlinks.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The disk tier writes a run under this prefix and suffix, then links it to its keys' names
# (tiers/disk/location.py); a name of this shape left behind is a writer's unfinished run.
TEMP_PREFIX = ".run."
TEMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class ProcessSample:
    """One process's resident memory, open descriptors and threads."""

    rss_bytes: int
    fds: int
    threads: int


@dataclass(frozen=True)
class DiskUsage:
    """A directory tree's files. `bytes` counts each inode once (a run file has one hard link
    per key it holds, all naming the same bytes); `allocated_bytes` is what the file system
    allocated for them (st_blocks)."""

    bytes: int
    allocated_bytes: int
    files: int  # distinct inodes
    names: int  # directory entries naming regular files
    temp_files: int  # unfinished runs (TEMP_PREFIX...TEMP_SUFFIX)


@dataclass(frozen=True)
class RedisSample:
    used_memory: int
    evicted_keys: int
    keys: int


def sample_process(pid: int) -> ProcessSample | None:
    """The process's figures, or None if it is gone (or not readable: another user's)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    if fields.get("State", "").startswith(("Z", "X")):
        return None  # a zombie has no memory or descriptors left to measure
    try:
        rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
        threads = int(fields["Threads"])
    except (KeyError, ValueError, IndexError):
        return None
    return ProcessSample(rss_bytes=rss_kib * 1024, fds=fds, threads=threads)


def disk_usage(root: str | os.PathLike[str]) -> DiskUsage:
    """What the files under `root` hold now (0s for a root that does not exist yet)."""
    seen: dict[tuple[int, int], tuple[int, int]] = {}
    names = temps = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue  # removed between the listing and the stat
            if not stat.S_ISREG(st.st_mode):
                continue
            names += 1
            if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
                temps += 1
            seen[(st.st_dev, st.st_ino)] = (st.st_size, st.st_blocks * 512)
    return DiskUsage(bytes=sum(s for s, _ in seen.values()),
                     allocated_bytes=sum(a for _, a in seen.values()), files=len(seen),
                     names=names, temp_files=temps)


def redis_sample(client: Any) -> RedisSample | None:
    """used_memory, evicted_keys and the key count of the client's server; None if it does not
    answer (the soak goes on: a Redis that is down costs hits, and shows here as gaps)."""
    try:
        memory = client.info("memory")
        stats = client.info("stats")
        keys = int(client.dbsize())
    except Exception:  # noqa: BLE001  (any redis-py error: the sample is missing, not fatal)
        return None
    return RedisSample(used_memory=int(memory["used_memory"]),
                       evicted_keys=int(stats["evicted_keys"]), keys=keys)
