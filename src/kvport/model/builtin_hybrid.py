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


def gemma3_config() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **GEMMA3_DIMS, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
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


def _embedding(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    vocab, hidden = shape
    table = uniform(gen, shape, hidden ** -0.5)
    printable = torch.zeros(vocab, dtype=torch.bool)
    printable[0x20:0x7F] = True
    printable[0x0A] = True
    table[~printable] *= _OTHER_ROW_SCALE
    return table


def write_tiny_gemma3(out_dir: Path) -> None:
    config = gemma3_config()
    # The config as a plain dict without the writer's version, so the directory's bytes do not
    # depend on the transformers version that wrote it.
    fields = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    _write_json(out_dir / "config.json", fields)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BYTE_BOS_ID, "eos_token_id": BYTE_EOS_ID, "pad_token_id": BYTE_PAD_ID})
    save_file(gemma3_weights(config), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    write_byte_tokenizer(out_dir, GEMMA3_DIMS["vocab_size"], add_bos=True,
                         model_max_length=GEMMA3_DIMS["max_position_embeddings"])


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
