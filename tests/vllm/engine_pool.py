"""A few long-lived processes that run vLLM engines for the tests (engine_worker.py), shared by
every test module of the session: each worker imports vLLM once, then builds a fresh engine per
job. The workers run side by side with one thread each (two of them on this machine's two
cores), so test modules submit their jobs from threads and wait for all of them together.

A job can ask for a process that has not run some other job (`not_in`): "a second process reads
what the first stored" must not be answered by the process that stored it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

WORKER = Path(__file__).with_name("engine_worker.py")
JOB_TIMEOUT_S = 900


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@dataclass
class EnginePool:
    log_dir: Path
    size: int = 2
    _idle: list[Worker] = field(default_factory=list)
    _started: int = 0  # live workers, idle or busy
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def run(self, kind: str, cfg: dict[str, Any],
            not_in: Collection[int] = ()) -> tuple[dict[str, Any], int]:
        """Run one job on a worker whose pid is not in `not_in`; its result and that pid."""
        worker = self._take(not_in)
        try:
            result = self._ask(worker, {"kind": kind, "cfg": cfg})
        except BaseException:
            self._retire(worker)
            raise
        if "error" in result:
            self._retire(worker)  # the worker exits after an error (engine_worker.py)
        else:
            with self._cond:
                self._idle.append(worker)
                self._cond.notify_all()
        return result, worker.pid

    def close(self) -> None:
        with self._cond:
            workers, self._idle = self._idle, []
        for worker in workers:
            self._stop(worker)

    def _take(self, not_in: Collection[int]) -> Worker:
        with self._cond:
            while True:
                for worker in self._idle:
                    if worker.pid not in not_in:
                        self._idle.remove(worker)
                        return worker
                only_excluded_idle = bool(self._idle)  # every idle worker is in not_in
                if self._started < self.size or only_excluded_idle:
                    self._started += 1
                    break
                assert self._cond.wait(timeout=JOB_TIMEOUT_S), "no vLLM worker became free"
        return self._spawn()

    def _spawn(self) -> Worker:
        log_path = self.log_dir / f"vllm-worker-{self._started}-{threading.get_ident()}.log"
        # One thread per engine: the workers run side by side on the machine's cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        log: IO[str] = log_path.open("w")
        proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                cwd=WORKER.parent)
        log.close()  # the child holds its own descriptor
        return Worker(proc, log_path)

    def _ask(self, worker: Worker, job: dict[str, Any]) -> dict[str, Any]:
        assert worker.proc.stdin and worker.proc.stdout
        worker.proc.stdin.write(json.dumps(job) + "\n")
        worker.proc.stdin.flush()
        watchdog = threading.Timer(JOB_TIMEOUT_S, worker.proc.kill)  # a hung engine fails
        watchdog.start()
        try:
            for line in worker.proc.stdout:  # vLLM may print other lines: skip them
                if line.startswith("RESULT "):
                    return dict(json.loads(line.removeprefix("RESULT ")))
        finally:
            watchdog.cancel()
        raise AssertionError(f"vLLM worker {worker.pid} died:\n{worker.log_tail()}")

    def _retire(self, worker: Worker) -> None:
        self._stop(worker)
        with self._cond:
            self._started -= 1
            self._cond.notify_all()

    @staticmethod
    def _stop(worker: Worker) -> None:
        assert worker.proc.stdin
        worker.proc.stdin.close()  # the worker's loop ends at end of input
        try:
            worker.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()
        if worker.proc.stdout:
            worker.proc.stdout.close()
