"""KV cache groups formed by vLLM's rule (the cross-check against vLLM itself is in
tests/vllm/test_vllm_groups.py)."""

from __future__ import annotations

import dataclasses

import pytest

from kvport.model.config import FULL_ATTENTION as F
from kvport.model.config import SLIDING_ATTENTION as S
from kvport.model.config import ModelConfig
from kvport.model.kv_groups import KVCacheGroup, kv_cache_groups, layer_slots, slots_per_block

BASE = ModelConfig.from_hf({
    "model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
})


def config(types: list[str], window: int = 16) -> ModelConfig:
    return dataclasses.replace(BASE, num_hidden_layers=len(types), layer_types=tuple(types),
                               sliding_window=window)


def test_one_type_is_one_group_of_every_layer() -> None:
    assert kv_cache_groups(BASE) == (KVCacheGroup((0, 1, 2, 3), None),)
    assert kv_cache_groups(config([S] * 3)) == (KVCacheGroup((0, 1, 2), 16),)


def test_tiny_gemma3_pattern() -> None:
    groups = kv_cache_groups(config([S, S, F, S, S, F], window=48))
    assert groups == (KVCacheGroup((0, 3), 48), KVCacheGroup((1, 4), 48),
                      KVCacheGroup((2, 5), None))
    assert slots_per_block(groups) == 2
    assert layer_slots(groups, 6) == ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1))


def test_five_to_one_makes_groups_of_one_layer() -> None:
    groups = kv_cache_groups(config([S] * 5 + [F]))
    assert [g.layer_ids for g in groups] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert [g.sliding_window for g in groups] == [16] * 5 + [None]


def test_near_equal_counts_pad_the_smaller_type() -> None:
    # 12 sliding + 13 full (gpt-oss-20b with a drafter): groups of 13, the sliding one short.
    groups = kv_cache_groups(config([S, F] * 12 + [F]))
    assert [len(g.layer_ids) for g in groups] == [12, 13]
    assert slots_per_block(groups) == 13


def test_bad_groups_name_the_value() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        KVCacheGroup((), None)
    with pytest.raises(ValueError, match="got 0"):
        KVCacheGroup((0,), 0)


def test_a_state_group_has_no_window() -> None:
    from kvport.model.kv_groups import KVCacheGroup

    assert KVCacheGroup((0, 2), None, state=True).held_window == 2
    with pytest.raises(ValueError, match="no sliding window"):
        KVCacheGroup((0, 2), 48, state=True)
