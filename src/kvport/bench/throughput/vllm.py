"""vLLM's CPU build as a system of `kvport bench throughput`: an engine process of vLLM's own
interpreter (`--vllm-python`), run with the thread count of kvport's, prefix caching off, eager
(no torch.compile, which also needs triton-cpu), its KV block size left at the CPU default and
reported back. Why each environment variable: bench.vllm.server."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from kvport.bench.throughput.config import Task
from kvport.bench.throughput.systems import PromptSets, TaskTimes
from kvport.bench.vllm.engine import VllmEngineProcess


class VllmSystem:
    """A vLLM engine process, driven one round of tasks at a time."""

    name = "vllm"

    def __init__(self, python: str, model_dir: Path, dtype: str, threads: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, kv_space_gib: int = 2) -> None:
        if not Path(python).exists():
            raise FileNotFoundError(f"vLLM python {python!r} does not exist")
        vllm_env = {"OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1"}
        env = {**os.environ, **vllm_env}
        env.pop("PYTHONPATH", None)  # kvport's environment must not leak into vLLM's interpreter
        llm_kwargs: dict[str, Any] = {
            "model": str(model_dir), "dtype": dtype, "enforce_eager": True, "seed": 0,
            "skip_tokenizer_init": True, "enable_prefix_caching": False,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens}
        self._engine = VllmEngineProcess("vLLM server", llm_kwargs, python, env,
                                         cwd=tempfile.gettempdir())
        self.settings: dict[str, Any] = {
            "env": vllm_env, "enforce_eager": True, "enable_prefix_caching": False,
            "dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens}
        info = self._engine.info
        self.version = str(info.get("vllm_version"))
        self.settings.update(torch_version=info.get("torch_version"),
                             kv_block_size=info.get("kv_block_size"))
        self.threads = int(info.get("torch_threads", 0))

    def run_tasks(self, prompt_sets: PromptSets, tasks: list[Task]) -> TaskTimes:
        reply = self._engine.call({"op": "run", "prompt_sets": prompt_sets,
                                   "tasks": [t.to_json() for t in tasks]})
        return TaskTimes(reply["times"], reply["outputs"])

    def close(self) -> None:
        self._engine.shutdown(timeout=60)
