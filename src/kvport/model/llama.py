"""Llama-family decoder (Llama, Qwen2, Qwen3) over flattened tokens.

There is no batch dimension: the engine lays all scheduled tokens of all requests end to end
(T tokens) and the `AttentionContext` knows which tokens belong together. Everything else in a
decoder layer is per token, so it needs no sequence boundaries.

Differences between the three families, all driven by `ModelConfig`:
- Qwen2: bias on q/k/v (not on o_proj).
- Qwen3: RMSNorm over head_dim on q and k (per head) before RoPE.
- Llama: optional `attention_bias` (q/k/v/o) and `mlp_bias`.

q/k/v and gate/up are fused into one Linear each (one GEMM instead of three or two, which matters on
the CPU); `load_weights` accepts the separate Hugging Face tensors and copies each into its rows.
`pack_weights` then prepacks every projection and the logits head for oneDNN (kvport.model.linear).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from kvport.model.attention import AttentionContext
from kvport.model.config import ModelConfig
from kvport.model.linear import PackedLinear, onednn_available, pack_linears, try_pack
from kvport.model.rope import RotaryEmbedding, rope_tables, rotate


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    # Weights are overwritten by load_weights: skip the (slow, for large models) random init.
    return skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32, scale in the model dtype (the order HF checkpoints expect).
        # torch's fused rms_norm is one op instead of six (29 against 42 us at 8 rows), bit for
        # bit transformers' result; in half precision the scale stays outside, after rounding.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        h = config.hidden_size
        self.qkv_proj = _linear(h, self.q_size + 2 * self.kv_size, config.attention_bias, dtype)
        self.o_proj = _linear(self.q_size, h, config.o_proj_bias, dtype)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
        attn: AttentionContext, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        else:  # one rotation over q and k heads together: half the small ops of two
            qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            if cos is not None and sin is not None:  # None: no positions (Granite 4's "nope")
                qk = rotate(qk, cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if rows is None:
            o = attn.attend(self.layer_idx, q, k, v)  # (T, num_heads, head_dim)
        else:
            o = attn.attend_rows(self.layer_idx, q[rows], k, v)  # (len(rows), num_heads, head_dim)
        return self.o_proj(o.reshape(o.shape[0], self.q_size))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.hidden_act -> the function
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = _linear(h, 2 * i, config.mlp_bias, dtype)
        self.down_proj = _linear(i, h, config.mlp_bias, dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn, rows)
        x = (x if rows is None else x[rows]) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # What a variant of the family replaces (gemma3.py)
    layer_cls: ClassVar[type[nn.Module]] = DecoderLayer
    norm_cls: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            None if config.tie_word_embeddings
            else _linear(config.hidden_size, config.vocab_size, False, dtype)
        )
        # A packed copy of the tied embedding for the logits (pack_weights): the embedding itself
        # stays row-major for the token lookups.
        self.tied_head: PackedLinear | None = None
        self.rotary = RotaryEmbedding(config)
        self.attention_scale = config.head_dim ** -0.5
        self.requires_grad_(False)  # inference only: no autograd graph, in-place loads allowed

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) int64 -> hidden states (T, hidden_size), final norm applied.

        With `output_rows` (the last token of each sequence that needs logits), only those rows
        come out, and the last layer computes attention and MLP for them alone: its output for
        other tokens feeds nothing (their K/V, which later steps need, are still stored)."""
        cos, sin = rope_tables(*self.rotary.cos_sin(positions, self.dtype))  # (T, 1, head_dim)
        x = self.embed_tokens(input_ids)  # (T, hidden)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, output_rows if i == last else None)
        return self.norm(x)

    @property
    def device(self) -> torch.device:
        """Where the weights are (the engine runs its pool and sampler there too)."""
        return self.embed_tokens.weight.device

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab_size) float32."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.tied_head is not None:
            return self.tied_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def pack_weights(self) -> None:
        """Prepack the projections and the logits head for oneDNN, once, after load_weights
        (a batch-8 SmolLM2 decode step: 131 -> 67 ms; kvport.model.linear). The unpacked
        weights are dropped, the embedding kept; without oneDNN, or for weights off the CPU
        (the packed layouts are CPU kernels'), nothing changes."""
        if (not onednn_available() or self.tied_head is not None
                or self.device.type != "cpu"):
            return
        pack_linears(self)
        if self.lm_head is None:
            # Tied: one more copy of the embedding, 113 MB for SmolLM2 in float32, for a head
            # that ran 3.3x faster at 8 rows (5.7 against 19 ms).
            self.tied_head = try_pack(self.embed_tokens.weight)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (converting dtype); every parameter must be set."""
        params = dict(self.named_parameters())
        expected = {(n, b) for n in params for b in self._blocks(n)}  # (param, row block) to fill
        for hf_name, tensor in weights:
            target = self._target(hf_name)
            if target is None:
                continue
            name, block = target
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in this model ({name!r})")
            dst = params[name] if block is None else self._rows(params[name], name, block)
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            expected.discard((name, block))
        if expected:
            missing = sorted(f"{n}[{b}]" if b else n for n, b in expected)
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    # --- weight-name mapping -------------------------------------------------------------------

    # HF projection -> (fused parameter, row block)
    _FUSED: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def _target(self, hf_name: str) -> tuple[str, str | None] | None:
        """HF name -> (our parameter name, row block of a fused parameter or None); None: skip."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None  # a buffer some old checkpoints carry; we compute our own
        if hf_name == "lm_head.weight":
            # Tied checkpoints sometimes still store the (identical) head: the embedding wins.
            return None if self.lm_head is None else ("lm_head.weight", None)
        name = hf_name.removeprefix("model.")
        parts = name.split(".")
        if len(parts) >= 5 and parts[0] == "layers" and parts[3] in self._FUSED:
            fused, block = self._FUSED[parts[3]]
            return ".".join([*parts[:3], fused, *parts[4:]]), block
        return name, None

    def _blocks(self, name: str) -> tuple[str | None, ...]:
        if "qkv_proj" in name:
            return ("q", "k", "v")
        if "gate_up_proj" in name:
            return ("gate", "up")
        return (None,)

    def _rows(self, param: torch.Tensor, name: str, block: str) -> torch.Tensor:
        c = self.config
        if "qkv_proj" in name:
            spans = {"q": (0, c.q_size), "k": (c.q_size, c.kv_size),
                     "v": (c.q_size + c.kv_size, c.kv_size)}
        else:
            i = c.intermediate_size
            spans = {"gate": (0, i), "up": (i, i)}
        start, length = spans[block]
        return param.narrow(0, start, length)
