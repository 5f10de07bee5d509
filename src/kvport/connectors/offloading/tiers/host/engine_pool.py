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
    segments: tuple[torch.Tensor, ...]  # each (num_blocks, width) of `dtype`, a view of the pool
    dtype: torch.dtype  # the widest integer type dividing every segment's bytes

    @functools.cached_property
    def segments_np(self) -> tuple[np.ndarray, ...]:
        """numpy views of the segments, made once: Tensor.numpy() costs 1.8 us a call, and a
        64 KiB page (tiny-llama in vLLM's pool) copies in about 8 us."""
        return tuple(s.numpy() for s in self.segments)

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
        another engine's per-layer pages (vLLM) is one segment per layer, each block's page in
        the order of its memory."""
        if isinstance(kv_cache, EnginePool):
            return kv_cache
        if kv_cache.is_contiguous():
            return cls.block_major(kv_cache)
        return cls.from_pages([seg for i in range(kv_cache.shape[1])
                               for seg in page_segments(kv_cache[:, i])])

    @classmethod
    def block_major(cls, kv_cache: torch.Tensor) -> EnginePool:
        """kvport's pool: (num_blocks, ...) with one block contiguous (one segment)."""
        return cls.from_pages([kv_cache])

    @classmethod
    def from_pages(cls, tensors: Sequence[torch.Tensor]) -> EnginePool:
        """One segment per tensor, each (num_blocks, ...) with every block's page contiguous,
        all with the same number of blocks (vLLM: one tensor per layer, in layer order)."""
        if not tensors:
            raise ValueError("EnginePool: no KV cache tensors")
        num_blocks = tensors[0].shape[0]
        for i, t in enumerate(tensors):
            if t.shape[0] != num_blocks:
                raise ValueError(f"EnginePool: tensor {i} has {t.shape[0]} blocks, tensor 0 has "
                                 f"{num_blocks}")
            if not t.is_contiguous():
                raise ValueError(f"EnginePool: tensor {i} (shape {tuple(t.shape)}) is not "
                                 f"contiguous (strides {t.stride()}); a block's page must be "
                                 f"one run of bytes")
        page_bytes = [t[0].numel() * t.element_size() for t in tensors]
        if any(b == 0 for b in page_bytes):
            raise ValueError("EnginePool: a KV cache tensor has empty blocks")
        # NOTE: rows of the widest integer type that divides every page (and their addresses):
        # index kernels move one element per step, and on uint8 rows they run at half speed.
        wide = next(w for w in _WIDE_TYPES
                    if all(b % w.itemsize == 0 for b in page_bytes)
                    and all(t.data_ptr() % w.itemsize == 0 for t in tensors))
        segments = tuple(t.reshape(-1).view(torch.uint8).view(wide)
                         .view(num_blocks, b // wide.itemsize) for t, b in zip(tensors, page_bytes))
        return cls(segments, wide)


def page_segments(pages: torch.Tensor) -> list[torch.Tensor]:
    """(num_blocks, ...) pages as segments of (num_blocks, elements) in memory order: one, or one
    per index of each dim whose stride exceeds the block's (K and V stored apart: two)."""
    for d in range(1, pages.dim()):
        if pages.shape[d] > 1 and pages.stride(d) > pages.stride(0):
            return [s for k in range(pages.shape[d]) for s in page_segments(pages.select(d, k))]
    return [memory_order(pages)]


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
