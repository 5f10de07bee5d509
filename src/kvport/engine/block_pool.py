"""The engine's KV block pool: reference counts, an LRU free queue and the prefix cache.

Primitives:
    get_cached_block(hash)  the pool block holding the full block with this hash, if any.
    touch(blocks)           take a reference on cached blocks (prefix hits); a free one leaves
                            the free queue but keeps its contents.
    allocate(n)             n blocks from the head of the free queue; a block that held cached
                            contents is evicted from the prefix cache first.
    free(blocks)            drop one reference each; at zero the block goes to the tail of the
                            free queue and keeps its cached contents until it is reused.
    cache_block(block, h)   publish a full block under its hash.
    check_integrity()       recompute the accounting; RuntimeError on any mismatch.

A block is in exactly one of two states: in use (ref_cnt > 0, not in the free queue) or free
(ref_cnt == 0, in the free queue). Cached (hashed) blocks may be in either state.

With `reserve_null_block`, block 0 is the null block (vLLM's `null_block`): never allocated, never
cached, always in use. A sliding-window group's block table holds it where the window has moved
past (the block there was freed), so tables stay indexed by position.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvport.engine.hashing import BlockHash


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass
class BlockPoolCounters:
    num_evicted_blocks: int = 0  # cached blocks whose contents were dropped for reuse
    num_queried_blocks: int = 0
    num_hit_blocks: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block: KVBlock | None = None
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1  # in use for good: never in the free queue
        # block_id -> block; head = least recently freed = next to be reused
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null_block)
        self._cached: dict[BlockHash, KVBlock] = {}  # block_hash -> block holding it
        self.stats = BlockPoolCounters()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block. Pass a request's blocks tail first, so that its tail
        is reused before its prefix (prefixes are the likelier hits)."""
        for block in blocks:
            assert block is not self.null_block, "the null block is never freed"
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        # NOTE: if another block already holds this hash (two requests computed the same prefix
        # at once), this one stays unpublished: block tables never change under a request.
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache_block(self, block: KVBlock) -> None:
        """Withdraw one block from the prefix cache (its contents are not to be reused)."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use stay valid for their requests."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        assert self._cached.get(block.block_hash) is block, f"block {block.block_id} hash not indexed"
        del self._cached[block.block_hash]
        self.stats.num_evicted_blocks += 1
        block.block_hash = None

    def check_integrity(self) -> None:
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        negative = [b.block_id for b in self.blocks if b.ref_cnt < 0]
        free_ids = set(self._free)
        errors = []
        if negative:
            errors.append(f"negative ref_cnt on blocks {negative}")
        if len(free_ids) + len(in_use) != self.num_blocks:
            errors.append(f"free({len(free_ids)}) + in_use({len(in_use)}) != total({self.num_blocks})")
        both = [b.block_id for b in in_use if b.block_id in free_ids]
        if both:
            errors.append(f"blocks both in use and free: {both}")
        for h, b in self._cached.items():
            if b.block_hash != h:
                errors.append(f"cache entry for block {b.block_id} has a mismatching hash")
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        if hashed != len(self._cached):
            errors.append(f"{hashed} hashed blocks but {len(self._cached)} cache entries")
        null = self.null_block
        if null is not None and (null.ref_cnt != 1 or null.block_hash is not None):
            errors.append(f"the null block has ref_cnt {null.ref_cnt}, hash {null.block_hash!r}")
        if errors:
            raise RuntimeError("block pool integrity: " + "; ".join(errors))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    def assert_all_free(self) -> None:
        """The "nothing leaked" oracle: every block back in the free queue."""
        self.check_integrity()
        if self.num_free_blocks != self.num_usable_blocks:
            used = [b.block_id for b in self.blocks if b.ref_cnt > 0 and b is not self.null_block]
            raise RuntimeError(f"{len(used)} blocks still in use: {used[:20]}")
