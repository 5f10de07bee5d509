"""Engine configuration: one frozen record, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "builtin:tiny-llama"
    dtype: str = "float32"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # size of the KV pool; None: from kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: enough for max_num_seqs full requests, capped
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    kv_transfer_config: Any = None  # KVTransferConfig, dict or JSON string (connector issue)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes!r}")
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_bytes, not both")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; accepted: {sorted(known)}")
        return cls(**kwargs)
