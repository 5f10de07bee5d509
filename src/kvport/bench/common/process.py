"""The one protocol by which the benchmarks drive an engine that lives in a process of its own
(vLLM: one engine per process, maybe in a virtualenv of its own): JSON lines. The child prints
one ready object first, then answers each request object on its stdin with one reply on its
stdout, and exits on `{"op": "quit"}` or at the end of its input; its stderr is kept in a
temporary log, whose last error line names why it stopped. Standard library only.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from typing import IO

from kvport.bench.common.command import JsonObject

LOG_TAIL_CHARS = 4000


class EngineProcessFailed(RuntimeError):
    """The process stopped; `reason` is its last error line (or its exit code)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def last_error(log: str) -> str | None:
    """The last `SomeError: message` line of a log (vLLM prefixes its lines with `[rank0]: `)."""
    for line in reversed(log.splitlines()):
        text = line.removeprefix("[rank0]:").strip()
        head = text.split(":", 1)[0]
        if ":" in text and head.isidentifier() and head.endswith(("Error", "Exception")):
            return text
    return None


class JsonLinesProcess:
    """Starts `cmd` at once; `receive` reads one object (the ready line first), `call` writes
    one request and reads its reply."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str],
                 cwd: str | None = None) -> None:
        self.name = name
        # Lives as long as the process (closed in close()), so no `with`.
        self._log: IO[str] = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix=f"kvport-{name.replace('/', '_')}-", suffix=".log")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, env=env, cwd=cwd)

    def call(self, request: JsonObject) -> JsonObject:
        self.send(request)
        return self.receive()

    def send(self, obj: JsonObject) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self.receive()  # the process is gone: raises with its log

    def receive(self) -> JsonObject:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            log = self.log_text()
            raise EngineProcessFailed(f"{self.name}: the process exited with code {code}; its log "
                                      f"ends:\n{log[-LOG_TAIL_CHARS:]}",
                                      last_error(log) or f"exit code {code}")
        reply: JsonObject = json.loads(line)
        return reply

    def log_text(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def close(self, timeout: float = 120) -> None:
        """Ask it to quit (`{"op": "quit"}`), kill it if it does not; idempotent."""
        if self._proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self._proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired, EngineProcessFailed):
                self._proc.kill()
                self._proc.wait()
        if not self._log.closed:
            self._log.close()
