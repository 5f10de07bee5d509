"""What `kvport bench throughput` measures, and the tasks every system times.

A task is one `generate` call: `max_tokens` tokens for the first `batch` prompts of a named
prompt set. Decode at batch B is timed as two tasks (1 token and N tokens from the same B
prompts), prefill as one (1 token from one long prompt).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvport.bench.common.command import JsonObject

BASELINES = ("transformers", "vllm")
DEFAULT_VLLM_PYTHON = "/opt/vllm-venv/bin/python"


def default_vllm_python() -> str | None:
    return DEFAULT_VLLM_PYTHON if Path(DEFAULT_VLLM_PYTHON).exists() else None


@dataclass(frozen=True)
class ThroughputConfig:
    models: tuple[str, ...] = ("builtin:tiny-llama",)
    dtype: str = "float32"
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 128
    decode_tokens: int = 128
    prefill_len: int = 2048
    repeats: int = 3
    baselines: tuple[str, ...] = BASELINES
    vllm_python: str | None = field(default_factory=default_vllm_python)
    vllm_kv_space_gib: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models: need at least one model")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes {self.batch_sizes}: need positive integers")
        for name in ("prompt_len", "prefill_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens={self.decode_tokens}: must be >= 2")
        unknown = set(self.baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; accepted: {list(BASELINES)}")

    @property
    def max_model_len(self) -> int:
        return max(self.prefill_len + 1, self.prompt_len + self.decode_tokens)

    @property
    def max_num_seqs(self) -> int:
        return max(64, *self.batch_sizes)

    def to_json(self) -> JsonObject:
        return asdict(self)


@dataclass(frozen=True)
class Task:
    """Generate `max_tokens` tokens for the first `batch` prompts of `prompt_sets[set]`; with
    `keep_output`, the tokens come back (greedy agreement between systems)."""

    key: str
    set: str
    batch: int
    max_tokens: int
    keep_output: bool = False

    def to_json(self) -> JsonObject:
        """The task as the vLLM server reads it (bench.vllm.server, which cannot import this)."""
        return asdict(self)


def make_tasks(cfg: ThroughputConfig, max_tokens_cap: int | None = None) -> list[Task]:
    """Every timed shape once: decode at each batch size (1 and N tokens), then prefill."""
    n = cfg.decode_tokens if max_tokens_cap is None else min(cfg.decode_tokens, max_tokens_cap)
    tasks: list[Task] = []
    for b in cfg.batch_sizes:
        tasks.append(Task(f"decode/b{b}/n1", "decode", b, 1))
        tasks.append(Task(f"decode/b{b}/nN", "decode", b, n, keep_output=True))
    tasks.append(Task("prefill", "prefill", 1, 1))
    return tasks
