"""The host copy strategies only `kvport bench transfer` measures, beside the host tier's own
(`native`, `numpy`; tiers/host/tier.py), on the same views of the same bytes:

    runs    one torch `copy_` per run of rows consecutive on both sides (a pool of several
            segments: per segment)
    gather  the tier's pieces (`plan_pieces`) with torch (`index_select(out=)`, `index_copy_`):
            fast on idle cores, but each piece above torch's grain size opens an OpenMP region,
            which stalls when the other cores are busy (as they are while the engine runs its
            forward)
    index   one `index_select` of all source rows, then one `index_copy_` into the destination
    cat     `torch.cat` of per-block views, then one `copy_` per destination run

`StrategyTier` moves the host tier's jobs (engine blocks <-> slots) with one of them: the pool as
the tier sees it (an EnginePool of `(num_blocks, block row)` segments), the slots as a
`(num_slots * f, block row)` view of a zero-filled `(num_slots, slot_bytes)` uint8 buffer. Every
id is checked before anything is copied, as the tier checks its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvport.connectors.offloading.geometry import slot_rows
from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool, row_runs
from kvport.connectors.offloading.tiers.host.row_checks import check_pairs, check_rows
from kvport.connectors.offloading.tiers.host.tier import plan_pieces

BENCH_STRATEGIES = ("runs", "gather", "index", "cat")
MULTI_SEGMENT_STRATEGIES = ("runs",)  # the ones that move a pool of several segments


def copy_rows_with(strategy: str, src: torch.Tensor, dst: torch.Tensor,
                   src_rows: Sequence[int], dst_rows: Sequence[int]) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for 2-D tensors with equal row sizes, copied the
    strategy's way; every id checked first (IdOutOfRangeError, nothing copied)."""
    if strategy not in BENCH_STRATEGIES:
        raise ValueError(f"unknown copy strategy {strategy!r}; expected one of "
                         f"{BENCH_STRATEGIES}")
    check_rows(src_rows, src.shape[0], dst_rows, dst.shape[0])
    if strategy == "runs":
        for s, d, n in row_runs(src_rows, dst_rows):
            dst[d:d + n].copy_(src[s:s + n])
    elif strategy == "gather":
        _gather_scatter(src, dst, list(src_rows), list(dst_rows))
    elif strategy == "index":
        src_idx = torch.tensor(list(src_rows), dtype=torch.int64)
        dst_idx = torch.tensor(list(dst_rows), dtype=torch.int64)
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))
    else:  # cat
        gathered = torch.cat([src[s:s + n] for s, _, n in row_runs(src_rows, dst_rows)])
        pos = 0
        for _, d, n in row_runs(range(len(dst_rows)), dst_rows):
            dst[d:d + n].copy_(gathered[pos:pos + n])
            pos += n


def _gather_scatter(src: torch.Tensor, dst: torch.Tensor, src_rows: list[int],
                    dst_rows: list[int]) -> None:
    for i, j, kind in plan_pieces(src_rows, dst_rows):
        d, s = dst_rows[i], src_rows[i]
        if kind == 0:
            idx = torch.tensor(src_rows[i:j], dtype=torch.int64)
            torch.index_select(src, 0, idx, out=dst[d:d + j - i])
        elif kind == 1:
            dst.index_copy_(0, torch.tensor(dst_rows[i:j], dtype=torch.int64), src[s:s + j - i])
        else:
            dst[d].copy_(src[s])


def copy_segment_runs(pool: EnginePool, rows: torch.Tensor, block_ids: Sequence[int],
                      row_ids: Sequence[int], to_host: bool) -> None:
    """rows[row_ids[i]] <-> engine block block_ids[i], every segment, one torch `copy_` per run
    of pairs consecutive on both sides and per segment (`to_host`: engine -> host rows);
    every id checked first (a slice past the end would copy fewer rows, a negative start the
    wrong ones)."""
    check_pairs(block_ids, pool.num_blocks, row_ids, rows.shape[0])
    runs = row_runs(block_ids, row_ids)
    for seg, col in zip(pool.segments, pool.offsets):
        for s, d, n in runs:
            host = rows[d:d + n, col:col + seg.shape[1]]
            (host.copy_(seg[s:s + n]) if to_host else seg[s:s + n].copy_(host))


class StrategyTier:
    """The host tier's store and load of whole offload blocks (`blocks_per_slot` engine blocks
    each), copied by a bench strategy."""

    def __init__(self, pool: EnginePool, num_slots: int, blocks_per_slot: int,
                 strategy: str) -> None:
        if strategy not in BENCH_STRATEGIES:
            raise ValueError(f"unknown copy strategy {strategy!r}; expected one of "
                             f"{BENCH_STRATEGIES}")
        if len(pool.segments) > 1 and strategy not in MULTI_SEGMENT_STRATEGIES:
            raise ValueError(f"copy strategy {strategy!r} moves one-segment pools only; this "
                             f"pool has {len(pool.segments)} segments (use one of "
                             f"{MULTI_SEGMENT_STRATEGIES})")
        self.strategy = strategy
        self.pool = pool
        self.blocks_per_slot = blocks_per_slot
        # zeros, not empty: every page faulted in here, as the tier's own buffer is
        self.buffer = torch.zeros((num_slots, blocks_per_slot * pool.block_bytes),
                                  dtype=torch.uint8)
        self.rows = self.buffer.view(pool.dtype).view(num_slots * blocks_per_slot,
                                                      pool.row_elems)

    def store(self, src: EngineBlocks, dst: HostBlocks) -> None:
        """ENGINE -> HOST: engine blocks `f*i .. f*i+f-1` of src fill slot `dst.slot_ids[i]`."""
        self._copy(src.block_ids, self._rows_of(dst, src), to_host=True)

    def load(self, src: HostBlocks, dst: EngineBlocks) -> None:
        """HOST -> ENGINE: the engine-block rows of src's slots fill `dst.block_ids` in order."""
        self._copy(dst.block_ids, self._rows_of(src, dst), to_host=False)

    def _rows_of(self, slots: HostBlocks, blocks: EngineBlocks) -> list[int]:
        """The host rows of the slots, which must pair with whole engine blocks (ValueError)."""
        f = self.blocks_per_slot
        if blocks.skip or len(blocks.block_ids) != f * len(slots.slot_ids):
            raise ValueError(f"{len(slots.slot_ids)} slots pair with {f * len(slots.slot_ids)} "
                             f"whole engine blocks, got {len(blocks.block_ids)} with "
                             f"skip={blocks.skip}")
        return slot_rows(slots.slot_ids, f)

    def _copy(self, block_ids: list[int], row_ids: list[int], to_host: bool) -> None:
        if len(self.pool.segments) > 1:
            copy_segment_runs(self.pool, self.rows, block_ids, row_ids, to_host)
        elif to_host:
            copy_rows_with(self.strategy, self.pool.segments[0], self.rows, block_ids, row_ids)
        else:
            copy_rows_with(self.strategy, self.rows, self.pool.segments[0], row_ids, block_ids)
