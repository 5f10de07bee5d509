"""kvport.vllm.pages with vLLM's own KV cache spec classes, built directly (no engine): which pages
kvport offloads (full and sliding attention, MLA) and which it refuses by name (padded, packed,
quantized with scales); and the layout vLLM resolved, which names the disk namespace."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import pytest
import torch
from harness import kv_cache_config, vllm_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvport.vllm.groups import vllm_groups
from kvport.vllm.pages import PageGeometry, page_geometry, resolved_layout
from kvport.vllm.storage import kvport_spec

WHERE = "kvport.vllm OffloadingConnector"


@pytest.mark.parametrize(("spec", "geometry"), [
    (FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16),
     PageGeometry(3, 64, "bfloat16")),
    (SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32,
                       sliding_window=32), PageGeometry(2, 8, "float32")),
    # DeepSeek's MLA: one latent of 512 + 64 rope dims per token, no V
    (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
     PageGeometry(1, 288, "bfloat16")),
    (SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                          sliding_window=128), PageGeometry(1, 288, "bfloat16")),
    # K and V of different sizes: the page is still their sum per head and token
    (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=192, head_size_v=128,
                       dtype=torch.float16), PageGeometry(2, 160, "float16")),
    (FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                       kv_quant_mode=KVQuantMode.FP8_PER_TENSOR), PageGeometry(2, 64, "uint8")),
])
def test_plain_pages_are_described_byte_for_byte(spec: Any, geometry: PageGeometry) -> None:
    assert page_geometry(spec, WHERE) == geometry
    itemsize = getattr(torch, geometry.dtype).itemsize
    # kvport's K and V halves cover vLLM's page exactly
    kvport_page = 2 * spec.block_size * geometry.num_kv_heads * geometry.head_dim * itemsize
    assert kvport_page == spec.page_size_bytes


MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


@pytest.mark.parametrize(("spec", "message"), [
    # DeepSeek V4's aligned MLA pages
    (dataclasses.replace(MLA, alignment=4096),
     r"MLAAttentionSpec .*padded pages \(page_size_padded=20480\)"),
    (dataclasses.replace(FULL, page_size_padded=8192), r"padded pages"),
    (dataclasses.replace(FULL, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD, dtype=torch.int8),
     r"KV quantization INT8_PER_TOKEN_HEAD"),
    (dataclasses.replace(FULL, kv_quant_mode=KVQuantMode.NVFP4, dtype=torch.uint8),
     r"KV quantization NVFP4"),
    (dataclasses.replace(FULL, num_head_slots=4), r"packed head slots \(num_head_slots=4\)"),
    (dataclasses.replace(FULL, state_content_bytes=96), r"packed content"),
    (dataclasses.replace(MLA, tokens_per_state=4), r"4 tokens per stored state"),
    (dataclasses.replace(FULL, tokens_per_state=Fraction(1, 2)), r"1/2 tokens per stored state"),
    (dataclasses.replace(MLA, head_size=575), r"an odd per-token size \(head_size 575"),
])
def test_other_pages_are_refused_naming_the_spec_and_what_is_handled(spec: Any,
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        page_geometry(spec, WHERE)
    assert str(err.value).startswith(f"{WHERE}: vLLM's KV cache spec {type(spec).__name__}")
    assert "handles full and sliding-window attention, MLA (head_size_v == 0)" in str(err.value)


def test_a_page_that_is_not_the_plain_product_is_refused() -> None:
    """A spec whose page size disagrees with its fields (a subclass sizing pages its own way)."""

    class OddPages(FullAttentionSpec):
        @property
        def page_size_bytes(self) -> int:
            return 2 * super().page_size_bytes

    spec = OddPages(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"OddPages .*pages of 16384 bytes, not the 8192"):
        page_geometry(spec, WHERE)


# ---- the resolved layout ---------------------------------------------------------------------


def test_the_resolved_layout_is_read_from_vllms_configs() -> None:
    config, kcc = vllm_config({}), kv_cache_config(16)
    assert resolved_layout(config, kcc, WHERE) == "LBHNC"  # the KVCacheConfig's (harness)
    kcc.kv_cache_layout = None
    config.cache_config.kv_cache_layout = "BLHNC"
    assert resolved_layout(config, kcc, WHERE) == "BLHNC"  # else the cache config's
    config.cache_config.kv_cache_layout = None
    with pytest.raises(ValueError, match=r"vLLM has not resolved the KV cache layout .*"
                                         r"kv_cache_config.kv_cache_layout = \"LBHNC\""):
        resolved_layout(config, kcc, WHERE)


def _spec_with_layout(layout: str) -> Any:
    kcc = kv_cache_config(16)
    kcc.kv_cache_layout = layout
    return kvport_spec(vllm_config({}), kcc, vllm_groups(kcc, WHERE), 0, "tiny-llama-test", True,
                       WHERE)


def test_the_disk_namespace_names_the_resolved_layout() -> None:
    """Two engines whose pages are laid out differently never share stored entries."""
    lbhnc = _spec_with_layout("LBHNC")
    assert lbhnc.layout == "vllm-LBHNC|tp0of1"
    assert lbhnc.hash_root == _spec_with_layout("LBHNC").hash_root
    assert lbhnc.hash_root != _spec_with_layout("LBNHC").hash_root
    assert (lbhnc.num_kv_heads, lbhnc.head_dim, lbhnc.dtype) == (1, 8, "float32")


def test_groups_of_different_pages_are_refused() -> None:
    kcc = kv_cache_config(16)
    group = kcc.kv_cache_groups[0]
    spec: Any = group.kv_cache_spec
    other = dataclasses.replace(spec, num_kv_heads=2, head_size=4)
    kcc.kv_cache_groups = [dataclasses.replace(group, layer_names=group.layer_names[:1]),
                           dataclasses.replace(group, layer_names=group.layer_names[1:],
                                               kv_cache_spec=other)]
    groups: Any = type("Groups", (), {"num_groups": 2, "layer_index": {}, "groups": ()})()
    with pytest.raises(ValueError, match=r"KV cache groups with different pages"):
        kvport_spec(vllm_config({}), kcc, groups, 0, None, False, WHERE)
