"""Model configuration: the few fields of a Hugging Face `config.json` that the model code reads.

`ModelConfig.from_hf` accepts both spellings of RoPE settings:
- transformers 4: top-level `rope_theta` and `rope_scaling = {"type" | "rope_type": ..., ...}`;
- transformers 5: `rope_parameters = {"rope_type": ..., "rope_theta": ..., ...}`.
A key missing from `config.json` takes the default of the matching transformers config class, so a
directory written by any transformers version reads the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu",)

# `architectures[0]` -> architecture, for configs without `model_type`.
_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# architecture -> defaults of its transformers config class for keys a config.json may omit.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
        "head_dim": None, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
        "head_dim": None, "bos_token_id": None, "eos_token_id": None,
    },
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 32768,
        "head_dim": 128, "bos_token_id": None, "eos_token_id": None,
    },
}


@dataclass(frozen=True)
class RopeScaling:
    """Parameters of a non-default RoPE variant (see rope.py for how each is applied)."""

    rope_type: str  # "linear" | "dynamic" | "llama3" | "yarn"
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: explicit cos/sin scale
    mscale: float | None = None  # yarn (DeepSeek style)
    mscale_all_dim: float | None = None  # yarn (DeepSeek style)
    truncate: bool = True  # yarn: round the correction range to whole dims


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (and on o_proj unless qwen2, see o_proj_bias)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def o_proj_bias(self) -> bool:
        # Qwen2 hard-codes bias on q/k/v only; Llama and Qwen3 put `attention_bias` on all four.
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the dicts of `config.json` and (optionally) `generation_config.json`."""
        arch = _architecture(config)
        d = {**_DEFAULTS[arch], **{k: v for k, v in config.items() if v is not None}}
        layer_types = config.get("layer_types") or ()
        if config.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise ValueError(
                f"{arch} config uses sliding-window attention, which kvport does not support")
        act = d.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        num_heads = int(d["num_attention_heads"])
        max_pos = int(d["max_position_embeddings"])
        rope_theta, rope_scaling = _parse_rope(config, max_pos)
        gen = generation_config or {}
        bos = d.get("bos_token_id")
        if bos is None:
            bos = gen.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d["head_dim"] or d["hidden_size"] // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)) if arch == "llama" else False,
            qk_norm=arch == "qwen3",
            hidden_act=act,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=_merge_ids(d.get("eos_token_id"), gen.get("eos_token_id")),
        )


def _architecture(config: dict[str, Any]) -> str:
    arch = config.get("model_type")
    if arch is None:
        classes = config.get("architectures") or []
        arch = _ARCH_BY_CLASS.get(classes[0], classes[0]) if classes else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    return str(arch)


def _merge_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Union of token ids given as int, list or None, in first-seen order."""
    ids: dict[int, None] = {}
    for v in values:
        for i in [v] if isinstance(v, int) else (v or []):
            ids[int(i)] = None
    return tuple(ids)


def _parse_rope(config: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    params = config.get("rope_parameters")
    if params is not None:
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
    else:
        params = config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "default":
        return theta, None
    # transformers takes the pretraining length from a top-level key first, then the rope dict,
    # and falls back to max_position_embeddings. Dynamic NTK always uses max_position_embeddings.
    original = config.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings") or max_pos
    if rope_type == "dynamic":
        original = max_pos
    factor = params.get("factor")
    if factor is None:
        if rope_type != "yarn":
            raise ValueError(f"rope type {rope_type!r} needs a 'factor' in {params}")
        factor = max_pos / original  # transformers' rule for yarn configs without a factor

    def opt(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    if rope_type == "llama3" and None in (opt("low_freq_factor"), opt("high_freq_factor")):
        raise ValueError(f"llama3 rope needs low_freq_factor and high_freq_factor, got {params}")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        low_freq_factor=opt("low_freq_factor"),
        high_freq_factor=opt("high_freq_factor"),
        beta_fast=opt("beta_fast"),
        beta_slow=opt("beta_slow"),
        attention_factor=opt("attention_factor"),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
