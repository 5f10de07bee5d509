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

from kvport.model.granite_config import MambaConfig, granite_fields

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3_text", "granitemoehybrid")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = {"gemma3_text": ("gelu_pytorch_tanh",)}  # the rest: silu only
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
MAMBA = "mamba"  # a Mamba2 state-space layer (Granite 4); transformers 5 says "linear_attention"
_LAYER_TYPE_ALIASES = {"attention": FULL_ATTENTION, "linear_attention": MAMBA}

# `architectures[0]` -> architecture, for configs without `model_type`.
_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
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
    "gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 131072, "head_dim": 256, "bos_token_id": 2,
        "eos_token_id": 1, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6, "tie_word_embeddings": True,
    },
    "granitemoehybrid": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
        "head_dim": None, "bos_token_id": 1, "eos_token_id": 2, "shared_intermediate_size": 1024,
        "num_local_experts": 8, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
        "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "time_step_limit": (0.0, float("inf")),
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
    # Per layer, FULL_ATTENTION or SLIDING_ATTENTION; empty: every layer full attention.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # a sliding layer's query sees this many keys, itself included
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    local_rope_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), plain RoPE
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    # Granite 4: no RoPE ("nope"), multipliers on the embedding, each residual branch, the
    # attention scores (instead of head_dim^-1/2) and the logits (divided), Mamba2 layers.
    use_rope: bool = True
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    mamba: MambaConfig | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has "
                             f"{self.num_hidden_layers}")
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION, MAMBA}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: "
                             f"{FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}, {MAMBA!r}")
        if (MAMBA in self.layer_types) != (self.mamba is not None):
            raise ValueError("Mamba layers and a Mamba config come together; got layer types "
                             f"{sorted(set(self.layer_types))} and mamba={self.mamba}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window or 0) < 1:
            raise ValueError(f"sliding-window layers need sliding_window >= 1, got "
                             f"{self.sliding_window}")

    def layer_window(self, layer_idx: int) -> int | None:
        """The keys a query of this layer sees, itself included; None: all before it."""
        if self.layer_types and self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def is_state_layer(self, layer_idx: int) -> bool:
        """A state-space layer: it keeps a recurrent state per request, not K/V per token."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == MAMBA

    @property
    def is_hybrid(self) -> bool:
        """Layers of more than one attention type (several KV cache groups)."""
        return len(set(self.layer_types)) > 1

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
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS.get(arch, ("silu",)):
            raise ValueError(f"unsupported hidden_act {act!r} for {arch}; supported: "
                             f"{SUPPORTED_ACTIVATIONS.get(arch, ('silu',))}")
        num_heads = int(d["num_attention_heads"])
        max_pos = int(d["max_position_embeddings"])
        gemma, granite = arch == "gemma3_text", arch == "granitemoehybrid"
        if granite:
            d["intermediate_size"] = d["shared_intermediate_size"]  # the dense (shared) MLP
        rope_theta, rope_scaling, local_theta = _parse_rope(config, max_pos, gemma)
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
            qk_norm=arch in ("qwen3", "gemma3_text"),
            hidden_act=act,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=_merge_ids(d.get("eos_token_id"), gen.get("eos_token_id")),
            layer_types=_layer_types(arch, d),
            sliding_window=int(d["sliding_window"]) if gemma else None,
            query_pre_attn_scalar=float(d["query_pre_attn_scalar"]) if gemma else None,
            local_rope_theta=local_theta,
            final_logit_softcapping=(None if d.get("final_logit_softcapping") is None
                                     else float(d["final_logit_softcapping"])),
            **(granite_fields(d) if granite else {}),
        )


def _architecture(config: dict[str, Any]) -> str:
    arch = config.get("model_type")
    if arch is None:
        classes = config.get("architectures") or []
        arch = _ARCH_BY_CLASS.get(classes[0], classes[0]) if classes else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    return str(arch)


def _layer_types(arch: str, d: dict[str, Any]) -> tuple[str, ...]:
    """Each layer's attention type. Gemma 3 configs written before `layer_types` existed give a
    pattern instead: every `sliding_window_pattern`-th layer is full attention."""
    n = int(d["num_hidden_layers"])
    types = tuple(_LAYER_TYPE_ALIASES.get(t, t) for t in d.get("layer_types") or ())
    if arch == "granitemoehybrid":
        return types or (MAMBA,) * n
    if arch == "gemma3_text":
        if d.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 does not set it)")
        if not types:
            pattern = int(d["sliding_window_pattern"])
            types = tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                          for i in range(n))
        return types
    if d.get("use_sliding_window") or SLIDING_ATTENTION in types:
        raise ValueError(
            f"{arch} config uses sliding-window attention, which kvport supports for Gemma 3 only")
    return ()


def _merge_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Union of token ids given as int, list or None, in first-seen order."""
    ids: dict[int, None] = {}
    for v in values:
        for i in [v] if isinstance(v, int) else (v or []):
            ids[int(i)] = None
    return tuple(ids)


def _parse_rope(config: dict[str, Any], max_pos: int, gemma: bool = False,
                ) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling) of full-attention layers and, for Gemma 3, the plain-RoPE theta of its
    sliding layers (`rope_parameters` per layer type, or transformers 4's `rope_local_base_freq`)."""
    params = config.get("rope_parameters")
    local_theta = None
    if gemma:
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
        if params is not None and FULL_ATTENTION in params:
            local = params.get(SLIDING_ATTENTION) or local
            params = params[FULL_ATTENTION]
        if (local.get("rope_type") or local.get("type") or "default") != "default":
            raise ValueError(f"sliding layers' RoPE must be plain (default), got {local}")
        local_theta = float(local.get("rope_theta") or 10_000.0)
        if params is None:
            params = {**(config.get("rope_scaling") or {}),
                      "rope_theta": config.get("rope_theta", 1_000_000.0)}
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
        return theta, None, local_theta
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
    scaling = RopeScaling(
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
    return theta, scaling, local_theta
