"""ExampleConnector with KV cache groups: which tokens of an entry each layer holds, where they
lie in the pool, the group layout's part of the entry's key, and the transfer record (per group
a span of tokens and its pool blocks) that the scheduler half hands the worker half.

Without groups (`KVCacheSpec.groups == ()`: a model of one group, or a caller that is not
SupportsHMA) every layer holds every aligned token, and a pool block holds layer i in slot i.
With groups, a layer holds what its group's block table holds at the entry's aligned end
(`num_tokens`): a full-attention group every aligned block; a sliding-window group only the
blocks that the window of the token at `num_tokens` reads, since the engine has freed the blocks
before them (and holds the null block there); a state group the block before `num_tokens`,
whose layer slots hold the states there (moved whole: every token row of the slot). A hit at
that end reads exactly those blocks, so an entry holds what a load needs, and never a block that
a table could not supply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvport.connectors.base import KVCacheGroupSpec, KVCacheSpec


@dataclass(frozen=True)
class GroupSpan:
    """One KV cache group's part of a transfer: tokens [start_token, the entry's end) of its
    layers <-> the pool blocks `block_ids`, one per block of those tokens."""

    start_token: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class EntryTransfer:
    """Entry `key` (its first `num_tokens` tokens) <-> pool blocks: per KV cache group (one
    without groups), the tokens [span.start_token, num_tokens) of the group's layers and their
    blocks. A store starts at token 0, or at a sliding group's window start."""

    req_id: str
    key: str
    num_tokens: int
    spans: tuple[GroupSpan, ...]

    @property
    def start_token(self) -> int:
        """The first token any layer moves (without groups: the one span's start)."""
        return min(span.start_token for span in self.spans)

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Every pool block the transfer reads or writes, group by group."""
        return tuple(b for span in self.spans for b in span.block_ids)


def layer_index(name: str) -> int:
    """The index of a layer named by kvport.connectors.base.layer_name ("layers.<i>")."""
    return int(name.rsplit(".", 1)[1])


@dataclass(frozen=True)
class EntryLayout:
    """The KV cache groups an entry is stored and loaded by (`()`: one group of every layer)."""

    groups: tuple[KVCacheGroupSpec, ...] = ()

    @classmethod
    def of(cls, spec: KVCacheSpec) -> EntryLayout:
        return cls(spec.groups)

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))

    def key_tag(self) -> bytes:
        """What the entry key adds for this layout: nothing without groups (keys as they always
        were), else every group's window and layers. An entry's layer files hold different
        tokens under another layout, so another layout must never find it."""
        if not self.groups:
            return b""
        return b"|kv-cache-groups=" + ";".join(
            f"{'state' if g.state else 'full' if g.sliding_window is None else g.sliding_window}:"
            f"{','.join(map(str, g.layer_ids))}" for g in self.groups).encode()

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer: whose block table it follows, where a pool block holds it."""
        for g, group in enumerate(self.groups):
            if layer in group.layer_ids:
                return g, group.layer_ids.index(layer)
        if self.groups:
            raise ValueError(f"ExampleConnector: layer {layer} is in no KV cache group")
        return 0, layer

    def first_block(self, group: int, num_tokens: int, block_size: int) -> int:
        """The first block of `group` that the token at position `num_tokens` reads: 0 for full
        attention; for a sliding window W, the block of token num_tokens - W + 1; for a state
        group the block before (its state at the boundary: the whole block, as W = 2 reads it).
        The engine frees the blocks before it (kvport: KVCacheManager.first_needed_block)."""
        window = self.groups[group].held_window if self.groups else None
        if window is None:
            return 0
        return max(0, num_tokens - window + 1) // block_size

    def spans(self, tables: Sequence[Sequence[int]], num_tokens: int, start_token: int,
              block_size: int) -> tuple[GroupSpan, ...]:
        """Per group, the tokens a transfer of [start_token, num_tokens) moves and their blocks
        from the group's table (indexed by block position): from the later of `start_token`
        (a store: 0; a load: the end of the local prefix hit) and the group's window start.
        Both ends are block-aligned."""
        if len(tables) != self.num_groups:
            raise ValueError(f"ExampleConnector: {len(tables)} block tables for "
                             f"{self.num_groups} KV cache group(s)")
        end = num_tokens // block_size
        out = []
        for g, table in enumerate(tables):
            first = max(start_token // block_size, self.first_block(g, num_tokens, block_size))
            if len(table) < end:
                raise ValueError(f"ExampleConnector: group {g}'s {len(table)} blocks cannot hold "
                                 f"{num_tokens} tokens")
            out.append(GroupSpan(first * block_size, tuple(table[first:end])))
        return tuple(out)

    def layer_tokens(self, num_layers: int, num_tokens: int, block_size: int) -> list[int]:
        """Tokens each layer's file of an entry of `num_tokens` tokens holds (its last ones)."""
        return [num_tokens - self.first_block(self.place(i)[0], num_tokens, block_size)
                * block_size for i in range(num_layers)]
