"""kvport.vllm.groups on vLLM 0.32's layout of a hybrid model's KV cache groups, duck-typed (no
vLLM needed): each group a tensor of its layers, the groups' tensors overlaying the same bytes,
so layer l of every group is one slot of kvport's pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvport.connectors.base import KVCacheGroupSpec
from kvport.vllm.groups import vllm_groups


@dataclass
class Spec:
    block_size: int = 128
    num_kv_heads: int = 1
    head_size: int = 64
    sliding_window: int | None = None


@dataclass
class MambaSpec:
    block_size: int = 128


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: object


@dataclass
class Tensor:
    layers: list[str]
    layer_stride: int = 1 << 20
    block_stride: int = 4096
    offset: int = 0
    size: int = 2 << 20


@dataclass
class Config:
    kv_cache_groups: list[Group]
    kv_cache_tensors: list[Tensor] = field(default_factory=list)


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def gemma3() -> Config:
    """tiny-gemma3 as vLLM 0.32 lays it out (printed from a real engine)."""
    groups = [[0, 3], [1, 4], [2, 5]]
    windows = [48, 48, None]
    return Config([Group([name(i) for i in g], Spec(sliding_window=w))
                   for g, w in zip(groups, windows)],
                  [Tensor([name(i) for i in g]) for g in groups])


def test_layer_l_of_every_group_is_slot_l() -> None:
    g = vllm_groups(gemma3(), "test")
    assert g.slot_layers == (name(0), name(3))
    assert g.layer_index == {name(i): i for i in range(6)}
    assert g.groups == (KVCacheGroupSpec((0, 3), 48), KVCacheGroupSpec((1, 4), 48),
                        KVCacheGroupSpec((2, 5), None))
    assert g.num_groups == 3 and g.block_size == 128


def test_one_group_keeps_the_layout_without_groups() -> None:
    names = [name(i) for i in range(4)]
    g = vllm_groups(Config([Group(names, Spec())]), "test")
    assert g.groups == () and g.num_groups == 1 and g.slot_layers == tuple(names)


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c.kv_cache_groups[2], "kv_cache_spec", MambaSpec()), "state-space"),
    # Without prefix caching vLLM gives a Mamba group its own block size: still named as such.
    (lambda c: setattr(c.kv_cache_groups[2], "kv_cache_spec", MambaSpec(2048)), "MambaSpec"),
    (lambda c: setattr(c, "kv_cache_groups", [Group([name(0)], MambaSpec())]), "MambaSpec"),
    (lambda c: setattr(c.kv_cache_groups[0].kv_cache_spec, "block_size", 64), "block sizes"),
    (lambda c: setattr(c.kv_cache_tensors[1], "layer_stride", 1 << 21), "strides"),
    (lambda c: c.kv_cache_tensors.pop(), "in no KV cache tensor"),
    (lambda c: setattr(c.kv_cache_tensors[0], "offset", 1 << 20), "one each"),
])
def test_layouts_kvport_cannot_offload_are_named(change: object, message: str) -> None:
    config = gemma3()
    change(config)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        vllm_groups(config, "test")
