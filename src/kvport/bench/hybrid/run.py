"""The two engines of `kvport bench hybrid-pool` and what each reports."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from kvport.bench.common.command import JsonObject
from kvport.bench.common.models import resolve_model_dir
from kvport.bench.vllm.engine import VllmEngineProcess, require_vllm, threads_env

CONFIGS = {"hma-on": False, "hma-off": True}  # name -> disable_hybrid_kv_cache_manager


@dataclass(frozen=True)
class PoolBenchConfig:
    model: str = "builtin:tiny-gemma3"
    prompt_len: int = 2048
    requests: int = 8  # run in each engine: their greedy outputs must be equal
    kv_gib: int = 1
    # Prefill chunks: a sliding group holds a chunk's blocks while it prefills, its window after
    max_num_batched_tokens: int = 512
    max_tokens: int = 32  # decoded tokens: requests stay in the pool, which fills
    vllm_python: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 2:
            raise ValueError(f"--prompt-len must be >= 2, got {self.prompt_len}")
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.max_num_batched_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens and --max-tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}, {self.max_tokens}")
        if self.kv_gib < 1:
            raise ValueError(f"--kv-gib must be >= 1, got {self.kv_gib}")


@dataclass(frozen=True)
class PoolRow:
    config: str
    num_kv_groups: int
    num_blocks: int
    kv_block_size: int
    max_concurrency: float  # vLLM's count of max_model_len requests the pool holds
    requests: int
    busy_s: float


@dataclass(frozen=True)
class PoolResult:
    config: PoolBenchConfig
    model: str
    vllm_version: str
    rows: list[PoolRow] = field(default_factory=list)
    outputs_equal: bool = True

    def to_json(self) -> JsonObject:
        return dataclasses.asdict(self)


def run_pool(cfg: PoolBenchConfig) -> PoolResult:
    require_vllm(cfg.vllm_python)
    model = str(resolve_model_dir(cfg.model))
    env = {**threads_env(cfg.threads), "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_gib)}
    ktc = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
    engines = {name: VllmEngineProcess(name, {
        "model": model, "dtype": "float32", "enforce_eager": True, "seed": 0,
        "max_model_len": cfg.prompt_len + cfg.max_tokens,
        "max_num_seqs": cfg.max_num_batched_tokens,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "kv_transfer_config": ktc, "disable_hybrid_kv_cache_manager": off},
        cfg.vllm_python, env) for name, off in CONFIGS.items()}
    try:
        infos = {name: engine.info for name, engine in engines.items()}
        n = cfg.requests
        prompts = _prompts(n, cfg.prompt_len)
        rows, outputs = [], []
        for name, engine in engines.items():
            reply = engine.run_phase(prompts, concurrency=n, max_tokens=cfg.max_tokens, cold=True)
            info = infos[name]
            rows.append(PoolRow(name, int(info["num_kv_groups"]), int(info["num_gpu_blocks"]),
                                int(info["kv_block_size"]), float(info["max_concurrency"] or 0),
                                n, float(reply["busy_s"])))
            outputs.append(sorted((r["id"], r["output_token_ids"]) for r in reply["records"]))
        return PoolResult(cfg, model, str(infos["hma-on"]["vllm_version"]), rows,
                          all(o == outputs[0] for o in outputs))
    finally:
        for engine in engines.values():
            engine.shutdown()


def _prompts(n: int, length: int) -> dict[str, list[int]]:
    """n prompts of `length` token ids that share no block (ids 32-126: byte tokenizers' text)."""
    rng = random.Random(0)
    return {f"r{i}": [rng.randrange(32, 127) for _ in range(length)] for i in range(n)}
