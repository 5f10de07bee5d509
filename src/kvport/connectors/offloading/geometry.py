"""The offload geometry: how offload blocks lie over the engine's pool and the host tier's slots,
and the namespace of the tiers below host memory. Built once per half from (config, KVCacheSpec)
by `OffloadGeometry.build`, so the scheduler half and the worker half cannot disagree about it.
Every index conversion between tokens, engine blocks, offload blocks and host rows is here.

An offload block is `block_factor` (f) engine blocks: `offload_tokens = f * block_size` tokens,
`slot_bytes = f * engine block bytes` in a host slot. Its key is the chained hash of its last
engine block, which identifies the whole prefix up to it (`keys`).

                    offload block 0      offload block 1      offload block 2       (f = 4)
    tokens          |<- offload_tokens ->|
    engine blocks   b0   b1   b2   b3   b4   b5   b6   b7   b8   b9   b10  b11
    keys                           k0                  k1                  k2
    local hit       ==========                                  (num_local = 2 blocks' tokens)
    load            start = 0, skip = 2: copies b2 b3 | b4 .. b7 | b8 .. b11
    host rows       slot s holds rows s*f .. s*f + f-1 (one per engine block)

A load whose first offload block is partly covered by the engine's own prefix hit skips the
first `skip` engine blocks of it (`load_start`); every later offload block is whole. A store
always copies whole offload blocks.

KV cache groups (a hybrid model, f = 1): every group has its own block table over the same token
positions, and its own keys: block i of group g is keyed by hash i and g (`group_keys`), so a
group's blocks are stored, found and evicted on their own. A host slot holds one engine block of
any group (groups have equal pages). A hit at boundary k (the first k blocks) needs, per group:

    full attention    blocks 0 .. k-1                     (all of them)
    sliding window W  blocks k-n .. k-1, n = ceil((W-1)/b) (those the window reads; `window_range`)
    state             block k-1                           (the state at the boundary; a window
                                                           of W = 2 in all that follows)

            0    1    2    3    4    5    6    7         k = 6, W = 33, b = 16: n = 2
    full    k0   k1   k2   k3   k4   k5 | k6   k7
    sliding  .    .    .    .   s4   s5 | s6   s7        only s4 and s5 are loaded

So a sliding block is worth storing only if it lies in the window before a boundary a hit may use
(`worth_storing`): the end of the request's prompt (a repeat, the next turn of a chat), every
block after it (decode: the next turn may extend any of it), the junction where its prompt met a
stored prefix (group_hits.py: the next prompt with that prefix hits there), and every
`sliding_interval` blocks (a shared prefix hits at the last one inside it before it becomes a
junction). With an interval of one block every sliding block is stored. A state group is stored
by the same rule, with its own default interval (`STATE_STORE_INTERVAL`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvport.connectors.base import KVCacheGroupSpec, KVCacheSpec
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.mediums import DISK, REDIS

# The namespace's format: v2 names run files (v1, one file per entry, is not read).
NAMESPACE_VERSION = "kvport-disk-v2"


@dataclass(frozen=True)
class OffloadGeometry:
    block_size: int  # engine block, tokens
    block_factor: int  # f: engine blocks per offload block
    slot_bytes: int  # one offload block (f engine blocks, every layer, K and V)
    num_slots: int  # host tier capacity, offload blocks
    # The disk and Redis tiers' namespace: model, dtype, layout, sizes, the config's namespace.
    namespace: bytes
    lower_media: tuple[str, ...]  # the tiers below host, top down (DISK, REDIS)
    # Per KV cache group, its sliding window in tokens (None: full attention); (None,): one group.
    group_windows: tuple[int | None, ...] = (None,)
    sliding_interval: int = 1  # offload blocks between boundaries a sliding group stores for

    @classmethod
    def build(cls, config: OffloadingConfig, spec: KVCacheSpec) -> OffloadGeometry:
        f = block_factor(config, spec.block_size)
        # A state group needs the block before a boundary, as a 2-token window would.
        windows = tuple(g.held_window for g in spec.groups) or (None,)
        if len(windows) > 1 and f != 1:
            raise ValueError(f"OffloadingConnector: block_size={config.block_size} with "
                             f"{len(windows)} KV cache groups; a hybrid model offloads blocks "
                             f"of the engine's block_size={spec.block_size}")
        slot_bytes = f * spec.block_bytes
        num_slots = config.cpu_bytes_to_use // slot_bytes
        if num_slots < 1:
            raise ValueError(f"OffloadingConnector: cpu_bytes_to_use={config.cpu_bytes_to_use} is "
                             f"smaller than one offload block ({slot_bytes} bytes)")
        namespace = tier_namespace(spec.hash_root, spec, f * spec.block_size)
        if len(windows) > 1:  # which layers a group's block holds fixes its bytes
            namespace += b"|groups=" + ";".join(
                f"{'state' if g.state else g.sliding_window or 'full'}:"
                f"{','.join(map(str, g.layer_ids))}"
                for g in spec.groups).encode()
        if config.namespace is not None:  # the user's name for what may share entries
            namespace += b"|namespace=" + config.namespace.encode()
        media = tuple(m for m, tier in ((DISK, config.disk_tier), (REDIS, config.redis_tier))
                      if tier is not None)
        return cls(spec.block_size, f, slot_bytes, num_slots, namespace, media, windows,
                   sliding_interval(config.sliding_store_interval, spec.groups, spec.block_size))

    @property
    def offload_tokens(self) -> int:
        """Tokens per offload block."""
        return self.block_factor * self.block_size

    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        return offload_keys(block_hashes, self.block_factor)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def sliding_groups(self) -> tuple[int, ...]:
        return tuple(g for g, w in enumerate(self.group_windows) if w is not None)

    def group_keys(self, block_hashes: Sequence[bytes]) -> tuple[list[bytes], ...]:
        """Per group, the keys of its full offload blocks: with one group the keys themselves,
        else each with its group's index (the engine's own prefix cache keys them so too)."""
        keys = self.keys(block_hashes)
        if len(self.group_windows) == 1:
            return (keys,)
        return tuple([group_key(k, g) for k in keys] for g in range(len(self.group_windows)))

    def window_blocks(self, group: int) -> int | None:
        """Blocks of a sliding group a hit needs before its boundary (those holding the W - 1
        tokens the window reads back); None for a full-attention group (all of them)."""
        window = self.group_windows[group]
        return None if window is None else -(-(window - 1) // self.block_size)

    def window_range(self, group: int, start: int, k: int) -> range:
        """The group's blocks a hit at boundary k loads, past a local hit of `start` blocks."""
        need = self.window_blocks(group)
        return range(start if need is None else max(start, k - need), k)

    def first_held(self, group: int, num_computed: int) -> int:
        """The group's first block the engine still holds for a request that computed
        `num_computed` tokens (a sliding window frees the blocks before what its next token
        reads back to; the engine's rule, vLLM's too)."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def worth_storing(self, group: int, i: int, num_prompt_tokens: int,
                      junction: int | None = None) -> bool:
        """Whether block i of the group may serve a hit (module docstring): always for a full
        group; for a sliding one, if it is in the window before the prompt's last hit boundary,
        any later boundary, the `junction` where the prompt met a stored prefix, or one every
        `sliding_interval` blocks."""
        need = self.window_blocks(group)
        if need is None:
            return True
        if need == 0:
            return False  # a window of one token reads no earlier block
        last = i + need  # the last boundary whose window holds block i
        if last >= self.max_hit_blocks(num_prompt_tokens):
            return True
        if junction is not None and i < junction <= last:
            return True
        return last // self.sliding_interval * self.sliding_interval >= i + 1

    def num_offload_blocks(self, num_tokens: int) -> int:
        """Offload blocks wholly inside the first `num_tokens` tokens."""
        return num_tokens // self.offload_tokens

    def max_hit_blocks(self, num_tokens: int) -> int:
        """Offload blocks a hit of an `num_tokens`-token request may cover: the forward computes
        at least the last token (its logits give the next token), as the engine's own prefix
        cache does."""
        return (num_tokens - 1) // self.offload_tokens

    def hit_tokens(self, num_local: int, start: int, end: int) -> int:
        """Tokens a hit of offload blocks [start, end) adds beyond a local hit of `num_local`
        tokens (which may end inside block `start`)."""
        return end * self.offload_tokens - num_local

    def skip(self, num_local: int, start: int) -> int:
        """Engine blocks of offload block `start` (a hit's first) that a local hit of `num_local`
        tokens covers: a load does not copy them."""
        return num_local // self.block_size - start * self.block_factor

    def hit_blocks(self, num_local: int, start: int, end: int) -> slice:
        """The engine blocks of offload blocks [start, end), as a slice of the block table, but
        for those a local hit of `num_local` tokens covers."""
        f = self.block_factor
        return slice(max(num_local // self.block_size, start * f), end * f)

    def whole_blocks(self, num_engine_blocks: int) -> int:
        """Offload blocks wholly inside the first `num_engine_blocks` engine blocks."""
        return num_engine_blocks // self.block_factor

    def engine_span(self, block_ids: Sequence[int], start: int, end: int) -> list[int]:
        """The engine blocks of offload blocks [start, end) in a block table."""
        f = self.block_factor
        return list(block_ids[start * f:end * f])

    def blocks_of(self, block_ids: Sequence[int], j: int, skip: int, n: int = 1) -> list[int]:
        """The engine blocks of offload blocks j .. j+n-1 of a load's destination (`block_ids`,
        whose first offload block skips its first `skip` engine blocks)."""
        return blocks_of(block_ids, j, self.block_factor, skip, n)


def group_key(key: bytes, group: int) -> bytes:
    """The key of a block of `group` (several groups): its hash and the group's index."""
    return key + group.to_bytes(4, "little")


def offload_keys(block_hashes: Sequence[bytes], f: int) -> list[bytes]:
    """Keys of the full offload blocks of f engine blocks: the chained hash of each one's last
    engine block (which identifies the whole prefix up to it)."""
    return list(block_hashes[f - 1::f])


def blocks_of(block_ids: Sequence[int], j: int, f: int, skip: int, n: int = 1) -> list[int]:
    """`OffloadGeometry.blocks_of` for a factor f."""
    return list(block_ids[max(0, j * f - skip):(j + n) * f - skip])


def slot_rows(slot_ids: Sequence[int], f: int) -> list[int]:
    """The host rows of these slots, f per slot (f = 1: the slot ids themselves)."""
    return list(slot_ids) if f == 1 else [s * f + k for s in slot_ids for k in range(f)]


def block_factor(config: OffloadingConfig, engine_block_size: int) -> int:
    """Engine blocks per offload block (f). The default is 1: keys, hits and stores at the
    engine's own granularity, so no token the engine's block could supply is recomputed (a
    request's last full engine block is stored and hit too). A configured block_size must be a
    whole number of engine blocks."""
    if config.block_size is None:
        return 1
    if config.block_size % engine_block_size:
        raise ValueError(f"OffloadingConnector: block_size={config.block_size} is not a multiple "
                         f"of the engine's block_size={engine_block_size}")
    return config.block_size // engine_block_size


def sliding_interval(tokens: int | None, groups: Sequence[KVCacheGroupSpec],
                     block_size: int) -> int:
    """`sliding_store_interval` in offload blocks: None is four of the largest window, or
    `STATE_STORE_INTERVAL` tokens where a group holds states if that is more; 0 is every block;
    rounded up to whole blocks."""
    if tokens is None:
        largest = max((g.sliding_window or 0 for g in groups), default=0)
        tokens = max(4 * largest, STATE_STORE_INTERVAL if any(g.state for g in groups) else 0)
    return max(1, -(-tokens // block_size))


# A state group's block is as many bytes as any group's, and one boundary's state serves only a
# hit at that boundary: stored every block, a state group would store as much as a full group;
# every 256 tokens it stores 1/16 of that at 16-token blocks, and a shared prefix recomputes at
# most 256 tokens (the request that meets a stored prefix stores the state there, the junction).
STATE_STORE_INTERVAL = 256


def tier_namespace(root_hash: bytes, spec: KVCacheSpec, offload_block_size: int) -> bytes:
    """The namespace of the tiers below host memory: the engine's hash root (model, dtype, block
    size, layout) plus the pool geometry and offload block size, which fix the payload's byte
    layout."""
    fields = [root_hash.hex(), spec.dtype, spec.layout, str(spec.block_size), str(spec.num_layers),
              str(spec.num_kv_heads), str(spec.head_dim), str(offload_block_size)]
    return "|".join([NAMESPACE_VERSION, *fields]).encode()
