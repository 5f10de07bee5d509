"""Sampling parameters of one request (vLLM's names for the common fields)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvport.connectors.transfer_params import TransferLimits


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return with each sampled token
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many tokens are generated
    # vLLM's name: free-form arguments; "kv_transfer_params" holds the request's limits for the
    # KV connector (kvport.connectors.transfer_params), checked here.
    extra_args: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        # Accept a list for stop_token_ids (the common way to write it) but keep the record hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be an integer >= 0 (or -1 for none), got {self.top_k!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an int, got {self.seed!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
               f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        _check(self.extra_args is None or isinstance(self.extra_args, Mapping),
               f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        TransferLimits.parse(self.kv_transfer_params)  # a bad value fails here, for this request

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        return None if self.extra_args is None else self.extra_args.get("kv_transfer_params")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
