"""Rotary position embedding (RoPE) with the scaling variants of Llama-family configs.

Every variant reduces to a vector of inverse frequencies `inv_freq` (head_dim / 2,) plus a scale on
cos/sin (`attention_factor`, yarn only). Position p rotates dims (i, i + head_dim / 2) by angle
`p * inv_freq[i]` (the "rotate half" layout of Hugging Face checkpoints, not interleaved pairs).

The float32 arithmetic follows transformers step by step (inv_freq from a float32 power, angle as
one float32 product, cos/sin in float32, then cast to the activation dtype), so logits agree with it
to float32 rounding. Tables are indexed by absolute position, which is what a KV cache needs: a key
rotated once is never rotated again.

Dynamic NTK is the one variant a cache cannot follow exactly: transformers recomputes the
frequencies of *all* positions from the current sequence length once it exceeds the pretraining
length. Here positions below `original_max_position_embeddings` use plain RoPE (identical to
transformers for every sequence that fits the pretraining length) and positions at or beyond it use
the NTK-scaled base for the full scaled context (`factor * original_max_position_embeddings`), the
same piecewise result transformers' own KV cache produces when a generation crosses that length.
"""

from __future__ import annotations

import math

import torch

from kvport.model.config import ModelConfig, RopeScaling

_INITIAL_TABLE_LEN = 4096


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim  # (dim/2,)
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    # Long wavelengths (beyond the pretraining length / low_freq_factor) are slowed by `factor`,
    # short ones (below length / high_freq_factor) are kept, the band between is interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = (
            _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
    else:
        attention_factor = _yarn_mscale(s.factor)
    beta_fast = s.beta_fast or 32.0
    beta_slow = s.beta_slow or 1.0

    def correction_dim(num_rotations: float) -> float:
        # The dim whose wavelength fits `num_rotations` times into the pretraining length.
        wavelengths = s.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)  # (dim/2,)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1: high-frequency dims keep their pretraining frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def compute_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim / 2,) float32 and the cos/sin scale, for positions that fit
    the pretraining length (for dynamic NTK, see `dynamic_ntk_inv_freq`)."""
    dim, base, s = config.head_dim, config.rope_theta, config.rope_scaling
    if s is None or s.rope_type == "dynamic":
        return _base_inv_freq(base, dim), 1.0
    if s.rope_type == "linear":
        return _base_inv_freq(base, dim) / s.factor, 1.0
    if s.rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(base, dim), s), 1.0
    if s.rope_type == "yarn":
        return _yarn_inv_freq(base, dim, s)
    raise ValueError(f"unsupported rope type {s.rope_type!r}")


def dynamic_ntk_inv_freq(config: ModelConfig, seq_len: int) -> torch.Tensor:
    """Dynamic NTK frequencies for a context of `seq_len` tokens (base grows with the length)."""
    s = config.rope_scaling
    assert s is not None and s.rope_type == "dynamic"
    dim, orig = config.head_dim, s.original_max_position_embeddings
    seq_len = max(seq_len, orig)
    base = config.rope_theta * ((s.factor * seq_len / orig) - (s.factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


class RotaryEmbedding:
    """cos/sin tables indexed by absolute position, grown on demand (doubling)."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq, self.attention_factor = compute_inv_freq(config)
        self._long_inv_freq: torch.Tensor | None = None  # dynamic NTK, past pretraining length
        self._switch_pos = 0  # positions >= this use _long_inv_freq
        s = config.rope_scaling
        if s is not None and s.rope_type == "dynamic":
            self._switch_pos = s.original_max_position_embeddings
            self._long_inv_freq = dynamic_ntk_inv_freq(
                config, int(s.factor * s.original_max_position_embeddings))
        self._cos = torch.empty(0, self.inv_freq.numel())  # (table_len, head_dim / 2) float32
        self._sin = torch.empty(0, self.inv_freq.numel())
        self._initial_len = min(_INITIAL_TABLE_LEN, config.max_position_embeddings)
        self._max_len = config.max_position_embeddings
        # The tables on the device of the last positions seen off the CPU (see cos_sin).
        self._device_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _grow(self, needed: int) -> None:
        n = max(self._initial_len, self._cos.shape[0])
        while n < needed:
            n *= 2
        pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)  # (n, 1)
        angles = pos * self.inv_freq  # (n, head_dim / 2), one rounding like transformers' matmul
        if self._long_inv_freq is not None and n > self._switch_pos:
            angles[self._switch_pos:] = pos[self._switch_pos:] * self._long_inv_freq
        self._cos = angles.cos() * self.attention_factor
        self._sin = angles.sin() * self.attention_factor

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 -> cos, sin each (T, head_dim / 2) in `dtype`, on the device of
        `positions`.

        The tables are computed on the CPU (the float32 steps above, as transformers rounds
        them). For positions on another device they are copied there once, for every position
        up to max_position_embeddings: growing on demand would read the largest position back
        to the host, a synchronization in every step."""
        if positions.device.type != "cpu":
            tables = self._device_tables
            if tables is None or tables[0].device != positions.device:
                if self._cos.shape[0] < self._max_len:
                    self._grow(self._max_len)
                tables = (self._cos.to(positions.device), self._sin.to(positions.device))
                self._device_tables = tables
            cos, sin = tables
            return cos[positions].to(dtype), sin[positions].to(dtype)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self._cos.shape[0]:
            self._grow(needed)
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, head_dim / 2) cos, sin -> (T, 1, head_dim) cos and sign-folded sin: built once per
    step, they make each layer's rotation four ops (`rotate`) instead of eight."""
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, num_heads, head_dim) rotated with `rope_tables`' output; same shape and dtype.

    transformers' `x * cos + rotate_half(x) * sin` with the sign of rotate_half folded into sin:
    bit for bit the same (negating is exact). A strided x (a view into the fused qkv output) is
    read as it is: the one cat makes the result contiguous (20 us per layer at 8 rows, against
    30 us for the half-width form that copied x first)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, num_heads, head_dim); cos, sin (T, head_dim / 2) -> rotated x, same shape and dtype."""
    return rotate(x, *rope_tables(cos, sin))
