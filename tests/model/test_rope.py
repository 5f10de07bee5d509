from __future__ import annotations

from typing import Any

import pytest
import torch

from kvport.model.config import ModelConfig
from kvport.model.rope import RotaryEmbedding, apply_rope, dynamic_ntk_inv_freq

DIMS: dict[str, Any] = {
    "vocab_size": 100, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "max_position_embeddings": 2048,
}
ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
             "original_max_position_embeddings": 512},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16.0,
                    "mscale": 0.707, "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 256},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def _hf_cos_sin(rope: dict[str, Any], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaRotaryEmbedding(LlamaConfig(**DIMS, rope_parameters=dict(rope)))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])  # (1, T, head_dim)
    return cos[0], sin[0]


@pytest.mark.parametrize("name", sorted(ROPES))
def test_cos_sin_match_transformers(name: str) -> None:
    rope = ROPES[name]
    config = ModelConfig.from_hf({"model_type": "llama", **DIMS, "rope_parameters": dict(rope)})
    # Dynamic NTK equals plain RoPE inside the pretraining length, where it is comparable.
    positions = torch.arange(0, 2048 if name != "dynamic" else 2000, 7)
    cos, sin = RotaryEmbedding(config).cos_sin(positions, torch.float32)  # (T, head_dim / 2)
    hf_cos, hf_sin = _hf_cos_sin(rope, positions)
    torch.testing.assert_close(torch.cat([cos, cos], -1), hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([sin, sin], -1), hf_sin, rtol=0, atol=1e-6)


def test_tables_do_not_depend_on_growth() -> None:
    config = ModelConfig.from_hf({"model_type": "llama", **DIMS})
    grown = RotaryEmbedding(config)
    grown.cos_sin(torch.tensor([9000]), torch.float32)  # past max_position_embeddings: extends
    fresh_cos, _ = RotaryEmbedding(config).cos_sin(torch.arange(100), torch.float32)
    grown_cos, _ = grown.cos_sin(torch.arange(100), torch.float32)
    assert torch.equal(fresh_cos, grown_cos)


def test_dynamic_ntk_is_piecewise_beyond_pretraining_length() -> None:
    config = ModelConfig.from_hf(
        {"model_type": "llama", **DIMS, "rope_parameters": dict(ROPES["dynamic"])})
    rope = RotaryEmbedding(config)
    cos, _ = rope.cos_sin(torch.tensor([2047, 2048, 4000]), torch.float32)
    plain = RotaryEmbedding(ModelConfig.from_hf({"model_type": "llama", **DIMS}))
    assert torch.equal(cos[0], plain.cos_sin(torch.tensor([2047]), torch.float32)[0][0])
    long_freq = dynamic_ntk_inv_freq(config, 4096)  # scaled for factor * original length
    expected = (torch.tensor([2048.0, 4000.0])[:, None] * long_freq).cos()
    torch.testing.assert_close(cos[1:], expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_rotate_half(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = ModelConfig.from_hf({"model_type": "llama", **DIMS})
    positions = torch.tensor([0, 1, 5, 300, 2047])
    cos, sin = RotaryEmbedding(config).cos_sin(positions, dtype)
    q = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    k = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    full_cos, full_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin)  # (1, H, T, D)
    assert torch.equal(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1))
