"""Per-request block tables, one per KV cache group, on top of the block pool: prefix lookup, slot
allocation, freeing.

Token ranges of one request (block_size 4, a local prefix hit of 2 blocks):

    |<- computed (hit) ->|<- computed ->|<- scheduled now ->|<- not yet ->|
    [ b0 ][ b1 ]          [ b2 ]         [ b3 ][ b4 ]
    num_computed_tokens = 8 after the hit; allocate_slots(req, 9) adds blocks so that
    8 + 9 = 17 tokens fit, and publishes every block that is full once this step has run.

Groups (kvport.model.kv_groups): every group has its own table over the same token positions. A
full-attention group keeps every block. A sliding-window group (window W) needs only the blocks
holding the W - 1 tokens before the first token still to compute; the blocks before them are
freed and the table holds the pool's null block there, so it stays indexed by position:

    window 6, block_size 4, 14 tokens computed (the next token sees tokens 9..14):
    full     [ b0 ][ b1 ][ b2 ][ b3 ]
    sliding  [null][null][ b6 ][ b7 ]      b4, b5 freed (still cached until reused)

A prefix hit must be one every group can supply (vLLM's rule): full groups a run of cached blocks
from the start, a sliding group the blocks of the window before the hit point (`_sliding_hit`);
the hit is the longest length all groups accept. Cache entries are per group: the same tokens in
two groups are two blocks with two keys.
"""

from __future__ import annotations

from kvport.engine.block_pool import BlockPool, KVBlock
from kvport.engine.hashing import BlockHash
from kvport.engine.request import Request

GroupBlocks = tuple[list[KVBlock], ...]  # per KV cache group, in group order


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int,
                 max_blocks_in_use: int | None = None,
                 group_windows: tuple[int | None, ...] = (None,)) -> None:
        """`group_windows`: per KV cache group, its sliding window (None: full attention)."""
        if max_blocks_in_use is not None and max_blocks_in_use < 1:
            raise ValueError(f"max_blocks_in_use must be None or >= 1, got {max_blocks_in_use}")
        if not group_windows:
            raise ValueError("a KV cache manager needs at least one group")
        if any(w is not None for w in group_windows) and pool.null_block is None:
            raise ValueError("sliding-window groups need a pool with a null block")
        self.pool = pool
        self.block_size = block_size
        # None: the whole pool. A pool larger than the cap then admits and preempts exactly as a
        # pool of the cap's size, while its free blocks keep more prefixes cached.
        self.max_blocks_in_use = max_blocks_in_use
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self._one_full_group = group_windows == (None,)
        self.req_to_blocks: dict[str, GroupBlocks] = {}  # request_id -> a block table per group
        # request_id -> per group, leading blocks already published (or skipped as null)
        self._num_published: dict[str, list[int]] = {}

    # ---- keys and windows ----------------------------------------------------------------

    def _key(self, block_hash: BlockHash, group: int) -> BlockHash:
        """The cache key of a block of `group`: the hash itself with one group (the layout of
        every non-hybrid model), else the hash and the group's index (as vLLM keys them)."""
        return block_hash if self.num_groups == 1 else block_hash + group.to_bytes(4, "little")

    def _window_blocks(self, group: int) -> int | None:
        """Blocks a sliding group needs before a position: those of its window's W - 1 earlier
        tokens. None for a full-attention group (all of them)."""
        window = self.group_windows[group]
        return None if window is None else -(-(window - 1) // self.block_size)

    def first_needed_block(self, group: int, num_tokens: int) -> int:
        """For the next token at position `num_tokens`: the group's first block it reads."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    # ---- prefix hits ---------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest prefix of full blocks every group can supply from the cache, as each
        group's hit blocks (null blocks where a sliding group needs none), and its token count.

        At least one token is always left to compute: its logits give the next token.
        """
        empty: GroupBlocks = tuple([] for _ in range(self.num_groups))
        if not self.pool.enable_caching:
            return empty, 0
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        num_blocks = len(hashes)
        for g in range(self.num_groups):  # full groups: downward closed, one pass
            if self.group_windows[g] is None:
                num_blocks = self._full_hit(g, hashes, num_blocks)
        while True:  # sliding groups: each may shorten the hit, which the others then re-check
            before = num_blocks
            for g in range(self.num_groups):
                if self.group_windows[g] is not None:
                    num_blocks = self._sliding_hit(g, hashes, num_blocks)
            if num_blocks == before:
                break
        return tuple(self._hit_blocks(g, hashes, num_blocks) for g in range(self.num_groups)), \
            num_blocks * self.block_size

    def _cached(self, group: int, block_hash: BlockHash) -> KVBlock | None:
        return self.pool.get_cached_block(self._key(block_hash, group))

    def _full_hit(self, group: int, hashes: list[BlockHash], limit: int) -> int:
        n = 0
        while n < limit and self._cached(group, hashes[n]) is not None:
            n += 1
        return n

    def _sliding_hit(self, group: int, hashes: list[BlockHash], limit: int) -> int:
        """The largest n <= limit whose window blocks (the `need` blocks before n, or all of them
        near the start) are cached, scanning from the right."""
        need = self._window_blocks(group)
        assert need is not None, f"group {group} is not a sliding-window group"
        if need == 0:
            return limit
        run = 0  # cached blocks in a row, ending just before block index i + run
        for i in range(limit - 1, -1, -1):
            if self._cached(group, hashes[i]) is None:
                run = 0
                continue
            run += 1
            if run == need:
                return i + need
        return run  # a run from block 0 that is shorter than the window: all it needs

    def _hit_blocks(self, group: int, hashes: list[BlockHash], num_blocks: int) -> list[KVBlock]:
        first = self.first_needed_block(group, num_blocks * self.block_size)
        null = self.pool.null_block
        blocks = [null] * first if first else []
        for h in hashes[first:num_blocks]:
            block = self._cached(group, h)
            assert block is not None, f"hit block of group {group} left the cache"
            blocks.append(block)
        return blocks  # type: ignore[return-value]  # null is not None where first > 0

    def count_prefix_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Counts one admission's lookup in the pool stats. Called once the request got its
        blocks: a request tried again (no room yet) looks up again but is counted once."""
        if not self.pool.enable_caching:
            return
        self.pool.stats.num_queried_blocks += (request.num_tokens - 1) // self.block_size
        self.pool.stats.num_hit_blocks += num_hit_blocks

    # ---- allocation ----------------------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int, hits: GroupBlocks | None,
              num_external_tokens: int) -> tuple[list[int], list[int], int]:
        """Per group, the first block the request still reads (a sliding window's start; 0 for a
        full group) and the number of new blocks; and the free blocks all of it takes, net of
        those the sliding groups give back (held by this request alone)."""
        tables = self.req_to_blocks.get(request.request_id)
        num_hit = len(hits[0]) if hits else 0
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        total = num_computed + num_external_tokens + num_new_tokens
        total_blocks = -(-total // self.block_size)
        # The first token this request still computes reads back to its window's start.
        start = num_computed + num_external_tokens
        firsts, news, consumed = [], [], 0
        null = self.pool.null_block
        for g in range(self.num_groups):
            held = len(tables[g]) if tables else 0
            first = self.first_needed_block(g, start)
            if tables and first:
                consumed -= sum(1 for b in tables[g][:first] if b is not null and b.ref_cnt == 1)
            old = max(held, num_hit)
            news.append(max(0, total_blocks - max(old, first)))
            firsts.append(first)
            consumed += news[-1]
            if hits:
                consumed += sum(1 for b in hits[g][first:] if b.ref_cnt == 0)
        return firsts, news, consumed

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: GroupBlocks | None = None,
                          num_external_tokens: int = 0) -> int:
        """Free blocks that `allocate_slots` would consume (cached hits that are free count)."""
        return self._plan(request, num_new_tokens, new_computed_blocks, num_external_tokens)[2]

    def allocate_slots(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_external_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlocks | None:
        """Grow the request's block tables so that its computed tokens, the new prefix hits, the
        tokens a connector loads and `num_new_tokens` more fit. Returns each group's newly added
        table entries (null blocks where a sliding group needs none), or None (and changes
        nothing) if the pool cannot supply them or they would take the blocks in use above
        `max_blocks_in_use`. Blocks a sliding group's window has moved past are freed first.

        `delay_cache_blocks`: do not publish yet (an async load fills the blocks later)."""
        hits = new_computed_blocks if new_computed_blocks and new_computed_blocks[0] else None
        if self._one_full_group:
            new = self._allocate_one_full_group(request, num_new_tokens, hits and hits[0],
                                                num_external_tokens, delay_cache_blocks)
            return None if new is None else (new,)
        firsts, news, needed = self._plan(request, num_new_tokens, hits, num_external_tokens)
        if needed > self.pool.num_free_blocks:
            return None
        in_use = self.pool.num_usable_blocks - self.pool.num_free_blocks
        # `needed` counts a free cached block taken by a hit: it becomes in use too
        if self.max_blocks_in_use is not None and in_use + needed > self.max_blocks_in_use:
            return None
        rid = request.request_id
        tables = self.req_to_blocks.setdefault(rid, tuple([] for _ in range(self.num_groups)))
        published = self._num_published.setdefault(rid, [0] * self.num_groups)
        assert hits is None or not tables[0], "prefix hits are only taken for a request without blocks"
        null = self.pool.null_block
        # Before any group allocates: every sliding group gives back what its window left (the
        # check above counted those blocks free), and every group's hits leave the free queue
        # (an allocation could otherwise evict another group's hit).
        starts = [len(table) for table in tables]
        for g, table in enumerate(tables):
            self._skip_blocks(table, firsts[g])
        kept = [hits[g][firsts[g]:] if hits else [] for g in range(self.num_groups)]
        for blocks in kept:
            assert null not in blocks, "a hit needs the null block inside the window"
            self.pool.touch(blocks)
        added: list[list[KVBlock]] = []
        for g, table in enumerate(tables):
            start = starts[g]
            if hits:
                table.extend([null] * min(firsts[g], len(hits[g])))  # type: ignore[list-item]
                table.extend(kept[g])
            if len(table) < firsts[g]:
                table.extend([null] * (firsts[g] - len(table)))  # type: ignore[list-item]
            table.extend(self.pool.allocate(news[g]))
            published[g] = max(published[g], min(firsts[g], len(table)))
            added.append(table[start:])
        if not delay_cache_blocks:
            num_hit = len(hits[0]) if hits else 0
            total = (request.num_computed_tokens + num_hit * self.block_size
                     + num_external_tokens + num_new_tokens)
            self.cache_blocks(request, total)
        return tuple(added)

    def _allocate_one_full_group(self, request: Request, num_new_tokens: int,
                                 hits: list[KVBlock] | None, num_external_tokens: int,
                                 delay_cache_blocks: bool) -> list[KVBlock] | None:
        """`allocate_slots` for the layout of every non-hybrid model (one full-attention group):
        the same result as the general path without its per-group bookkeeping, which costs a
        decode step of a small model several percent (BENCHMARKS.md, "Engine throughput")."""
        hits = hits or []
        rid = request.request_id
        table = self.req_to_blocks.get(rid, ((),))[0]
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_external_tokens + num_new_tokens
        num_new = max(0, -(-total // self.block_size) - len(table) - len(hits))
        needed = num_new + sum(1 for b in hits if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks:
            return None
        in_use = self.pool.num_usable_blocks - self.pool.num_free_blocks
        if self.max_blocks_in_use is not None and in_use + needed > self.max_blocks_in_use:
            return None
        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid] = ([],)
            self._num_published[rid] = [0]
        table = self.req_to_blocks[rid][0]
        assert not hits or not table, "prefix hits are only taken for a request without blocks"
        self.pool.touch(hits)
        start = len(table)
        table.extend(hits)
        table.extend(self.pool.allocate(num_new))
        if not delay_cache_blocks:
            self.cache_blocks(request, total)
        return table[start:]

    def _skip_blocks(self, table: list[KVBlock], first: int) -> None:
        """Free the real blocks before index `first` (a sliding window moved past them) and put
        the null block in their place."""
        null = self.pool.null_block
        gone = [b for b in table[:first] if b is not null]
        if not gone:
            return
        self.pool.free(reversed(gone))
        assert null is not None, "only sliding groups skip blocks, and they have a null block"
        for i in range(min(first, len(table))):
            table[i] = null

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that are full within its first `num_tokens` tokens.

        Called at schedule time for the tokens the step computes or loads synchronously: their
        KV is written in the step before any attention of the same layer reads it."""
        rid = request.request_id
        null = self.pool.null_block
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes))
        published = self._num_published[rid]
        if published[0] >= num_full and self._one_full_group:
            return  # a decode step within a block: nothing new is full
        for g, table in enumerate(self.req_to_blocks[rid]):
            end = min(num_full, len(table))
            for i in range(published[g], end):
                if table[i] is not null:
                    self.pool.cache_block(table[i], self._key(request.block_hashes[i], g))
            published[g] = max(published[g], end)

    def uncache_blocks_from(self, request: Request, block_index: int) -> None:
        """Withdraw the request's blocks from `block_index` on from the prefix cache (their
        contents are not trustworthy: a load into them failed, or they were computed from such
        blocks). They stay allocated to the request, which recomputes them."""
        rid = request.request_id
        null = self.pool.null_block
        for table in self.req_to_blocks.get(rid, ()):
            for block in table[block_index:]:
                if block is not null:
                    self.pool.uncache_block(block)
        if rid in self._num_published:
            self._num_published[rid] = [min(n, block_index) for n in self._num_published[rid]]

    def cut_window_holes(self, request: Request, num_tokens: int) -> None:
        """For a request that computes again from `num_tokens` (a rewind): each sliding group's
        table is cut at its first null block inside the window from there on, and the blocks
        after it freed, so they are allocated again (recomputed KV lands in real blocks)."""
        rid, null = request.request_id, self.pool.null_block
        for g, table in enumerate(self.req_to_blocks.get(rid, ())):
            if self.group_windows[g] is None:
                continue
            start = self.first_needed_block(g, num_tokens)
            cut = next((i for i in range(start, len(table)) if table[i] is null), None)
            if cut is not None:
                self.pool.free(b for b in reversed(table[cut:]) if b is not null)
                del table[cut:]
                self._num_published[rid][g] = min(self._num_published[rid][g], cut)

    def uncache_block_ids(self, block_ids: set[int]) -> None:
        """Withdraw these pool blocks from the prefix cache, whoever holds them (a load into
        them failed). Ids outside the pool are ignored: they come from a connector."""
        for block_id in sorted(block_ids):
            if 0 <= block_id < self.pool.num_blocks:
                self.pool.uncache_block(self.pool.blocks[block_id])

    def free(self, request: Request) -> None:
        tables = self.req_to_blocks.pop(request.request_id, ())
        self._num_published.pop(request.request_id, None)
        null = self.pool.null_block
        for table in tables:
            self.pool.free(b for b in reversed(table) if b is not null)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's block table (the null block's id where a sliding window moved past)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple([b.block_id for b in table] for table in tables)

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self.req_to_blocks.get(request_id, ([],))[0])

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    @property
    def num_requests(self) -> int:
        return len(self.req_to_blocks)
