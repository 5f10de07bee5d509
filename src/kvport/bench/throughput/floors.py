"""What this machine allows a decode step and a prefill, to set engine speeds next to.

- Decode: a step at batch B reads every weight of the model once (the projections of every
  layer and the logits head; the embedding lookup reads only B rows), so B tokens per
  (weight bytes / memory read bandwidth) is its ceiling. The KV cache it also reads is small
  next to the weights for short contexts, and left out.
- Prefill: an L-token prompt costs 2 * L * (projection parameters) multiply-adds in the
  projections plus the causal attention, 4 * L^2 / 2 * layers * heads * head_dim; at the rate
  `torch.mm` reaches on a prefill-sized matrix product, L tokens per (flops / rate) is its
  ceiling (the logits head runs for the last token only).

Both limits are measured in the same run as the engines, on as many threads as they use:
bandwidth as `torch.sum` over a buffer larger than any cache, matmul throughput as the best
`torch.mm` reaches on (L, in) activations by each of the model's projections (in, out), in float32
and in the model's dtype. Each is the best of _ROUNDS after a warm-up call, so a ceiling stays
above what an engine reaches even when the machine slows down for a moment (a single cold round can
measure a rate below what an engine's prefill then reaches). torch's half-precision matmul is a slow fallback on CPUs without native support (AVX2): there
the engine multiplies in float32 (kvport.model.linear), whose rate sets its prefill ceiling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvport.bench.common.command import JsonObject
from kvport.model.config import ModelConfig

_READ_BYTES = 1 << 30  # well beyond any L3
_ROUNDS = 10


@dataclass(frozen=True)
class MachineLimits:
    threads: int
    read_gb_s: float  # memory read bandwidth, best of _ROUNDS
    mm_gflop_s: dict[str, float]  # dtype -> best torch.mm rate over the prefill's products


@dataclass(frozen=True)
class ModelCost:
    weight_bytes_per_step: int  # bytes a decode step reads in weights, in the model's dtype
    prefill_flops: float  # of one prefill of `prefill_len` tokens
    prefill_len: int

    def decode_ceiling(self, batch: int, limits: MachineLimits) -> float:
        """tokens/s if a step cost only its weight reads."""
        return batch * limits.read_gb_s * 1e9 / self.weight_bytes_per_step

    def prefill_ceiling(self, limits: MachineLimits, dtype: str) -> float:
        """tokens/s if the prefill cost only its flops at torch.mm's rate in `dtype`."""
        return self.prefill_len * limits.mm_gflop_s[dtype] * 1e9 / self.prefill_flops


def model_cost(config: ModelConfig, dtype: torch.dtype, prefill_len: int) -> ModelCost:
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * i
    head = config.vocab_size * h
    element = torch.tensor([], dtype=dtype).element_size()
    attention = 4 * prefill_len * prefill_len / 2 * layers * config.num_attention_heads \
        * config.head_dim
    flops = 2 * prefill_len * per_layer * layers + 2 * head + attention
    return ModelCost((per_layer * layers + head) * element, flops, prefill_len)


def measure_limits(projections: list[tuple[int, int]], rows: int, dtypes: tuple[str, ...]
                   ) -> MachineLimits:
    """Read bandwidth and torch.mm throughput with torch's current thread count; `projections`
    are the model's (in_features, out_features) products, each run with `rows` activations."""
    buf = torch.ones(_READ_BYTES // 4, dtype=torch.float32)
    read = _best(lambda: buf.sum())
    del buf
    rates: dict[str, float] = {}
    for name in dict.fromkeys(("float32", *dtypes)):
        dt = getattr(torch, name)
        best_rate = 0.0
        for k, n in projections:
            x, w = torch.randn(rows, k).to(dt), torch.randn(k, n).to(dt)
            best_rate = max(best_rate, 2 * rows * k * n / _best(lambda: torch.mm(x, w)) / 1e9)
        rates[name] = best_rate
    return MachineLimits(torch.get_num_threads(), _READ_BYTES / read / 1e9, rates)


@dataclass(frozen=True)
class Ceilings:
    """One model's ceilings on this machine: `metrics` has the systems' keys (decode_bB, and
    prefill at the float32 rate), `prefill_dtype` the prefill ceiling per dtype."""

    metrics: dict[str, float]
    read_gb_s: float
    mm_gflop_s: dict[str, float]
    threads: int
    weight_bytes_per_step: int
    prefill_flops: float
    prefill_dtype: dict[str, float]

    def to_json(self) -> JsonObject:
        return asdict(self)


def ceilings(model_dir: Path, dtype: str, batch_sizes: tuple[int, ...],
             prefill_len: int) -> Ceilings:
    """This machine's limits for the model, measured now with torch's thread count (the
    systems'), and the tokens/s they allow."""
    from kvport.model.loader import read_config

    mc = read_config(model_dir)
    cost = model_cost(mc, getattr(torch, dtype), prefill_len)
    h = mc.hidden_size
    projections = [(h, mc.q_size + 2 * mc.kv_size), (mc.q_size, h),
                   (h, 2 * mc.intermediate_size), (mc.intermediate_size, h)]
    limits = measure_limits(projections, prefill_len, (dtype,))
    metrics = {f"decode_b{b}": cost.decode_ceiling(b, limits) for b in batch_sizes}
    metrics["prefill"] = cost.prefill_ceiling(limits, "float32")
    return Ceilings(metrics, limits.read_gb_s, limits.mm_gflop_s, limits.threads,
                    cost.weight_bytes_per_step, cost.prefill_flops,
                    {d: cost.prefill_ceiling(limits, d) for d in limits.mm_gflop_s})


def _best(fn: Callable[[], object]) -> float:
    """Fastest of _ROUNDS timed calls after one warm-up (first-touch pages, library set-up)."""
    fn()
    best = float("inf")
    for _ in range(_ROUNDS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
