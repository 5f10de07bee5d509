"""kvport forms KV cache groups exactly as vLLM's hybrid allocator does (the same layers in the
same groups, in the same order), so a trace names the same groups in both engines."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvport.model.config import FULL_ATTENTION as F
from kvport.model.config import SLIDING_ATTENTION as S
from kvport.model.config import ModelConfig
from kvport.model.kv_groups import kv_cache_groups

PATTERNS = {
    "tiny-gemma3": [S, S, F] * 2,
    "gemma3-5to1": ([S] * 5 + [F]) * 2 + [S, S],
    "gpt-oss-alternating": [S, F] * 4,
    "12sw-13full": [S, F] * 12 + [F],
    "full-first": [F, S, S, S, F, S, S, S],
}
BASE = ModelConfig.from_hf({
    "model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
})


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_groups_equal_vllms(name: str) -> None:
    types = PATTERNS[name]
    config = dataclasses.replace(BASE, num_hidden_layers=len(types), layer_types=tuple(types),
                                 sliding_window=32)
    common = {"block_size": 16, "num_kv_heads": 1, "head_size": 16, "dtype": torch.float32}
    specs = {f"model.layers.{i}.self_attn.attn": (
        SlidingWindowSpec(sliding_window=32, **common) if t == S else FullAttentionSpec(**common))
        for i, t in enumerate(types)}
    theirs = _get_kv_cache_groups_uniform_page_size(specs)
    ours = kv_cache_groups(config)
    assert [tuple(int(n.split(".")[2]) for n in g.layer_names) for g in theirs] == \
        [g.layer_ids for g in ours]
    assert [getattr(g.kv_cache_spec, "sliding_window", None) for g in theirs] == \
        [g.sliding_window for g in ours]
