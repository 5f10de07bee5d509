"""vLLM's KV cache groups as kvport's: which layer each slot of a pool block holds per group, each
group's sliding window, and kvport's layer index of every vLLM layer name.

With one group (every non-hybrid model, or vLLM's hybrid allocator off) a block holds every
layer, in the group's order. With several (a hybrid model, a SupportsHMA connector) vLLM gives
every group the same page size: each KV cache tensor is shared by one layer of every group, and a
block belongs to one group at a time (vLLM 0.32 gives each group a tensor of its layers, and
the groups' tensors overlay the same bytes). kvport's pool view then has one slot per page
address, and slot s of a block of group g holds the layer of g whose page is at address s:

    slots               0                     1
    group 0 (sliding)   layers.0              layers.1
    group 1 (sliding)   layers.3              layers.4
    group 2 (full)      layers.2              layers.5

Duck-typed (nothing here imports vLLM), so the mapping is tested without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvport.connectors.base import KVCacheGroupSpec

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class VllmGroups:
    slot_layers: tuple[str, ...]  # per slot, a layer whose tensor it is (the pool view's)
    layer_index: dict[str, int]  # every vLLM layer name -> kvport's layer index
    groups: tuple[KVCacheGroupSpec, ...]  # () with one group: kvport's layout without groups
    block_size: int

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))


def vllm_groups(kv_cache_config: Any, where: str) -> VllmGroups:
    """kvport's view of vLLM's KV cache groups. ValueError for what kvport cannot offload: groups
    of different block sizes, state-space (Mamba) groups, layers not laid out one per tensor."""
    groups = kv_cache_config.kv_cache_groups
    for g in groups:
        spec = g.kv_cache_spec
        if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
            # kvport's engine offloads state groups (docs/offloading.md); vLLM 0.32's CPU build
            # keeps a Mamba state at block boundaries only with prefix caching on, which stops
            # its engine for prompts longer than a block (docs/vllm.md). Checked first: without
            # prefix caching a Mamba group's block size differs too.
            raise ValueError(
                f"{where}: KV cache group of {type(spec).__name__} (layers "
                f"{list(g.layer_names)[:2]}...): state-space and other non-attention groups "
                f"are not offloaded inside vLLM 0.32 (its CPU build keeps no Mamba state at "
                f"block boundaries without prefix caching, and stops with it on prompts past "
                f"one block); run the model without a kvport connector")
    block_sizes = sorted({g.kv_cache_spec.block_size for g in groups})
    if len(block_sizes) != 1:
        raise ValueError(f"{where}: KV cache groups with block sizes {block_sizes}; kvport "
                         f"offloads groups of one block size")
    if len(groups) == 1:
        names = tuple(groups[0].layer_names)
        return VllmGroups(names, {n: i for i, n in enumerate(names)}, (), block_sizes[0])
    names = [n for g in groups for n in g.layer_names]
    layer_index = {n: i for i, n in enumerate(sorted(names, key=_layer_number))}
    address = _page_addresses(kv_cache_config.kv_cache_tensors, where)
    missing = [n for n in names if n not in address]
    if missing:
        raise ValueError(f"{where}: layers {missing[:3]} are in no KV cache tensor")
    slots = sorted({address[n] for n in names})
    slot_of = {a: s for s, a in enumerate(slots)}
    specs = []
    for g in groups:
        by_slot = sorted(g.layer_names, key=lambda n: address[n])
        if [slot_of[address[n]] for n in by_slot] != list(range(len(by_slot))):
            raise ValueError(f"{where}: the layers of a KV cache group ({by_slot[:3]}...) do "
                             f"not lie in the pool's first pages one each; this layout is not "
                             f"supported")
        specs.append(KVCacheGroupSpec(tuple(layer_index[n] for n in by_slot),
                                      getattr(g.kv_cache_spec, "sliding_window", None)))
    slot_layers = tuple(next(n for n in names if address[n] == a) for a in slots)
    return VllmGroups(slot_layers, layer_index, tuple(specs), block_sizes[0])


def _page_addresses(tensors: Any, where: str) -> dict[str, int]:
    """Each layer's first page, as an offset into the KV cache allocation. vLLM 0.32 gives each
    group a tensor of its layers (`layers`, `layer_stride`, `block_stride`, `offset`), and the
    groups' tensors overlay the same bytes: layer l of every group is one slot. kvport needs
    them to agree on the strides (one block = the same pages in every group)."""
    strides = {(t.layer_stride, t.block_stride) for t in tensors}
    if len(strides) != 1:
        raise ValueError(f"{where}: KV cache tensors with different strides {sorted(strides)}; "
                         f"this layout is not supported")
    return {name: t.offset + i * t.layer_stride for t in tensors
            for i, name in enumerate(t.layers)}


def _layer_number(name: str) -> tuple[int, str]:
    """Model order: the first number in the name (model.layers.12.self_attn.attn), then the
    name."""
    match = _LAYER_NUMBER.search(name)
    return (int(match.group(1)) if match else -1, name)
