"""Granite 4's configuration beyond the Llama family's (`GraniteMoeHybridConfig` keys): the
Mamba2 layers' shape and the multipliers, read by `ModelConfig.from_hf` (config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba2 layer's shape (Granite 4's `mamba_*` keys). Its state per request: the last
    `d_conv - 1` inputs of the convolution and an (n_heads, d_head, d_state) SSM state."""

    n_heads: int
    d_head: int
    d_state: int
    n_groups: int
    d_conv: int
    conv_bias: bool
    proj_bias: bool
    dt_min: float  # softplus(dt) is clamped to [dt_min, dt_max] (`time_step_limit`)
    dt_max: float

    @property
    def intermediate_size(self) -> int:
        return self.n_heads * self.d_head

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def state_numel(self) -> int:
        """Values of one layer's state: the convolution's window, then the SSM state."""
        return (self.d_conv - 1) * self.conv_dim + self.n_heads * self.d_head * self.d_state


def granite_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Granite 4's fields beyond the Llama family's (dense models: no experts)."""
    if int(d["num_local_experts"] or 0):
        raise ValueError(f"Granite 4 with experts (num_local_experts={d['num_local_experts']}) "
                         "is not supported; dense models (0 experts) are")
    rope = d.get("position_embedding_type")
    if rope not in (None, "nope", "rope"):
        raise ValueError(f"unsupported position_embedding_type {rope!r}; supported: None, 'rope'")
    heads = int(d["mamba_n_heads"])
    d_head = d["mamba_d_head"]
    d_head = int(d["mamba_expand"]) * int(d["hidden_size"]) // heads if d_head == "auto" else d_head
    lo, hi = d.get("time_step_limit") or (0.0, float("inf"))
    mamba = MambaConfig(
        n_heads=heads, d_head=int(d_head), d_state=int(d["mamba_d_state"]),
        n_groups=int(d["mamba_n_groups"]), d_conv=int(d["mamba_d_conv"]),
        conv_bias=bool(d["mamba_conv_bias"]), proj_bias=bool(d["mamba_proj_bias"]),
        dt_min=float(lo), dt_max=float(hi))
    if mamba.n_heads % mamba.n_groups:
        raise ValueError(f"mamba_n_heads={heads} is not a multiple of mamba_n_groups="
                         f"{mamba.n_groups}")
    return {"use_rope": rope == "rope", "mamba": mamba,
            "embedding_multiplier": float(d.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(d.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(d.get("attention_multiplier", 1.0)),
            "logits_scaling": float(d.get("logits_scaling", 1.0))}
