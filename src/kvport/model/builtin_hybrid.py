"""Small hybrid checkpoints with random weights, laid out by transformers' own model classes.

No model hub is reachable from the test machines, so the hybrid models that tests and benchmarks
run are written here: the config is a transformers config object (so every field a loader reads
has transformers' meaning and spelling), the tensor names and shapes come from instantiating the
transformers model class on the meta device, and the values come from integer draws of a seeded
generator (the same bytes on every machine, see `uniform`). The tokenizer is the builtins' byte
tokenizer.

- `tiny-gemma3`: Gemma 3's text model (`Gemma3ForCausalLM`), 6 layers in Gemma 3's pattern
  shrunk: two sliding-window layers then one full-attention layer, twice. The window (48 tokens)
  is smaller than the prompts tests use, so a sliding-window layer really forgets.
- `small-gemma3`: the same architecture in Gemma 3 270M's shape (18 layers of 640, five sliding
  layers of window 512 to each full one, one 256-wide KV head) with the byte vocabulary: about
  100M parameters, 400 MB in float32. For benchmarks, where a model's compute against the KV it
  moves decides what a hit saves; tests use tiny-gemma3.
- `small-granite4`: the same in a larger shape (12 layers of 512, ten Mamba2 to two attention
  layers, states of 69k values per layer: blocks of at least 270 tokens), about 40M parameters,
  for benchmarks.
- `tiny-granite4`: Granite 4's hybrid (`GraniteMoeHybridForCausalLM`, dense: no experts), 4 layers:
  Mamba2 state-space layers next to full-attention layers without positions (Granite 4's "nope"),
  with Granite's embedding, residual, attention and logits multipliers set away from 1 so that
  each is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvport.model.byte_tokenizer import write_byte_tokenizer
from kvport.model.weights_init import uniform

GEMMA3_SEED = 4321
GEMMA3_DIMS: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "query_pre_attn_scalar": 32, "sliding_window": 48, "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
}
BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID = 256, 257, 258

# Bounds of the uniform init; projections' are divided by sqrt(fan_in). Gemma's RMSNorm scales
# by (1 + weight), so norm weights are drawn around 0; q_norm and k_norm around 2, which makes q.k
# about 9 times larger than unit-variance vectors give: sharp, content-dependent attention, so
# greedy continuations depend on the context (the reason is tiny-llama's, see builtin.py). Gemma
# multiplies the embedding by sqrt(hidden_size): a bound of 1/sqrt(hidden_size) keeps it at the
# scale of what the layers add, where a larger one makes every continuation a repeated token.
_PROJ_BOUND = {"q_proj": 3.0, "k_proj": 3.0, "v_proj": 2.0, "o_proj": 2.0,
               "gate_proj": 1.7, "up_proj": 1.7, "down_proj": 1.7}
_QK_NORM_CENTER, _NORM_BOUND = 2.0, 0.2
# The head is the embedding (tied): rows of bytes other than printable ASCII and newline are
# scaled down so decoded outputs read as (random) text; the others stay possible but rare.
_OTHER_ROW_SCALE = 0.5


SMALL_GEMMA3_DIMS: dict[str, Any] = {
    **GEMMA3_DIMS, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}


def gemma3_config(dims: dict[str, Any] = GEMMA3_DIMS) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **dims, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False,
        bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID, pad_token_id=BYTE_PAD_ID,
        architectures=["Gemma3ForCausalLM"], dtype="float32",
    )


def gemma3_weights(config: Any, seed: int = GEMMA3_SEED) -> dict[str, torch.Tensor]:
    """Every tensor of `Gemma3ForCausalLM(config)` (the tied head once, as the embedding)."""
    from transformers import Gemma3ForCausalLM

    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in sorted(shapes):  # drawn in name order: independent of the class's module order
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shape = shapes[name]
        leaf = name.split(".")[-2]  # the module that owns the tensor
        if name.endswith("embed_tokens.weight"):
            out[name] = _embedding(gen, shape)
        elif leaf in ("q_norm", "k_norm"):
            out[name] = _QK_NORM_CENTER + uniform(gen, shape, _NORM_BOUND)
        elif "norm" in leaf:
            out[name] = uniform(gen, shape, _NORM_BOUND)
        elif leaf in _PROJ_BOUND:
            out[name] = uniform(gen, shape, _PROJ_BOUND[leaf] / shape[1] ** 0.5)
        else:
            raise AssertionError(f"no init rule for Gemma 3 tensor {name!r}")
    return out


GRANITE4_SEED = 8765
GRANITE4_DIMS: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 128, "intermediate_size": 256,
    "shared_intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "layer_types": ["mamba", "attention"] * 2,
    # One Mamba2 layer's state (conv 3 x 144 + ssm 4 x 32 x 8 = 1456 values) fits one layer slot
    # of a block of 12 tokens or more (2 x 2 x 32 = 128 values per token).
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_expand": 1, "mamba_d_state": 8,
    "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 64,
    "embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25,
    "logits_scaling": 2.0,
}
# Granite 4 at a size where compute, not per-request overhead, decides a repeat's time (for
# benchmarks): ten Mamba2 layers to two attention layers, as Granite 4's H models mix them. A
# layer's state (3 x 1152 + 16 x 64 x 64 = 68992 values) needs blocks of 270 tokens or more at
# 256 values per token: the benchmarks use 272 (vLLM enlarges its attention block the same way).
SMALL_GRANITE4_DIMS: dict[str, Any] = {
    **GRANITE4_DIMS, "hidden_size": 512, "shared_intermediate_size": 1536,
    "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 2,
    "layer_types": (["mamba"] * 5 + ["attention"]) * 2,
    "mamba_n_heads": 16, "mamba_d_head": 64, "mamba_expand": 2, "mamba_d_state": 64,
    "mamba_chunk_size": 256, "attention_multiplier": 0.125,
}
# Mamba2 parameters: dt = softplus(raw + dt_bias) around 0.3-0.7 and A = -exp(A_log) in -1..-4, so
# a head's state decays over a few to a few dozen tokens: long enough that outputs depend on the
# state carried across blocks (what a state hit must restore), short enough to stay bounded.
_GRANITE_PROJ_BOUND = {"q_proj": 3.0, "k_proj": 3.0, "v_proj": 2.0, "o_proj": 2.0,
                       "in_proj": 1.7, "out_proj": 1.7, "input_linear": 1.7,
                       "output_linear": 1.7, "lm_head": 4.0}


def granite4_config(dims: dict[str, Any] = GRANITE4_DIMS) -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **dims, hidden_act="silu", rms_norm_eps=1e-6, num_local_experts=0,
        tie_word_embeddings=False, attention_bias=False, position_embedding_type=None,
        bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID, pad_token_id=BYTE_PAD_ID,
        architectures=["GraniteMoeHybridForCausalLM"], dtype="float32",
    )


def granite4_weights(config: Any, seed: int = GRANITE4_SEED) -> dict[str, torch.Tensor]:
    """Every tensor of `GraniteMoeHybridForCausalLM(config)`."""
    from transformers import GraniteMoeHybridForCausalLM

    with torch.device("meta"):
        model = GraniteMoeHybridForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf, kind = name.split(".")[-2], name.split(".")[-1]
        if name.endswith("embed_tokens.weight"):
            out[name] = _embedding(gen, shape)
        elif kind == "dt_bias":
            out[name] = -0.5 + uniform(gen, shape, 0.3)
        elif kind == "A_log":
            out[name] = 0.7 + uniform(gen, shape, 0.7)
        elif kind == "D":
            out[name] = 1.0 + uniform(gen, shape, 0.2)
        elif leaf == "conv1d":
            out[name] = uniform(gen, shape, 0.5 if kind == "weight" else 0.1)
        elif "norm" in leaf:
            out[name] = 1.0 + uniform(gen, shape, _NORM_BOUND)
        elif leaf in _GRANITE_PROJ_BOUND:
            out[name] = uniform(gen, shape, _GRANITE_PROJ_BOUND[leaf] / shape[1] ** 0.5)
            if leaf == "lm_head":  # decoded outputs read as (random) text, as tiny-gemma3's
                out[name][~_printable(shape[0])] *= _OTHER_ROW_SCALE
        else:
            raise AssertionError(f"no init rule for Granite 4 tensor {name!r}")
    return out


def write_tiny_granite4(out_dir: Path) -> None:
    config = granite4_config()
    _write_checkpoint(out_dir, config, granite4_weights(config))


def write_small_granite4(out_dir: Path) -> None:
    config = granite4_config(SMALL_GRANITE4_DIMS)
    _write_checkpoint(out_dir, config, granite4_weights(config))


def _embedding(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    vocab, hidden = shape
    table = uniform(gen, shape, hidden ** -0.5)
    table[~_printable(vocab)] *= _OTHER_ROW_SCALE
    return table


def _printable(vocab: int) -> torch.Tensor:
    """(vocab,) bool: the byte tokens of printable ASCII and newline."""
    printable = torch.zeros(vocab, dtype=torch.bool)
    printable[0x20:0x7F] = True
    printable[0x0A] = True
    return printable


def write_tiny_gemma3(out_dir: Path) -> None:
    config = gemma3_config()
    _write_checkpoint(out_dir, config, gemma3_weights(config))


def write_small_gemma3(out_dir: Path) -> None:
    config = gemma3_config(SMALL_GEMMA3_DIMS)
    _write_checkpoint(out_dir, config, gemma3_weights(config))


def _write_checkpoint(out_dir: Path, config: Any, weights: dict[str, torch.Tensor]) -> None:
    """config.json, generation_config.json, model.safetensors and the byte tokenizer."""
    # The config as a plain dict without the writer's version, so the directory's bytes do not
    # depend on the transformers version that wrote it.
    fields = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    _write_json(out_dir / "config.json", fields)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BYTE_BOS_ID, "eos_token_id": BYTE_EOS_ID, "pad_token_id": BYTE_PAD_ID})
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_byte_tokenizer(out_dir, config.vocab_size, add_bos=True,
                         model_max_length=config.max_position_embeddings)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
