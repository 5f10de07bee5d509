"""One vLLM engine in a process of its own, driven in JSON lines (bench.common.process): the
vLLM side of `kvport bench throughput`, `connector-overhead --engine vllm` and `multi-turn` /
`long-doc --engine vllm`.

Run as a script by vLLM's interpreter: `python server.py --config JSON` (keyword arguments of
vllm.LLM). It imports the standard library and vLLM only, never kvport, because vLLM may live in
a virtualenv of its own (it pins its own torch) where kvport is not installed; kvport's
connector, where a configuration names it, is imported by vLLM itself. One engine per process:
vLLM keeps global state per process, and each configuration must own its caches. The process
owns the real stdout for the protocol and points file descriptor 1 at stderr before vLLM is
imported, because vLLM and its libraries print logs on stdout.

Protocol, one JSON object per line. First `{"event": "ready", "vllm_version", "torch_version",
"torch_threads", "kv_block_size", "num_gpu_blocks", "num_kv_groups", "max_concurrency"}`
(vLLM's own count of max_model_len requests its KV pool holds); then each request gets one
reply:

- `{"op": "run", "prompt_sets": {name: [[ids]]}, "tasks": [task]}`: each task (`{"key", "set",
  "batch", "max_tokens", "keep_output"}`) generates `max_tokens` tokens for the first `batch`
  prompts of `prompt_sets[set]`, timed. Reply: `{"times": {key: s}, "outputs": {key: [[ids]]}}`.
- `{"op": "warm_up", "token_ids"}`: one short untimed request, then vLLM's prefix cache dropped.
- `{"op": "phase", "prompts": [{"id", "token_ids"}], "concurrency", "max_tokens", "cold"}`: a
  closed loop (at most `concurrency` requests in the engine; the next prompt is added the moment
  one finishes); `cold` first drops vLLM's prefix cache and the connector's cache. Reply:
  `{"records": [...], "busy_s", "reset", "max_running"}` (records in finish order, see
  `_Flight.record`; `max_running`: the most requests the scheduler ran at once).
- `{"op": "metrics"}`: `{"metrics": {"connector": ...}}`, kvport's connector counters (none for
  other connectors).
- `{"op": "quit"}` or end of input: shut the engine core down (kvport drains its disk writes).

Times are this loop's `perf_counter`: TTFT runs from `add_request` to the end of the step that
returned the first token, the same clock for every configuration. The per-request counters a
benchmark needs (tokens a connector loaded, preemptions, steps queued) are read from vLLM's
scheduler after every step: the engine core runs in this process.

How vLLM is set up (VLLM_ENV, defaults the client's environment may override), and why:
- VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in this process. In the default
  multiprocess mode vLLM binds the engine's OpenMP threads to one core and reserves the other
  for the front-end process, so the model would run on one thread of a 2-core machine.
- OMP_NUM_THREADS, set by the client: vLLM otherwise drops torch to 1 thread "for serving"; an
  explicit OMP_NUM_THREADS is respected. VLLM_CPU_OMP_THREADS_BIND=nobind: thread binding is
  only done by the multiprocess executor; "nobind" says so explicitly.
- VLLM_CPU_KVCACHE_SPACE (GiB, integer): a bounded KV pool, so vLLM does not size it from RAM.
- No usage-stats thread (VLLM_NO_USAGE_STATS, DO_NOT_TRACK): it would compete for the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# vLLM's reset_prefix_cache answers False while requests or transfers hold blocks; stepping moves
# them on, so this bounds a wait, not a busy loop.
MAX_RESET_ATTEMPTS = 1000
MAX_DRAIN_STEPS = 100_000
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_tasks(llm: Any, sampling_cls: Any, prompt_cls: Any, prompt_sets: dict[str, list[list[int]]],
              tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Times `llm.generate` once per task, in order; checks every prompt got `max_tokens` tokens."""
    times: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    for task in tasks:
        prompts = [prompt_cls(prompt_token_ids=p) for p in prompt_sets[task["set"]][: task["batch"]]]
        params = sampling_cls(max_tokens=task["max_tokens"], temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times[task["key"]] = time.perf_counter() - start
        ids = [list(o.outputs[0].token_ids) for o in outs]
        if any(len(x) != task["max_tokens"] for x in ids):
            raise RuntimeError(f"task {task['key']}: got lengths {[len(x) for x in ids]}, "
                               f"expected {task['max_tokens']} tokens per prompt")
        if task.get("keep_output"):
            outputs[task["key"]] = ids
    return {"times": times, "outputs": outputs}


@dataclass
class _Flight:
    """A request in the engine and what the loop saw of it after each step."""

    id: str
    internal_id: str  # vLLM appends a random suffix; its scheduler knows the request by this
    prompt_tokens: int
    added: float
    steps: int = 0
    external: int = 0
    preemptions: int = 0
    queued_steps: int | None = None
    ttft_steps: int | None = None
    first_token: float | None = None

    def record(self, output: Any, now: float) -> dict[str, Any]:
        ids = list(output.outputs[0].token_ids)
        assert self.first_token is not None and self.ttft_steps is not None, \
            f"request {self.id} finished without a first token"
        return {"id": self.id, "prompt_tokens": self.prompt_tokens, "output_tokens": len(ids),
                "ttft_s": self.first_token - self.added, "e2e_s": now - self.added,
                "num_cached_tokens": int(output.num_cached_tokens or 0),
                "num_external_tokens": self.external, "num_preemptions": self.preemptions,
                "queued_steps": self.queued_steps if self.queued_steps is not None else 0,
                "ttft_steps": self.ttft_steps, "output_token_ids": ids,
                "finish_reason": output.outputs[0].finish_reason}


class EngineServer:
    """The in-process vLLM engine and the operations of the protocol."""

    def __init__(self, llm_kwargs: dict[str, Any]) -> None:
        import torch
        import vllm  # type: ignore[import-not-found]
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

        self.llm = LLM(**llm_kwargs)
        self.sampling_cls, self.prompt_cls = SamplingParams, TokensPrompt
        self.engine = self.llm.llm_engine
        core = self.engine.engine_core
        if not hasattr(core, "engine_core"):
            raise RuntimeError("vLLM's engine core is not in this process: set "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0")
        self.scheduler = core.engine_core.scheduler
        # vLLM's Request does not keep the tokens a connector matched: they are only an argument
        # of update_state_after_alloc, so the connector's is wrapped to note them per request
        self.external_tokens: dict[str, int] = {}
        connector = self.scheduler.connector
        if connector is not None:
            after_alloc = connector.update_state_after_alloc

            def noting_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
                rid = request.request_id
                self.external_tokens[rid] = max(self.external_tokens.get(rid, 0),
                                                int(num_external_tokens))
                return after_alloc(request, blocks, num_external_tokens)

            connector.update_state_after_alloc = noting_after_alloc
        cache = self.engine.vllm_config.cache_config
        self.info = {"event": "ready", "vllm_version": vllm.__version__,
                     "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
                     "kv_block_size": cache.block_size, "num_gpu_blocks": cache.num_gpu_blocks,
                     "num_kv_groups": len(self.scheduler.kv_cache_config.kv_cache_groups),
                     "max_concurrency": _max_concurrency(self.engine.vllm_config,
                                                         self.scheduler.kv_cache_config)}

    def _params(self, max_tokens: int) -> Any:
        return self.sampling_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def drain(self) -> None:
        """Step until the scheduler holds nothing: no request, no connector work (vLLM keeps
        stepping while `has_pending_push_work` says so), as its own serving loop would."""
        for _ in range(MAX_DRAIN_STEPS):
            if not self.scheduler.has_requests():
                return
            self.engine.step()
        raise RuntimeError(f"the engine still had work after {MAX_DRAIN_STEPS} steps")

    def run(self, prompt_sets: dict[str, list[list[int]]],
            tasks: list[dict[str, Any]]) -> dict[str, Any]:
        return run_tasks(self.llm, self.sampling_cls, self.prompt_cls, prompt_sets, tasks)

    def warm_up(self, token_ids: list[int]) -> dict[str, Any]:
        self.llm.generate([self.prompt_cls(prompt_token_ids=token_ids)], self._params(2),
                          use_tqdm=False)
        self.drain()
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache with no request running")
        return {"ok": True}

    def drop_caches(self) -> str:
        """vLLM's prefix cache and the connector's cache (kvport: the host tier, not disk).
        Returns "ok", "none" (no connector) or "unsupported" (its reset_cache returned None)."""
        self.drain()
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache with no request running")
        connector = self.scheduler.connector
        if connector is None:
            return "none"
        for _ in range(MAX_RESET_ATTEMPTS):
            answer = connector.reset_cache()
            if answer is None:
                return "unsupported"
            if answer:
                return "ok"
            self.engine.step()  # transfers in flight: has_requests() keeps the step going
        raise RuntimeError(f"the connector refused reset_cache {MAX_RESET_ATTEMPTS} times "
                           f"with no request in flight")

    def run_phase(self, prompts: list[dict[str, Any]], concurrency: int, max_tokens: int,
                  cold: bool) -> dict[str, Any]:
        reset = self.drop_caches() if cold else "not asked"
        params = self._params(max_tokens)
        waiting = deque(prompts)
        in_flight: dict[str, _Flight] = {}
        records: list[dict[str, Any]] = []
        start = time.perf_counter()
        max_running = 0
        while waiting or in_flight:
            while waiting and len(in_flight) < concurrency:
                p = waiting.popleft()
                added = time.perf_counter()
                internal = self.engine.add_request(
                    p["id"], self.prompt_cls(prompt_token_ids=p["token_ids"]), params)
                in_flight[p["id"]] = _Flight(p["id"], internal, len(p["token_ids"]), added)
            outputs = self.engine.step()
            now = time.perf_counter()
            max_running = max(max_running, len(self.scheduler.running))
            self._observe(in_flight)
            for out in outputs:
                flight = in_flight.get(out.request_id)
                if flight is None:
                    continue
                if flight.first_token is None and out.outputs and out.outputs[0].token_ids:
                    flight.first_token, flight.ttft_steps = now, flight.steps
                if out.finished:
                    records.append(flight.record(out, now))
                    del in_flight[out.request_id]
        self.drain()  # stores and writes still in flight are this configuration's cost
        return {"records": records, "busy_s": time.perf_counter() - start, "reset": reset,
                "max_running": max_running}

    def _observe(self, in_flight: dict[str, _Flight]) -> None:
        from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

        for flight in in_flight.values():
            flight.steps += 1
            # an async load is announced again with 0 tokens once it is done: keep the largest
            flight.external = max(flight.external,
                                  self.external_tokens.pop(flight.internal_id, 0))
            req = self.scheduler.requests.get(flight.internal_id)
            if req is None:  # finished in this step: its last values were seen a step ago
                continue
            flight.preemptions = max(flight.preemptions, int(req.num_preemptions or 0))
            if flight.queued_steps is None and req.status != RequestStatus.WAITING:
                flight.queued_steps = flight.steps - 1

    def metrics(self) -> dict[str, Any]:
        connector = self.scheduler.connector
        half = getattr(connector, "scheduler_half", None)  # kvport's: its counters
        if half is None:
            return {"metrics": {}}
        # A frozen record (kvport's ConnectorMetrics) as plain data, tiers not configured left
        # out; without importing kvport (this script may run in another interpreter).
        record = dataclasses.asdict(half.metrics())
        return {"metrics": {"connector": {k: v for k, v in record.items() if v is not None}}}

    def shutdown(self) -> None:
        self.engine.engine_core.shutdown()


def _max_concurrency(vllm_config: Any, kv_cache_config: Any) -> float | None:
    """vLLM's count of max_model_len requests the KV pool holds (None where vLLM lacks it)."""
    try:
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
            get_max_concurrency_for_kv_cache_config,
        )
    except ImportError:
        return None
    return float(get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config))


def serve(server: EngineServer, proto: IO[str], lines: Iterable[str]) -> None:
    proto.write(json.dumps(server.info) + "\n")
    for line in lines:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            break
        if op == "run":
            reply = server.run(request["prompt_sets"], request["tasks"])
        elif op == "warm_up":
            reply = server.warm_up(request["token_ids"])
        elif op == "phase":
            reply = server.run_phase(request["prompts"], request["concurrency"],
                                     request["max_tokens"], request["cold"])
        elif op == "metrics":
            reply = server.metrics()
        else:
            raise ValueError(f"unknown op {op!r}")
        proto.write(json.dumps(reply) + "\n")


def main(argv: list[str] | None = None) -> int:
    # Run as a script, this file's folder is sys.path[0]; its sibling modules must not shadow
    # top-level modules that vLLM imports.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    p = argparse.ArgumentParser(description="one vLLM engine for kvport's benchmarks")
    p.add_argument("--config", required=True, help="JSON: keyword arguments of vllm.LLM")
    args = p.parse_args(argv)
    for key, value in VLLM_ENV.items():  # before vLLM (and torch) are imported
        os.environ.setdefault(key, value)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    server = EngineServer(json.loads(args.config))
    try:
        serve(server, proto, sys.stdin)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
