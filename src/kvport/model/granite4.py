"""Granite 4's hybrid decoder (dense `GraniteMoeHybridForCausalLM`): Mamba2 layers next to
full-attention layers.

What differs from the Llama family (llama.py), all as transformers computes it:
- A layer mixes tokens with either Mamba2 (mamba2.py; its state in the pool, state_cache.py) or
  attention; attention has no positions by default ("nope": order comes from the Mamba layers)
  and scales scores by `attention_multiplier` instead of head_dim^-1/2.
- The embedding is multiplied by `embedding_multiplier`, each residual branch by
  `residual_multiplier`; the logits are divided by `logits_scaling`.
- The MLP is the "shared" one: its input projection is gate and up in one tensor, which is
  exactly the fused `gate_up_proj` (no experts: dense models only).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvport.model.attention import AttentionContext
from kvport.model.config import ModelConfig
from kvport.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from kvport.model.mamba2 import Mamba2Mixer, StateContext
from kvport.model.rope import rope_tables


class Granite4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: Attention | None = None
        if config.is_state_layer(layer_idx):
            assert config.mamba is not None, "a Mamba layer needs the model's Mamba config"
            self.mamba = Mamba2Mixer(config.mamba, h, eps, layer_idx, dtype)
        else:
            self.self_attn = Attention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.mlp = MLP(config, dtype)
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
        attn: AttentionContext, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.mamba is not None:
            assert isinstance(attn, StateContext), "a Mamba layer needs a state context"
            h = self.mamba(h, attn)  # every token: each one's state feeds the next
            h = h if rows is None else h[rows]
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, cos, sin, attn, rows)
        x = (x if rows is None else x[rows]) + h * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class Granite4ForCausalLM(LlamaForCausalLM):
    layer_cls = Granite4DecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        assert config.attention_multiplier is not None, "granite configs carry the multipliers"
        super().__init__(config, dtype)
        self.attention_scale = config.attention_multiplier
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `LlamaForCausalLM.forward`; `attn` must also be a `StateContext`."""
        cos = sin = None
        if self.config.use_rope:
            cos, sin = rope_tables(*self.rotary.cos_sin(positions, self.dtype))
        x = self.embed_tokens(input_ids) * self.config.embedding_multiplier
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, output_rows if i == last else None)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling

    # The shared MLP's tensors: input_linear is [gate; up] already, so it fills gate_up_proj whole.
    _SHARED_MLP: ClassVar[dict[str, str]] = {
        "shared_mlp.input_linear": "mlp.gate_up_proj", "shared_mlp.output_linear": "mlp.down_proj"}

    def _target(self, hf_name: str) -> tuple[str, str | None] | None:
        for theirs, ours in self._SHARED_MLP.items():
            hf_name = hf_name.replace(theirs, ours)
        return super()._target(hf_name)

    def _blocks(self, name: str) -> tuple[str | None, ...]:
        return (None,) if "gate_up_proj" in name else super()._blocks(name)
