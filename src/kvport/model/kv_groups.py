"""KV cache groups: which layers share a block table, the way vLLM's hybrid allocator forms them.

Layers of one attention type (full, or sliding with one window) need the same blocks at the same
times, so they share a block table. vLLM gives every group the same number of layers, so that a
block is the same number of bytes in every group and all groups draw from one pool; kvport does
the same, and forms the groups by vLLM's rule, so a trace recorded in either engine names the same
groups:

    layer types   s s f s s f          (s: sliding window, f: full attention)
    by type       s: 0 1 3 4           f: 2 5
    group size    2 (the smallest type's count; the largest's if it is under 1.5x that)
    groups        g0 = s(0, 3)   g1 = s(1, 4)   g2 = f(2, 5)     a type's layers dealt round-robin

State-space layers (Mamba2) form groups of their own type: a block of such a group holds, per
layer slot, the layer's recurrent state after the block's last computed token, instead of K/V per
token (kvport.model.state_cache). The state at a block boundary is the block's state, so such a
group needs the same blocks as a sliding window of 2 tokens: the block of the token before the
next one (`held_window`).

A type whose count is not a multiple of the group size leaves the last of its groups short; that
group's unused slot in a block is padding (vLLM pads the same way). A model of one type has one
group of every layer, in order: the single-group layout of every non-hybrid model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvport.model.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table: slot i of a block of this group holds layer_ids[i]."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None  # None: full attention (or a state group)
    state: bool = False  # state-space layers: a block holds each layer's state, not K/V

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("a KV cache group needs at least one layer")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")
        if self.state and self.sliding_window is not None:
            raise ValueError("a state group has no sliding window")

    @property
    def held_window(self) -> int | None:
        """Tokens, ending with the next one to compute, whose blocks the group still reads: a
        sliding group its window, a state group 2 (the state the previous token left lives in
        that token's block); None: every block (full attention)."""
        return STATE_WINDOW if self.state else self.sliding_window


STATE_WINDOW = 2  # see KVCacheGroup.held_window


def kv_cache_groups(config: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """The model's groups, in vLLM's order (types by their first layer)."""
    by_type: dict[tuple[int | None, bool], list[int]] = {}
    for layer in range(config.num_hidden_layers):
        key = (config.layer_window(layer), config.is_state_layer(layer))
        by_type.setdefault(key, []).append(layer)
    counts = [len(layers) for layers in by_type.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups = []
    for (window, state), layers in by_type.items():
        num_groups = -(-len(layers) // size)
        groups += [KVCacheGroup(tuple(layers[i::num_groups]), window, state)
                   for i in range(num_groups)]
    return tuple(groups)


def slots_per_block(groups: tuple[KVCacheGroup, ...]) -> int:
    """Layer slots in one pool block: the largest group's layer count."""
    return max(len(g.layer_ids) for g in groups)


def layer_slots(groups: tuple[KVCacheGroup, ...], num_layers: int) -> tuple[tuple[int, int], ...]:
    """Per model layer, (its group, its slot in that group's blocks)."""
    where: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layer_ids):
            assert layer not in where, f"layer {layer} is in two groups"
            where[layer] = (g, slot)
    missing = sorted(set(range(num_layers)) - set(where))
    assert not missing, f"layers {missing} are in no group"
    return tuple(where[layer] for layer in range(num_layers))
