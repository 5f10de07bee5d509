"""One workload process of the soak: started, its report lines read on a thread into a queue
shared by all processes (each line tagged with its process's index), killed or stopped, and
what the soak learned of it booked in a `Life` (frozen as an `Incarnation` for the report).
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.bench.soak.result import Incarnation

STOP_DEADLINE_S = 120.0  # a stopped child's drain and shutdown, on a busy machine

Lines = queue.Queue[tuple[int, dict[str, Any] | None]]  # None: the process's stdout ended


@dataclass
class Life:
    """What the soak books of one workload process while it runs (times from the soak's t0)."""

    index: int
    started_s: float
    pid: int = 0
    ready_s: float | None = None
    startup_s: float | None = None
    ended_s: float | None = None
    end: str | None = None  # "killed", "stopped", or what went wrong
    clean_exit: bool = False
    requests: int = 0
    last_metrics: dict[str, Any] | None = None

    def frozen(self) -> Incarnation:
        return Incarnation(index=self.index, pid=self.pid, started_s=self.started_s,
                           ready_s=self.ready_s, startup_s=self.startup_s, ended_s=self.ended_s,
                           end=self.end or "running at the end", clean_exit=self.clean_exit,
                           requests=self.requests, metrics=self.last_metrics)

    def book(self, record: dict[str, Any], now_s: float,
             requests: list[dict[str, Any]]) -> tuple[list[float], int]:
        """Book one report line (soak_child's protocol); returns (its step times in ms,
        requests it finished)."""
        kind = record.get("kind")
        if kind == "ready":
            self.ready_s, self.startup_s = now_s, float(record["startup_s"])
        elif kind == "request":
            self.requests += 1
            requests.append({**record, "incarnation": self.index})
            return [], 1
        elif kind == "stats":
            self.last_metrics = record["metrics"]
            return [float(x) for x in record["step_ms"]], 0
        elif kind == "done":
            self.clean_exit = True
        return [], 0


class ChildProcess:
    """A running workload process; `close()` once it has exited (joins its reader)."""

    def __init__(self, life: Life, argv: list[str], config: str, log: Path,
                 lines: Lines) -> None:
        """Start argv with `config` on its stdin (then closed)."""
        self.life = life
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log)
        life.pid = self.proc.pid
        assert self.proc.stdin is not None, "stdin is a pipe"
        try:
            self.proc.stdin.write(config.encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the soak sees it exit, with its log
        self._reader = threading.Thread(target=self._read, args=(lines,), daemon=True)
        self._reader.start()

    def _read(self, lines: Lines) -> None:
        assert self.proc.stdout is not None, "stdout is a pipe"
        for raw in self.proc.stdout:
            try:
                lines.put((self.life.index, json.loads(raw)))
            except ValueError:
                pass  # the line SIGKILL cut short: always the last one
        lines.put((self.life.index, None))

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def kill(self, now_s: float) -> None:
        """SIGKILL (a crash: nothing flushed, nothing cleaned up) and reap."""
        self.proc.kill()
        self.proc.wait(timeout=60)
        self.life.end, self.life.ended_s = "killed", now_s

    def stop(self, t0: float) -> None:
        """SIGTERM, then wait for its drain and shutdown (SIGKILL after STOP_DEADLINE_S)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_DEADLINE_S)
            self.life.end = "stopped" if self.proc.returncode == 0 else \
                f"stop failed ({self.proc.returncode})"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=60)
            self.life.end = f"did not stop within {STOP_DEADLINE_S} s"
        self.life.ended_s = time.monotonic() - t0

    def close(self) -> None:
        if self.proc.poll() is None:  # the soak is ending on an error: leave nothing running
            self.proc.kill()
            self.proc.wait(timeout=60)
        self._reader.join(timeout=30)
        assert not self._reader.is_alive(), "the reader ends at the child's EOF"
        self._log.close()

    def log_tail(self) -> str:
        return log_tail(self.log_path)


def log_tail(path: Path, chars: int = 2000) -> str:
    """The end of a child's stderr log, for a report on why it died ("" if unreadable)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def drain(lines: Lines, lives: list[Life], requests: list[dict[str, Any]], now_s: float) -> None:
    """Book what is queued (a dead child's last lines) without waiting."""
    while True:
        try:
            index, record = lines.get_nowait()
        except queue.Empty:
            return
        if record is not None:
            lives[index].book(record, now_s, requests)
