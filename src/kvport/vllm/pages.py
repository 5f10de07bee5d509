"""What a page of vLLM's KV cache holds, as kvport reads it: the layout vLLM resolved for the pool,
and the page geometry kvport's KVCacheSpec gets from vLLM's KV cache spec.

kvport's connectors move whole pages as bytes; what matters is that kvport's geometry covers
every byte of a page exactly once. vLLM's AttentionSpec (0.32, 0.33 and 0.34 alike,
vllm/v1/kv_cache_interface.py) sizes a page as

    page_size_bytes = page_size_padded, if set, else
                      num_heads x num_states x state_content_size_bytes
    num_heads = num_head_slots or num_kv_heads
    num_states = block_size // tokens_per_state
    state_content_size_bytes = state_content_bytes or (head_size + head_size_v) x itemsize

kvport handles the plain product: one slot per KV head, one state per token, dense content,
no padding, so a page is `num_kv_heads x block_size x (head_size + head_size_v)` elements and
kvport describes it as K and V halves of `(head_size + head_size_v) / 2` each. That covers
full and sliding-window attention (head_size_v == head_size) and MLA (one latent vector per
token, head_size_v == 0: the latent's two halves stand in for K and V, bytes unchanged).
Refused, with a ValueError naming the spec: padded pages (page_size_padded: DeepSeek V4's
aligned MLA pages, hybrid models' equalized pages), packed head slots (num_head_slots), packed
content (state_content_bytes), compressed or pooled states (tokens_per_state != 1), and KV
quantization other than per-tensor fp8 (per-token-head scales, nvfp4, turboquant, ultraquant:
scales or packing that a byte copy of the page does not describe).

Duck-typed (nothing here imports vLLM), so it is tested with vLLM's spec classes and without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# KVQuantMode names whose page is the plain product of its dtype: unquantized, or fp8 with one
# scale per layer (the layer's, not the page's: a page's bytes are the whole KV).
PLAIN_QUANT_MODES = ("NONE", "FP8_PER_TENSOR")
HANDLED = ("full and sliding-window attention, MLA (head_size_v == 0), unquantized or fp8 "
           "per-tensor KV, pages of num_kv_heads x block_size x (head_size + head_size_v) "
           "elements")


@dataclass(frozen=True)
class PageGeometry:
    """kvport's description of one layer's page: K and V of `head_dim` per head and token."""

    num_kv_heads: int
    head_dim: int
    dtype: str  # a torch dtype name ("float32")


def page_geometry(spec: Any, where: str) -> PageGeometry:
    """kvport's geometry of one page of `spec` (a vLLM AttentionSpec), or a ValueError that
    names the spec, what about it is not handled, and what is (the module docstring)."""
    name = type(spec).__name__
    problems = []
    if getattr(spec, "page_size_padded", None) is not None:
        problems.append(f"padded pages (page_size_padded={spec.page_size_padded})")
    if getattr(spec, "num_head_slots", None) is not None:
        problems.append(f"packed head slots (num_head_slots={spec.num_head_slots})")
    if getattr(spec, "state_content_bytes", None) is not None:
        problems.append(f"packed content (state_content_bytes={spec.state_content_bytes})")
    if getattr(spec, "tokens_per_state", 1) != 1:
        problems.append(f"{spec.tokens_per_state} tokens per stored state")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant not in PLAIN_QUANT_MODES:
        problems.append(f"KV quantization {quant} (scales or packing beyond the page's dtype)")
    head_size = int(spec.head_size)
    head_size_v = int(getattr(spec, "head_size_v", head_size))
    per_token = head_size + head_size_v
    if per_token % 2:  # kvport's pool describes a page as K and V halves
        problems.append(f"an odd per-token size (head_size {head_size} + head_size_v "
                        f"{head_size_v})")
    dtype = str(spec.dtype).removeprefix("torch.")
    if not problems:
        plain = int(spec.num_kv_heads) * int(spec.block_size) * per_token * spec.dtype.itemsize
        if spec.page_size_bytes != plain:
            problems.append(f"pages of {spec.page_size_bytes} bytes, not the {plain} of "
                            f"num_kv_heads x block_size x (head_size + head_size_v) x itemsize")
    if problems:
        raise ValueError(f"{where}: vLLM's KV cache spec {name} (head_size={head_size}, "
                         f"head_size_v={head_size_v}, dtype={dtype}) has {'; '.join(problems)}; "
                         f"kvport offloads whole pages as bytes and handles {HANDLED}")
    return PageGeometry(int(spec.num_kv_heads), per_token // 2, dtype)


def resolved_layout(vllm_config: Any, kv_cache_config: Any, where: str) -> str:
    """The KV cache layout vLLM resolved for this engine (a KVCacheLayout name, "LBHNC").
    vLLM 0.32-0.34's engine core resolves it once, before memory profiling and before any
    connector is built, and records it on cache_config.kv_cache_layout and on every
    KVCacheConfig (vllm/v1/engine/core.py, resolve_kv_cache_layout). ValueError if neither
    holds one: a connector built outside vLLM's engine must set it as the engine core does."""
    for layout in (getattr(kv_cache_config, "kv_cache_layout", None),
                   getattr(vllm_config.cache_config, "kv_cache_layout", None)):
        if layout:
            return str(layout)
    raise ValueError(f"{where}: vLLM has not resolved the KV cache layout (KVCacheConfig."
                     f"kv_cache_layout and cache_config.kv_cache_layout are None); the engine "
                     f"core resolves it before connectors are built: set it as it does, e.g. "
                     f"kv_cache_config.kv_cache_layout = \"LBHNC\" (vLLM's CPU backend)")
