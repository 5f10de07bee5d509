"""Shared test factories: small random Hugging Face checkpoints, logits of both implementations.

Import as `from hf_models import make_random_hf_model` (pyproject puts tests/ on pytest's path).
transformers is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvport.model.attention import DenseAttention
from kvport.model.byte_tokenizer import write_byte_tokenizer
from kvport.model.llama import LlamaForCausalLM

# Small enough to build and run in well under a second, large enough to exercise GQA and RoPE.
BASE_DIMS: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
}
ARCHS = ("llama", "qwen2", "qwen3", "gemma3_text")
# Gemma 3: two layers, one of each type, with a window shorter than most test prompts.
GEMMA3_DIMS: dict[str, Any] = {
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
}


def make_random_hf_model(
    tmp_path: Path, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None,
    add_bos: bool | None = None, **overrides: Any,
) -> Path:
    """Write a random `arch` checkpoint (transformers' own classes and save_pretrained) plus a byte
    tokenizer to `tmp_path / name`; returns that directory.

    Every parameter is re-drawn with O(1) scale (norm weights near 1, non-zero biases), so logits
    differ enough between implementations for a comparison to mean something. `overrides` go to the
    transformers config (e.g. tie_word_embeddings=True, rope_parameters={...}); `max_shard_size`
    (e.g. "100KB") writes a sharded checkpoint with an index. `add_bos` defaults to Llama-style
    (BOS) for llama and Qwen-style (none) otherwise.
    """
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                  "gemma3_text": Gemma3TextConfig}[arch]
    dims = dict(BASE_DIMS)
    if arch == "qwen2":
        dims.pop("head_dim")  # Qwen2 derives it from hidden_size / num_attention_heads
    if arch == "gemma3_text":
        dims.update(GEMMA3_DIMS)
    config = config_cls(**{**dims, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)
    tag = hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8]
    out = tmp_path / f"{arch}-{seed}-{tag}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    if add_bos is None:
        add_bos = arch == "llama"
    write_byte_tokenizer(out, config.vocab_size, add_bos=add_bos)
    return out


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch ops on one thread. The test models are small enough that a second thread buys
    little, and on a busy machine two OpenMP threads waiting on each other are 10-100x slower."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def sample_prompts(
    seed: int, lengths: tuple[int, ...] = (7, 19, 33), vocab: int = 256
) -> list[list[int]]:
    """Random token ids below `vocab` (default: plain bytes, no specials), one prompt per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def dense_greedy(model: LlamaForCausalLM, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by recomputing the whole sequence each token (no KV cache), each
    layer seeing its own window: the reference a builtin's engine output is checked against."""
    ids = list(ids)
    windows = [model.config.layer_window(i) for i in range(model.config.num_hidden_layers)]
    with torch.inference_mode(), single_thread():
        for _ in range(num_tokens):
            n = len(ids)
            hidden = model(torch.tensor(ids), torch.arange(n),
                           DenseAttention([n], model.attention_scale, windows))
            ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids[-num_tokens:]


def kvport_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run all prompts in one flattened batch (laid end to end); per prompt (len, vocab) float32."""
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    windows = [model.config.layer_window(i) for i in range(model.config.num_hidden_layers)]
    attn = DenseAttention([len(p) for p in prompts], model.attention_scale, windows)
    with torch.inference_mode(), single_thread():
        logits = model.compute_logits(model(ids, positions, attn))  # (sum(lens), vocab)
    return list(logits.split([len(p) for p in prompts]))


def hf_logits(
    model_dir: Path, prompts: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """transformers' logits for each prompt run alone (batch of one): (len, vocab) float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    with torch.inference_mode(), single_thread():
        return [model(torch.tensor([p])).logits[0].float() for p in prompts]
