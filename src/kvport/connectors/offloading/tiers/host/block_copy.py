"""The host tier's native copy (block_copy.c): engine blocks between the pool and host rows with
streaming stores, every segment of a block in one call.

Built on first use by kvport.native. Where it cannot be built, `BlockCopier.for_pool` returns
None (after one warning) and the host tier copies with numpy.
"""

from __future__ import annotations

import array
import ctypes
import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvport import native
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.row_checks import pair_error
from kvport.connectors.offloading.tiers.parts import run_in_parts

LIBRARY = native.NativeLibrary(
    "block-copy", (Path(__file__).with_name("block_copy.c"),),
    ("-O3", "-march=native", "-std=c11", "-fPIC"), ("-shared",),
    "the host tier copies with numpy (stores through the cache, about 0.65x as fast)")
# Below this a job is copied by the calling thread alone: one thread's streaming stores fill the
# memory bus of small machines, and a second one only adds its hand-off; machines whose single
# core cannot fill their memory bus gain from the split on large jobs.
_MIN_SPLIT_BYTES = 16 << 20


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.load(LIBRARY)
    if lib is not None:
        fn = lib.kvport_copy_blocks
        fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int64
        check = lib.kvport_check_blocks
        check.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                          ctypes.c_int64]
        check.restype = ctypes.c_int64
    return lib


def available() -> bool:
    return _library() is not None


class BlockCopier:
    """Copies blocks of one pool (its segments) to and from the rows of one host buffer."""

    def __init__(self, lib: ctypes.CDLL, segments: Sequence[torch.Tensor],
                 host: torch.Tensor) -> None:
        # ValueErrors, not asserts (python -O strips those): C trusts these shapes
        if not (host.dim() == 2 and host.is_contiguous()):
            raise ValueError(f"host rows: a contiguous 2-D tensor, got shape "
                             f"{tuple(host.shape)} strides {host.stride()}")
        if not all(s.dim() == 2 and s.stride(1) == 1 and s.stride(0) >= s.shape[1]
                   and s.device.type == "cpu" for s in segments):
            raise ValueError("each segment: (num_blocks, page) in host memory, a page one run, "
                             f"pages apart, got {[(tuple(s.shape), s.stride(), str(s.device)) for s in segments]}")
        page_bytes = [s.shape[1] * s.element_size() for s in segments]
        if sum(page_bytes) != host.shape[1] * host.element_size():
            raise ValueError(f"pages of {page_bytes} bytes do not fill a host row of "
                             f"{host.shape[1] * host.element_size()}")
        self._fn = lib.kvport_copy_blocks
        self._check = lib.kvport_check_blocks
        self._keep = (tuple(segments), host)  # the memory the pointers below point into
        self._host = host.data_ptr()
        self._row_bytes = host.shape[1] * host.element_size()
        self._segs = (ctypes.c_void_p * len(segments))(*(s.data_ptr() for s in segments))
        self._pages = (ctypes.c_int64 * len(segments))(*page_bytes)
        self._strides = (ctypes.c_int64 * len(segments))(
            *(s.stride(0) * s.element_size() for s in segments))
        self._num_segs = len(segments)
        self._num_blocks = min(s.shape[0] for s in segments)
        self._num_rows = host.shape[0]

    @classmethod
    def for_pool(cls, pool: EnginePool, host_rows: torch.Tensor) -> BlockCopier | None:
        lib = _library()
        return None if lib is None else cls(lib, pool.segments, host_rows)

    def copy(self, block_ids: Sequence[int], row_ids: Sequence[int], to_host: bool,
             helpers: ThreadPoolExecutor | None = None, num_helpers: int = 0) -> None:
        """Host row row_ids[i] <- engine block block_ids[i] (`to_host`), or the reverse."""
        n = len(block_ids)
        if len(row_ids) != n:
            raise ValueError(f"{n} engine blocks pair with {len(row_ids)} host rows")
        # array.array, not numpy: 0.8 us for 8 ids against 4.6 (np.asarray and .ctypes.data),
        # 6 % of a job of 8 blocks of 32 KiB
        blocks, rows = array.array("q", block_ids), array.array("q", row_ids)
        b, r = blocks.buffer_info()[0], rows.buffer_info()[0]
        k = num_helpers + 1
        split = not (helpers is None or k < 2 or n < 2 or n * self._row_bytes < _MIN_SPLIT_BYTES)
        # C checks every id before it copies anything: one out of range would write over other
        # memory. A split job is checked whole first, so that no part of it is copied either.
        bad = (self._check(r, self._num_rows, b, self._num_blocks, n) if split else
               self._copy(to_host, r, b, n))
        if bad >= 0:
            raise pair_error(blocks, self._num_blocks, rows, self._num_rows, bad)
        if not split or helpers is None:
            return
        # ids checked above: each part copies (returns -1)
        run_in_parts(n, k, lambda lo, hi: self._copy(to_host, r + 8 * lo, b + 8 * lo, hi - lo),
                     helpers)

    def _copy(self, to_host: bool, rows: int, blocks: int, n: int) -> int:
        """n pairs from the id arrays at these addresses; -1, or the first pair out of range."""
        return self._fn(int(to_host), self._host, self._row_bytes, rows, self._num_rows,
                        self._segs, self._pages, self._strides, self._num_segs, blocks,
                        self._num_blocks, n)
