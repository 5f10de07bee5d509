from __future__ import annotations

import pytest

from kvport.model.config import ModelConfig, RopeScaling

LLAMA = {
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
}
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}


def test_llama_defaults() -> None:
    c = ModelConfig.from_hf(LLAMA)
    assert c.architecture == "llama"
    assert c.head_dim == 16  # hidden_size / num_attention_heads when head_dim is absent
    assert (c.rope_theta, c.rope_scaling) == (10000.0, None)
    assert not (c.tie_word_embeddings or c.attention_bias or c.mlp_bias or c.qk_norm)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert c.q_size == 64 and c.kv_size == 32


def test_transformers4_and_5_rope_spellings_agree() -> None:
    v4 = {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE}}
    v4_old_key = {**LLAMA, "rope_theta": 500000.0,
                  "rope_scaling": {"type": "llama3", **LLAMA3_ROPE}}
    v5 = {**LLAMA,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE}}
    configs = [ModelConfig.from_hf(c) for c in (v4, v4_old_key, v5)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope_theta == 500000.0
    assert configs[0].rope_scaling == RopeScaling(
        "llama3", 8.0, 512, low_freq_factor=1.0, high_freq_factor=4.0)


def test_yarn_defaults_follow_transformers() -> None:
    # No original length: it is max_position_embeddings. No factor: max / original.
    c = ModelConfig.from_hf({**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert c.rope_scaling is not None and c.rope_scaling.original_max_position_embeddings == 4096
    c = ModelConfig.from_hf({**LLAMA, "original_max_position_embeddings": 1024,
                             "rope_scaling": {"type": "yarn"}})
    assert c.rope_scaling is not None and c.rope_scaling.factor == 4.0


def test_eos_ids_merge_config_and_generation_config() -> None:
    c = ModelConfig.from_hf({**LLAMA, "eos_token_id": [2, 7]},
                            {"eos_token_id": [7, 9], "bos_token_id": 1})
    assert c.eos_token_ids == (2, 7, 9)
    qwen = {k: v for k, v in LLAMA.items() if "token" not in k and k != "model_type"}
    c = ModelConfig.from_hf({"model_type": "qwen2", **qwen}, {"eos_token_id": 5})
    assert c.eos_token_ids == (5,) and c.bos_token_id is None


def test_qwen_variants() -> None:
    base = {k: v for k, v in LLAMA.items() if k != "model_type"}
    q2 = ModelConfig.from_hf({**base, "model_type": "qwen2"})
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm
    q3 = ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert q3.architecture == "qwen3" and q3.qk_norm and not q3.attention_bias and q3.head_dim == 32


GEMMA3 = {k: v for k, v in LLAMA.items() if k not in ("model_type", "rms_norm_eps")}


def test_gemma3_both_config_spellings_agree() -> None:
    # transformers 4: a pattern and two RoPE bases; transformers 5: layer types and RoPE per type.
    v4 = {**GEMMA3, "model_type": "gemma3_text", "num_hidden_layers": 6,
          "sliding_window_pattern": 3, "sliding_window": 32, "rope_theta": 1e6,
          "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
          "query_pre_attn_scalar": 16}
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    v5 = {**{k: v for k, v in v4.items() if k not in (
        "sliding_window_pattern", "rope_theta", "rope_local_base_freq", "rope_scaling")},
        "architectures": ["Gemma3ForCausalLM"], "layer_types": types, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    a, b = ModelConfig.from_hf(v4), ModelConfig.from_hf({**v5, "model_type": None})
    assert a == b
    assert a.architecture == "gemma3_text" and a.layer_types == tuple(types) and a.is_hybrid
    assert (a.rope_theta, a.local_rope_theta) == (1e6, 1e4)
    assert a.rope_scaling is not None and a.rope_scaling.factor == 8.0
    assert [a.layer_window(i) for i in range(6)] == [32, 32, None] * 2
    assert a.qk_norm and a.tie_word_embeddings and a.query_pre_attn_scalar == 16
    assert a.hidden_act == "gelu_pytorch_tanh" and a.rms_norm_eps == 1e-6
    assert not ModelConfig.from_hf(LLAMA).is_hybrid


@pytest.mark.parametrize("bad, words", [
    ({"model_type": "mistral"}, ["'mistral'", "llama", "qwen2", "qwen3"]),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, ["'longrope'", "yarn", "llama3"]),
    ({"hidden_act": "gelu"}, ["'gelu'", "silu"]),
    ({"rope_scaling": {"type": "linear"}}, ["factor"]),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, ["low_freq_factor"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads=3"]),
    ({"model_type": "qwen2", "use_sliding_window": True}, ["sliding"]),
    ({"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"]},
     ["sliding", "Gemma 3"]),
    ({"model_type": "gemma3_text", "hidden_activation": "silu"}, ["'silu'", "gelu_pytorch_tanh"]),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, ["attn_logit_softcapping"]),
    ({"model_type": "gemma3_text", "layer_types": ["full_attention"]}, ["names 1 layers"]),
    ({"model_type": "gemma3_text", "layer_types": ["conv", "full_attention"]}, ["'conv'"]),
    ({"model_type": "gemma3_text", "layer_types": ["mamba", "full_attention"]},
     ["Mamba layers and a Mamba config"]),
    ({"model_type": "gemma3_text", "sliding_window": 0}, ["sliding_window >= 1"]),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     ["plain"]),
])
def test_unsupported_values_name_themselves(bad: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf({**LLAMA, **bad})
    for word in words:
        assert word in str(info.value)
