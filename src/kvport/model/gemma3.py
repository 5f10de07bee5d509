"""Gemma 3's text decoder: sliding-window layers next to full-attention layers.

What differs from the Llama family (llama.py), all as transformers' `Gemma3ForCausalLM` computes it:
- RMSNorm scales by (1 + weight), in float32; loading adds the 1 once (`GemmaRMSNorm`).
- Four norms per layer: before and after attention, before and after the MLP.
- The embedding is multiplied by sqrt(hidden_size) (rounded to the model dtype first).
- q and k are RMS-normed per head before RoPE; attention scales by query_pre_attn_scalar^-1/2.
- Sliding layers rotate with their own plain RoPE base (`local_rope_theta`); which keys a layer
  sees is the attention context's business (`ModelConfig.layer_window`).
- The MLP's activation is tanh-approximated GELU; the head is the embedding (tied); logits may be
  soft-capped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvport.model.attention import AttentionContext
from kvport.model.config import ModelConfig
from kvport.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from kvport.model.rope import RotaryEmbedding, rope_tables


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose stored weight is (1 + the checkpoint's), kept in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(dim, eps, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized and scaled in float32, then rounded once, as transformers does.
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_window(layer_idx) is not None
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = Attention(config, layer_idx, dtype, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = MLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn, rows)
        x = (x if rows is None else x[rows]) + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        if not config.tie_word_embeddings:
            raise ValueError("Gemma 3 checkpoints tie the head to the embedding; this config "
                             "does not (tie_word_embeddings=False)")
        assert config.query_pre_attn_scalar is not None and config.local_rope_theta is not None, \
            "gemma3_text configs carry the attention scalar and the local RoPE base"
        super().__init__(config, dtype)
        local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        self.local_rotary = RotaryEmbedding(local)
        self.attention_scale = config.query_pre_attn_scalar ** -0.5
        # A buffer, so that moving the model to a device moves it too.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5).to(dtype),
                             persistent=False)
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `LlamaForCausalLM.forward`; sliding and full layers rotate with their own tables."""
        full = rope_tables(*self.rotary.cos_sin(positions, self.dtype))
        local = rope_tables(*self.local_rotary.cos_sin(positions, self.dtype))
        x = self.embed_tokens(input_ids) * self.embed_scale
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos, sin = local if layer.is_sliding else full
            x = layer(x, cos, sin, attn, output_rows if i == last else None)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_gemma_norms(weights))


def _gemma_norms(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint norm weights w become the (1 + w) the norms multiply by."""
    for name, tensor in weights:
        yield name, (1.0 + tensor.float()) if name.endswith("norm.weight") else tensor
