"""The engine's KV pool as the host tier copies it: every engine block is one row of
`block_bytes`, made of one or more segments.

kvport's engine keeps an engine block as one contiguous run of bytes (every layer, K and V), so
its pool is one segment: a `(num_blocks, block_bytes)` view. vLLM's CPU pool is layer-major (one
storage, layer l a contiguous `(num_blocks, page)` region; or, in other builds, one tensor per
layer), so one engine block is `num_layers` pages, one per segment. The host tier stores an
engine block as one row either way: the segments' pieces side by side, in segment order. A slot's
bytes therefore depend on the segment widths (the pool's layout, which the disk namespace
records), never on where the engine placed its blocks.

Copies move `(engine block, host row)` pairs: by default every pair and every segment in one
call of block_copy.c (`block_copy.BlockCopier`). Without it, one segment is row gathers and
scatters (`host.copy_rows_numpy`), and with several each run of pairs consecutive on both sides
is one strided 2-D numpy copy per segment (`copy_segments`), split between the calling thread
and helpers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

from kvport.connectors.offloading.tiers.host.row_checks import check_pairs

_WIDE_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_MIN_SPLIT_BYTES = 1 << 20  # below this, handing copies to a helper thread costs more than it saves


@dataclass(frozen=True)
class EnginePool:
    """Byte views of an engine's KV pool. Each segment is `(num_blocks, width)` of `dtype`: row b
    is one run of memory (engine block b's piece in this segment), rows `stride(0)` apart (the
    block stride: a page, or more where other layers' pages lie between a layer's blocks), so
    every vLLM KV layout is a view of its own memory, never a copy. A block's host row is its
    segments' rows side by side, in segment order (layer order, then memory order)."""

    segments: tuple[torch.Tensor, ...]  # each (num_blocks, width) of `dtype`, a view of the pool
    dtype: torch.dtype  # the widest integer type dividing every segment's bytes and strides

    @functools.cached_property
    def segments_np(self) -> tuple[np.ndarray, ...]:
        """numpy views of the segments, made once: Tensor.numpy() costs 1.8 us a call, and a
        64 KiB page (tiny-llama in vLLM's pool) copies in about 8 us."""
        return tuple(s.numpy() for s in self.segments)

    @functools.cached_property
    def layered(self) -> torch.Tensor | None:
        """`(num_segments, num_blocks, width)` over the same memory, where every segment has
        the same width and block stride and the segments lie one stride apart (vLLM's
        layer-major pool in one allocation): one index op then moves a block's every segment.
        None otherwise (one tensor per layer: a copy path loops over the segments)."""
        first = self.segments[0]
        if len(self.segments) == 1:
            return first.unsqueeze(0)
        step = self.segments[1].data_ptr() - first.data_ptr()
        if step <= 0 or step % first.element_size():
            return None
        for i, s in enumerate(self.segments):
            if (s.shape, s.stride()) != (first.shape, first.stride()) \
                    or s.data_ptr() != first.data_ptr() + i * step \
                    or s.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                return None
        return first.as_strided((len(self.segments), *first.shape),
                                (step // first.element_size(), *first.stride()))

    @property
    def device(self) -> torch.device:
        return self.segments[0].device

    @property
    def num_blocks(self) -> int:
        return self.segments[0].shape[0]

    @property
    def row_elems(self) -> int:
        """Elements of `dtype` in one engine block (all segments)."""
        return sum(s.shape[1] for s in self.segments)

    @property
    def block_bytes(self) -> int:
        return self.row_elems * self.dtype.itemsize

    @property
    def offsets(self) -> list[int]:
        """Where each segment's piece starts in a host row, in elements of `dtype`."""
        out, at = [], 0
        for s in self.segments:
            out.append(at)
            at += s.shape[1]
        return out

    @classmethod
    def of(cls, kv_cache: torch.Tensor | EnginePool) -> EnginePool:
        """The pool of a connector's `kv_cache` (num_blocks, num_layers, 2, block_size, heads,
        head_dim): kvport's own, contiguous, is one segment (block_major); a strided view of
        another engine's per-layer pages (vLLM) is its layers' pages (from_pages)."""
        if isinstance(kv_cache, EnginePool):
            return kv_cache
        if kv_cache.is_contiguous():
            return cls.block_major(kv_cache)
        return cls.from_pages([kv_cache[:, i] for i in range(kv_cache.shape[1])])

    @classmethod
    def block_major(cls, kv_cache: torch.Tensor) -> EnginePool:
        """kvport's pool: (num_blocks, ...) with one block contiguous (one segment)."""
        return cls.from_pages([kv_cache])

    @classmethod
    def from_pages(cls, tensors: Sequence[torch.Tensor],
                   num_blocks: int | None = None) -> EnginePool:
        """The pool of per-layer tensors, in layer order, each `(num_blocks, ...)` in any of
        vLLM's layouts (one storage or one per layer; blocks outermost or layers outermost; heads
        before or after tokens): each layer's page is cut into its runs of memory
        (`page_segments`), and runs adjacent in memory for every block are merged (a
        block-outermost pool is one segment per block: each block one run across layers).
        `num_blocks`: the engine's block count, where the tensors' first dim counts kernel
        blocks (`num_blocks * ratio`, vLLM's kernel block splitting): `ratio` consecutive
        kernel blocks are one engine block. ValueError naming the tensor if a page is not made
        of runs of memory, or blocks overlap."""
        if not tensors:
            raise ValueError("EnginePool: no KV cache tensors")
        tensors = [_grouped(i, t, num_blocks) for i, t in enumerate(tensors)]
        count = tensors[0].shape[0]
        for i, t in enumerate(tensors):
            if t.shape[0] != count:
                raise ValueError(f"EnginePool: tensor {i} has {t.shape[0]} blocks, tensor 0 has "
                                 f"{count}")
            if t[0].numel() == 0:
                raise ValueError("EnginePool: a KV cache tensor has empty blocks")
        runs = _merged([_bytes(i, seg) for i, t in enumerate(tensors)
                        for seg in _layer_runs(i, t)])
        # NOTE: rows of the widest integer type that divides every run, stride and address:
        # index kernels move one element per step, and on uint8 rows they run at half speed.
        wide = next(w for w in _WIDE_TYPES
                    if all(s.shape[1] % w.itemsize == 0 and s.stride(0) % w.itemsize == 0
                           and s.data_ptr() % w.itemsize == 0 for s in runs))
        return cls(tuple(s.view(wide) for s in runs), wide)


def _grouped(i: int, t: torch.Tensor, num_blocks: int | None) -> torch.Tensor:
    """t with `ratio` kernel blocks per engine block as one dim: (num_blocks, ratio, ...)."""
    if num_blocks is None or t.shape[0] == num_blocks:
        return t
    if num_blocks < 1 or t.shape[0] % num_blocks:
        raise ValueError(f"EnginePool: tensor {i} has {t.shape[0]} blocks, not a multiple of "
                         f"the engine's {num_blocks}")
    return t.unflatten(0, (num_blocks, t.shape[0] // num_blocks))


def _layer_runs(i: int, t: torch.Tensor) -> list[torch.Tensor]:
    try:
        return page_segments(t)
    except ValueError as exc:
        raise ValueError(f"EnginePool: tensor {i}: {exc}") from None


def _bytes(i: int, seg: torch.Tensor) -> torch.Tensor:
    """A run segment (num_blocks, elements) as (num_blocks, bytes) uint8 over the same memory;
    rows that overlap (a block stride below the run) are refused: a store would mix blocks."""
    out = seg.view(torch.uint8)
    if out.shape[0] > 1 and out.stride(0) < out.shape[1]:
        raise ValueError(f"EnginePool: tensor {i}: blocks of {out.shape[1]} bytes lie "
                         f"{out.stride(0)} bytes apart: they overlap")
    return out


def _merged(runs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs that continue one another in memory for every block (same block stride, the next
    starting where the previous ends) as one: a block-outermost pool's layers are one run."""
    out = [runs[0]]
    for r in runs[1:]:
        last = out[-1]
        if (r.stride(0) == last.stride(0) and r.data_ptr() == last.data_ptr() + last.shape[1]
                and r.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()):
            out[-1] = last.as_strided((last.shape[0], last.shape[1] + r.shape[1]),
                                      (last.stride(0), 1))
        else:
            out.append(r)
    return out


def page_segments(pages: torch.Tensor) -> list[torch.Tensor]:
    """(num_blocks, ...) pages as segments of (num_blocks, elements), each one run of memory: the
    page itself where it is one run, else one segment per index of its dim of largest stride,
    each cut the same way (K and V stored apart: two; vLLM's LHBNC layout, whose heads lie
    outside the blocks, and BHLNC, whose heads enclose the other layers: one per head)."""
    try:
        return [memory_order(pages)]
    except ValueError:
        dims = [d for d in range(1, pages.dim()) if pages.shape[d] > 1]
        if not any(pages.stride(d) == 1 for d in dims):  # no run longer than one element
            raise
        split = max(dims, key=lambda d: pages.stride(d))
    return [s for k in range(pages.shape[split]) for s in page_segments(pages.select(split, k))]


def memory_order(pages: torch.Tensor) -> torch.Tensor:
    """(num_blocks, ...) whose every block is one run of memory, in some order of its dims, as
    (num_blocks, page elements) over the same memory, in memory order. ValueError otherwise."""
    rest = sorted(range(1, pages.dim()), key=lambda d: -pages.stride(d))
    ordered = pages.permute(0, *rest)
    if not ordered[0].is_contiguous():
        raise ValueError(f"a block of this KV cache view (shape {tuple(pages.shape)}, strides "
                         f"{pages.stride()}) is not one run of memory")
    page = ordered[0].numel()
    return torch.as_strided(ordered, (pages.shape[0], page), (ordered.stride(0), 1))


def row_runs(src_rows: Sequence[int], dst_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge (src, dst) row pairs into maximal runs `(src_start, dst_start, length)` where both
    sides advance by one row per pair."""
    if len(src_rows) != len(dst_rows):
        raise ValueError(f"{len(src_rows)} source rows pair with {len(dst_rows)} destinations")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_rows, dst_rows):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_segments(pool: EnginePool, rows: torch.Tensor, block_ids: Sequence[int],
                  row_ids: Sequence[int], to_host: bool,
                  helpers: ThreadPoolExecutor | None = None, num_helpers: int = 0,
                  rows_np: np.ndarray | None = None) -> None:
    """rows[row_ids[i]] <-> engine block block_ids[i], every segment (`to_host`: engine -> host
    rows, else host rows -> engine), copied by numpy. `rows` is (num_rows, pool.row_elems) of
    pool.dtype; `rows_np`, if given, its numpy view. Every id is checked first
    (IdOutOfRangeError, nothing copied): a slice past the end would copy fewer rows, a negative
    start the wrong ones."""
    check_pairs(block_ids, pool.num_blocks, row_ids, rows.shape[0])
    runs = row_runs(block_ids, row_ids)
    if rows_np is None:
        rows_np = rows.numpy()
    np_ops = [(seg_np, col, s, d, n) for seg_np, col in zip(pool.segments_np, pool.offsets)
              for s, d, n in runs]
    num_bytes = len(block_ids) * pool.block_bytes
    if helpers is None or num_helpers < 1 or num_bytes < _MIN_SPLIT_BYTES:
        _copy_ops(rows_np, np_ops, to_host)
        return
    # NOTE: numpy releases the GIL while it copies, so k threads copy in parallel.
    k = num_helpers + 1
    bounds = [len(np_ops) * g // k for g in range(k + 1)]
    futures = [helpers.submit(_copy_ops, rows_np, np_ops[lo:hi], to_host)
               for lo, hi in pairwise(bounds[1:])]
    _copy_ops(rows_np, np_ops[:bounds[1]], to_host)
    for f in futures:
        f.result()


def _copy_ops(rows_np: np.ndarray, ops: list[tuple[np.ndarray, int, int, int, int]],
              to_host: bool) -> None:
    for seg, col, s, d, n in ops:
        host = rows_np[d:d + n, col:col + seg.shape[1]]
        if to_host:
            host[...] = seg[s:s + n]
        else:
            seg[s:s + n] = host
