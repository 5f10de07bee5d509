"""The Redis server of `kvport bench soak` when no URL is given: one redis-server on a free
loopback port, no persistence, a small `maxmemory` with `allkeys-lru`, so that Redis evicts during
the soak (the connector must see vanished keys as misses).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

HOST = "127.0.0.1"
START_DEADLINE_S = 30.0


def free_port() -> int:
    """A TCP port free on the loopback interface now (the server binds it right after)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A redis-server this process owns: `start()` returns once it answers PING, `stop()` kills
    it. It dies with this process too (setpriv's parent-death signal, where util-linux has it),
    so a soak killed from outside leaves no server behind."""

    def __init__(self, directory: Path, maxmemory_bytes: int) -> None:
        if maxmemory_bytes < 1:
            raise ValueError(f"maxmemory_bytes must be positive, got {maxmemory_bytes}")
        binary = shutil.which("redis-server")
        if binary is None:
            raise ValueError("redis-server not found on PATH (apt-get install redis-server), "
                             "or give --redis-url")
        self.dir = directory
        self.port = free_port()
        self.maxmemory_bytes = maxmemory_bytes
        setpriv = shutil.which("setpriv")
        self.argv = ([setpriv, "--pdeathsig", "KILL"] if setpriv else []) + [
            binary, "--bind", HOST, "--port", str(self.port), "--protected-mode", "yes",
            "--save", "", "--appendonly", "no", "--dir", str(directory),
            "--logfile", str(directory / "redis.log"), "--daemonize", "no",
            "--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> LocalRedis:
        import redis

        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv, cwd=self.dir, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        probe = redis.Redis(host=HOST, port=self.port, socket_timeout=0.5,
                            socket_connect_timeout=0.5)
        deadline = time.monotonic() + START_DEADLINE_S
        try:
            while True:
                if self.proc.poll() is not None:
                    log = self.dir / "redis.log"
                    tail = log.read_text()[-1000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {tail}")
                try:
                    if probe.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer "
                                       f"within {START_DEADLINE_S} s")
                time.sleep(0.01)  # a server process getting ready: poll, 10 ms apart
        except BaseException:
            self.stop()
            raise
        finally:
            probe.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
