"""Child processes of the disk chaos tests (test_disk_chaos.py); run as a script.

    disk_chaos_child.py zygote ROOT MAX_BYTES
        Imports torch and the tier once, then reads lines "POINT SEED" on stdin; for each it forks
        a writer that stores and loads through a DiskTier on ROOT and SIGKILLs itself at the
        seed's chosen occurrence of POINT (KILL_POINTS), and answers "POINT SEED killed" (or
        "exited N": the point never came, or, with N != 0, the writer failed). One writer at a
        time: the test checks the directory with a fresh tier between two.
    disk_chaos_child.py workers ROOT MAX_BYTES SECONDS N
        Imports once, then forks N workers that do random stores and loads of overlapping keys
        on ROOT at once for SECONDS, every load byte-exact or a miss; prints their JSON reports
        (ops, misses, peak descriptors), one a line, and exits 0; exits 3 if a worker failed
        (its AssertionError on stderr).

Kill points are hooks on the os calls the tier makes, installed only in the forked writer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from disk_chaos import NS, load, store

from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.disk.location import SUFFIX, TEMP_SUFFIX

NUM_KEYS = 48  # ids the writers use: overlapping runs, and evictions at a small max_bytes
MAX_OPS = 300


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hook(name: str, when: str, nth: int, only: Callable[..., bool] = lambda *a: True) -> None:
    """Make os.<name> SIGKILL this process `when` ("before" or "after") its nth call that
    `only` accepts."""
    real = getattr(os, name)
    seen = [0]

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if not only(*args):
            return real(*args, **kwargs)
        seen[0] += 1
        if seen[0] == nth and when == "before":
            _die()
        out = real(*args, **kwargs)
        if seen[0] == nth:
            _die()
        return out

    setattr(os, name, hooked)


def _half_writev(nth: int) -> None:
    """The nth writev writes half of its first buffer, then the process dies."""
    real = os.writev
    seen = [0]

    def hooked(fd: int, buffers: list[memoryview]) -> int:
        seen[0] += 1
        if seen[0] == nth:
            first = memoryview(buffers[0]).cast("B")
            os.write(fd, first[:max(1, first.nbytes // 2)])
            _die()
        return real(fd, buffers)

    os.writev = hooked  # type: ignore[assignment]


def _is_temp(path: Any, *_: Any) -> bool:
    return str(path).endswith(TEMP_SUFFIX)


def _is_name(path: Any, *_: Any) -> bool:
    return str(path).endswith(SUFFIX)


# point -> how to arm it at the nth occurrence (what the writer has done when it dies)
KILL_POINTS: dict[str, Callable[[int], None]] = {
    # a temp file created, empty, not yet counted in the ledger
    "temp-created": lambda n: _hook("ftruncate", "before", n),
    # the temp file at its full size, the ledger not yet written
    "temp-sized": lambda n: _hook("ftruncate", "after", n),
    # the ledger written (a reserve counted, or a free), nothing after it
    "ledger-written": lambda n: _hook("pwrite", "after", n),
    # half of a run's first buffer (its header) written
    "mid-write": _half_writev,
    # the run written whole, no name linked yet
    "written": lambda n: _hook("link", "before", n, _is_temp),
    # one name of a run linked, the others not (runs of several keys)
    "linked-some": lambda n: _hook("link", "after", n, _is_temp),
    # every name linked, the temp name not yet removed
    "linked": lambda n: _hook("unlink", "before", n, _is_temp),
    # one name removed by an eviction (or a reject), the ledger not yet told
    "mid-eviction": lambda n: _hook("unlink", "after", n, _is_name),
}


def _workload(disk: DiskTier, rng: random.Random, until: float, report: dict[str, int]) -> None:
    """Random stores and loads (runs of 1-4 keys) until `until` (monotonic; 0: MAX_OPS)."""
    while time.monotonic() < until if until else report["ops"] < MAX_OPS:
        ids = rng.sample(range(NUM_KEYS), rng.randint(1, 4))
        if rng.random() < 0.5:
            store(disk, ids)
        else:
            got = load(disk, ids)  # AssertionError on wrong bytes
            report["loaded"] += len(got)
            report["misses"] += len(ids) - len(got)
        report["ops"] += 1
        report["peak_fds"] = max(report["peak_fds"], len(os.listdir("/proc/self/fd")))


def _writer(root: str, max_bytes: int, point: str, seed: int) -> int:
    rng = random.Random(seed)
    disk = DiskTier(root, max_bytes, NS, num_threads=1)  # a kill at start: not what is tested
    KILL_POINTS[point](rng.randint(1, 6))
    report = {"ops": 0, "loaded": 0, "misses": 0, "peak_fds": 0}
    _workload(disk, rng, 0.0, report)
    return 0


def zygote(root: str, max_bytes: int) -> None:
    for line in sys.stdin:
        point, seed = line.split()
        pid = os.fork()
        if pid == 0:
            code = 4
            try:
                code = _writer(root, max_bytes, point, int(seed))
            except AssertionError:
                traceback.print_exc()
                code = 3
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            answer = "killed"
        else:
            answer = f"exited {os.waitstatus_to_exitcode(status)}"
        print(point, seed, answer, flush=True)


def _worker(root: str, max_bytes: int, seconds: float, seed: int, out: int) -> None:
    rng = random.Random(seed)
    start_fds = len(os.listdir("/proc/self/fd"))
    disk = DiskTier(root, max_bytes, NS, num_threads=1)
    report = {"seed": seed, "ops": 0, "loaded": 0, "misses": 0, "peak_fds": 0,
              "start_fds": start_fds}
    _workload(disk, rng, time.monotonic() + seconds, report)
    report["open_runs"] = len(disk.files)
    s = disk.stats.snapshot()
    report.update(evictions=s.evictions, skipped_stores=s.skipped_stores, failures=s.failures,
                  rejected=s.rejected)
    disk.close()
    os.write(out, (json.dumps(report) + "\n").encode())


def workers(root: str, max_bytes: int, seconds: float, n: int) -> None:
    read, write = os.pipe()
    pids = []
    for seed in range(n):
        pid = os.fork()
        if pid == 0:
            code = 4
            try:
                os.close(read)
                _worker(root, max_bytes, seconds, seed, write)
                code = 0
            except AssertionError:
                traceback.print_exc()
                code = 3
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(write)
    with os.fdopen(read) as reports:
        sys.stdout.write(reports.read())
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    sys.exit(0 if codes == [0] * n else 3)


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        zygote(sys.argv[2], int(sys.argv[3]))
    else:
        workers(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
