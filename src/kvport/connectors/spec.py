"""What a connector is told about the engine's KV pool and the engine itself: `KVCacheSpec`
(geometry, dtype, layout, the hash root, the KV cache groups) and `EngineInfo` (the engine's
habits a connector decides its behaviour from). Plain frozen records: both halves get them, and
they cross process boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class EngineInfo:
    """What a connector needs to know of the engine that drives it, beyond the calls it gets.
    kvport's engine: the defaults. vLLM: what kvport.vllm reads from its configuration."""

    # Tensor parallelism: every worker holds its shard of every block (its heads), and the
    # scheduler half gets each worker's answer (worker metadata) for every step.
    tp_size: int = 1
    tp_rank: int = 0
    # The engine may stop stepping as soon as no request is unfinished (vLLM's in-process LLM):
    # work a step plans must be done within that step, no later step is promised.
    stops_when_idle: bool = False
    # A synchronous load whose blocks failed keeps them in the engine's prefix cache until the
    # request recomputes them (vLLM 0.32): such a load must not fail for being slow.
    caches_failed_sync_loads: bool = False
    # A failed load is taken per request, not per block (vLLM 0.32 with several KV cache
    # groups): the engine recomputes or fails the whole request, and cannot take the failure of
    # a synchronous load (so every load must be asynchronous).
    load_failures_per_request: bool = False
    # Someone reads the connector's KV cache events (kvport's engine: LLM.take_kv_events; vLLM:
    # only with KV events enabled): without a reader a connector need not describe its blocks.
    kv_events: bool = True


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group (kvport.model.kv_groups): slot i of its blocks holds layer_ids[i]."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None  # None: full attention (or a state group)
    # State-space layers: a block holds each layer's recurrent state after the block's last
    # computed token (the state at the boundary after a full block), not K/V per token.
    state: bool = False

    @property
    def held_window(self) -> int | None:
        """Tokens, ending with the next one to compute, whose blocks the group reads: a sliding
        group's window, 2 for a state group (the previous token's block), None for full."""
        return 2 if self.state else self.sliding_window


@dataclass(frozen=True)
class KVCacheSpec:
    """What a worker needs to know about the engine's pool (see kvport.model.attention)."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str  # "blocks-layers-kv-tokens-heads-dim": one block is one contiguous run of bytes
    # The engine's block-hash root (model identity, dtype, block size, layout): block hashes
    # are chained from it, and a connector's persistent store is namespaced by it.
    hash_root: bytes = b""
    engine: EngineInfo = field(default_factory=EngineInfo)
    # The KV cache groups, each with its own block tables (a SupportsHMA connector's view of a
    # hybrid model); empty: one group of every layer, layer i in slot i.
    groups: tuple[KVCacheGroupSpec, ...] = ()

    @property
    def num_slots(self) -> int:
        """Layers one pool block holds: every layer with one group, a group's with several."""
        return max((len(g.layer_ids) for g in self.groups), default=self.num_layers)

    def layer_slot(self, layer_idx: int) -> int:
        """The slot of the pool's blocks that holds this layer's K and V."""
        for group in self.groups:
            if layer_idx in group.layer_ids:
                return group.layer_ids.index(layer_idx)
        assert not self.groups, f"layer {layer_idx} is in no KV cache group"
        return layer_idx

    @property
    def block_bytes(self) -> int:
        """Bytes of one engine block: K and V of every layer it holds."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return (self.num_slots * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * itemsize)
