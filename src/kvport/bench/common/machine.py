"""The machine a benchmark ran on, as a reader needs it to judge a number, and the load other
processes put on it while the benchmark measured.

Absolute numbers on a shared machine mean little, so every benchmark records these next to its
ratios: the CPU, the cores usable, torch's thread count, the library versions, the load average,
and per timed round the cores other processes kept busy (`OtherLoadMeter`).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from kvport.bench.common.command import JsonObject


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str
    cpu_count: int | None
    cpus_usable: int | None  # this process's CPU affinity
    torch_threads: int
    torch_version: str
    python: str
    platform: str
    loadavg: tuple[float, float, float] | None
    kvport_version: str | None
    transformers_version: str | None

    def to_json(self) -> JsonObject:
        return asdict(self)


def machine_info() -> MachineInfo:
    """CPU, cores, threads, load and library versions, now."""
    import torch  # here, so that `kvport bench --help` does not import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return MachineInfo(
        cpu_model=cpu, cpu_count=os.cpu_count(),
        cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        torch_threads=torch.get_num_threads(), torch_version=torch.__version__,
        python=sys.version.split()[0], platform=platform.platform(), loadavg=loadavg(),
        kvport_version=_version("kvport"), transformers_version=_version("transformers"))


def loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class OtherLoadMeter:
    """How many cores other processes kept busy while we measured (Linux; else None).

    Busy CPU time of the whole machine (/proc/stat) minus that of this process and its children
    (an engine process included), divided by wall time. On a shared machine a timed round with
    other load near one core is worth little; results record it per round so readers can tell.
    `steal_cores` (after `stop`) is the part of it the hypervisor took: time our virtual CPUs
    were ready but not run, which makes a run slower and noisier across the board.
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, float, float] | None = None
        self.steal_cores: float | None = None

    def start(self) -> None:
        self._start = self._sample()
        self.steal_cores = None

    def stop(self) -> float | None:
        begin, end = self._start, self._sample()
        if begin is None or begin[0] < 0 or end[0] < 0:
            return None
        wall = end[2] - begin[2]
        if wall <= 0:
            return None
        self.steal_cores = max(0.0, (end[3] - begin[3]) / wall)
        other = (end[0] - begin[0]) - (end[1] - begin[1])
        return max(0.0, other / wall)

    @staticmethod
    def _sample() -> tuple[float, float, float, float]:
        """(machine busy CPU s, our process tree's CPU s, wall s, stolen CPU s); -1 s when
        /proc is missing."""
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return (-1.0, 0.0, time.monotonic(), 0.0)
        ticks = os.sysconf("SC_CLK_TCK")
        busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))  # not idle/iowait
        steal = int(fields[7]) if len(fields) > 7 else 0
        return (busy / ticks, _tree_cpu_ticks(os.getpid()) / ticks, time.monotonic(),
                steal / ticks)


def _tree_cpu_ticks(root: int) -> int:
    """utime + stime of `root` and its live descendants (plus children already reaped)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process ended meanwhile
            stats[int(entry.name)] = (int(rest[1]), sum(int(v) for v in rest[11:15]))
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(kids)
        frontier.extend(kids)
    # fields 11-14 are utime, stime, cutime, cstime: children reaped earlier count as ours
    return sum(stats[pid][1] for pid in tree if pid in stats)
