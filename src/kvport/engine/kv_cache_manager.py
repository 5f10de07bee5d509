"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing.

Token ranges of one request (block_size 4, a local prefix hit of 2 blocks):

    |<- computed (hit) ->|<- computed ->|<- scheduled now ->|<- not yet ->|
    [ b0 ][ b1 ]          [ b2 ]         [ b3 ][ b4 ]
    num_computed_tokens = 8 after the hit; allocate_slots(req, 9) adds blocks so that
    8 + 9 = 17 tokens fit, and publishes every block that is full once this step has run.
"""

from __future__ import annotations

from kvport.engine.block_pool import BlockPool, KVBlock
from kvport.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int,
                 max_blocks_in_use: int | None = None) -> None:
        if max_blocks_in_use is not None and max_blocks_in_use < 1:
            raise ValueError(f"max_blocks_in_use must be None or >= 1, got {max_blocks_in_use}")
        self.pool = pool
        self.block_size = block_size
        # None: the whole pool. A pool larger than the cap then admits and preempts exactly as a
        # pool of the cap's size, while its free blocks keep more prefixes cached.
        self.max_blocks_in_use = max_blocks_in_use
        self.req_to_blocks: dict[str, list[KVBlock]] = {}  # request_id -> block table
        self._num_published: dict[str, int] = {}  # request_id -> leading blocks already published

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks of the request's tokens, and its token count.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def count_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Counts one admission's lookup in the pool stats. Called once the request got its
        blocks: a request tried again (no room yet) looks up again but is counted once."""
        if not self.pool.enable_caching:
            return
        self.pool.stats.num_queried_blocks += (request.num_tokens - 1) // self.block_size
        self.pool.stats.num_hit_blocks += num_hit_blocks

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: list[KVBlock], num_external_tokens: int = 0) -> int:
        """Free blocks that `allocate_slots` would consume (cached hits that are free count)."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_external_tokens + num_new_tokens
        total_blocks = -(-total // self.block_size)
        num_new_blocks = max(0, total_blocks - held - len(new_computed_blocks))
        return num_new_blocks + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def allocate_slots(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_external_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVBlock] | None:
        """Grow the request's block table so that its computed tokens, the new prefix hits, the
        tokens a connector loads and `num_new_tokens` more fit. Returns the newly allocated
        blocks, or None (and changes nothing) if the pool cannot supply them or they would take
        the blocks in use above `max_blocks_in_use`.

        `delay_cache_blocks`: do not publish yet (an async load fills the blocks later)."""
        hits = new_computed_blocks or []
        needed = self.num_blocks_needed(request, num_new_tokens, hits, num_external_tokens)
        if needed > self.pool.num_free_blocks:
            return None
        in_use = self.pool.num_blocks - self.pool.num_free_blocks  # blocks with ref_cnt > 0
        # `needed` counts a free cached block taken by a hit: it becomes in use too
        if self.max_blocks_in_use is not None and in_use + needed > self.max_blocks_in_use:
            return None
        table = self.req_to_blocks.setdefault(request.request_id, [])
        self._num_published.setdefault(request.request_id, 0)
        assert not hits or not table, "prefix hits are only taken for a request without blocks"
        self.pool.touch(hits)
        table.extend(hits)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_external_tokens + num_new_tokens
        new_blocks = self.pool.allocate(max(0, -(-total // self.block_size) - len(table)))
        table.extend(new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, total)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that are full within its first `num_tokens` tokens.

        Called at schedule time for the tokens the step computes or loads synchronously: their
        KV is written in the step before any attention of the same layer reads it."""
        rid = request.request_id
        table = self.req_to_blocks[rid]
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes), len(table))
        for i in range(self._num_published[rid], num_full):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_published[rid] = max(self._num_published[rid], num_full)

    def uncache_blocks_from(self, request: Request, block_index: int) -> None:
        """Withdraw the request's blocks from `block_index` on from the prefix cache (their
        contents are not trustworthy: a load into them failed, or they were computed from such
        blocks). They stay allocated to the request, which recomputes them."""
        rid = request.request_id
        for block in self.req_to_blocks.get(rid, [])[block_index:]:
            self.pool.uncache_block(block)
        if rid in self._num_published:
            self._num_published[rid] = min(self._num_published[rid], block_index)

    def uncache_block_ids(self, block_ids: set[int]) -> None:
        """Withdraw these pool blocks from the prefix cache, whoever holds them (a load into
        them failed). Ids outside the pool are ignored: they come from a connector."""
        for block_id in sorted(block_ids):
            if 0 <= block_id < self.pool.num_blocks:
                self.pool.uncache_block(self.pool.blocks[block_id])

    def free(self, request: Request) -> None:
        table = self.req_to_blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    @property
    def num_requests(self) -> int:
        return len(self.req_to_blocks)
