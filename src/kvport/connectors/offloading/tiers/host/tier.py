"""Host-memory tier: a preallocated buffer of offload-block slots, and engine <-> host copies.

The engine pool is an `EnginePool` (tiers/host/engine_pool.py): kvport's `kv_cache (num_blocks,
num_layers, 2, block_size, heads, head_dim)` is one segment, `(num_blocks, block_bytes)` rows (of
the widest integer type dividing block_bytes), so one engine block is one contiguous row; vLLM's
layer-major pool is one segment per layer, and a block's row is its pages side by side. The
host buffer is `(num_slots, slot_bytes)` uint8 with `slot_bytes = f * block_bytes`, viewed as
`(num_slots * f, block_bytes)` rows, so slot s holds engine-block rows `s*f .. s*f + f-1` back
to back. A transfer is a list of (source row, destination row) pairs, split into pieces where
one side is consecutive (`plan_pieces`). With f = 1 a job's slots are consecutive wherever free
slots allow (the allocator hands them out in ascending order), so a store of a whole job is one
gather into its run of slots and a load one scatter out of it, wherever the engine blocks sit.

Copy strategies:
    native block_copy.c: every (block, row) pair, every segment, with streaming stores, in one
           call per thread (the default; numpy where it cannot be built)
    numpy  the pieces, copied by numpy (`take(out=)`, fancy assignment), split between the
           calling thread and `num_threads - 1` helpers
    torch  torch index ops, one copy per run of slots (tiers/host/torch_copy.py): the path of
           a pool on a GPU, whose host buffer is then pinned; on CPU it runs the same ops (the
           tests of the GPU path's logic)
`kvport bench transfer` measures them next to strategies of its own (bench/transfer/strategies.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvport.connectors.offloading.geometry import slot_rows
from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.metrics import Counters, TierMetrics
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.tiers.host.block_copy import BlockCopier
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool, copy_segments, row_runs
from kvport.connectors.offloading.tiers.host.row_checks import IdOutOfRangeError, check_rows
from kvport.connectors.offloading.tiers.host.torch_copy import TorchCopier
from kvport.connectors.offloading.tiers.parts import run_in_parts

STRATEGIES = ("native", "numpy", "torch")
DEFAULT_STRATEGY = "native"
HOST_ONLY = ("native", "numpy")  # strategies that read the pool through host pointers
# Below this a job is copied by the calling thread alone: the hand-off to a helper
# (ThreadPoolExecutor) costs more than it saves on a small job.
_MIN_SPLIT_BYTES = 1 << 20
__all__ = ["STRATEGIES", "HostTier", "copy_rows", "copy_rows_numpy", "plan_pieces", "row_runs"]


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: Sequence[int],
              dst_rows: Sequence[int], strategy: str = "numpy",
              helpers: ThreadPoolExecutor | None = None, num_helpers: int = 0) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for 2-D tensors with equal row sizes. With `helpers`
    (numpy strategy only), the rows are split evenly between the calling thread and
    `num_helpers` tasks on them. Every id is checked first (IdOutOfRangeError, nothing copied)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown copy strategy {strategy!r}; expected one of {STRATEGIES}")
    if strategy == "native":
        copier = BlockCopier.for_pool(EnginePool.block_major(src), dst)
        if copier is not None:
            copier.copy(src_rows, dst_rows, to_host=True)
            return
    # numpy (also where block_copy.c could not be built); it checks the ids itself
    copy_rows_numpy(src.numpy(), dst.numpy(), list(src_rows), list(dst_rows), helpers,
                    num_helpers)


def plan_pieces(src_rows: list[int], dst_rows: list[int]) -> list[tuple[int, int, int]]:
    """Split (src, dst) row pairs into pieces `(i, j, kind)` over pairs[i:j] where one side is
    consecutive: kind 0 = destination run (gather into it), 1 = source run (scatter from it),
    2 = a single pair. A store fills a slot's f consecutive rows (one gather); a load reads
    them (one scatter), wherever the engine blocks are."""
    pieces: list[tuple[int, int, int]] = []
    i = 0
    while i < len(src_rows):
        j = i + 1
        while j < len(src_rows) and dst_rows[j] == dst_rows[j - 1] + 1:
            j += 1
        if j - i > 1:
            pieces.append((i, j, 0))
            i = j
            continue
        while j < len(src_rows) and src_rows[j] == src_rows[j - 1] + 1:
            j += 1
        pieces.append((i, j, 1 if j - i > 1 else 2))
        i = j
    return pieces


def copy_rows_numpy(src: np.ndarray, dst: np.ndarray, src_rows: list[int], dst_rows: list[int],
                    helpers: ThreadPoolExecutor | None = None, num_helpers: int = 0) -> None:
    """copy_rows' numpy strategy on numpy views (the host tier keeps them, see HostTier); every
    id checked first (IdOutOfRangeError, nothing copied)."""
    check_rows(src_rows, src.shape[0], dst_rows, dst.shape[0])
    num_bytes = len(src_rows) * dst.strides[0]
    if helpers is None or num_helpers < 1 or num_bytes < _MIN_SPLIT_BYTES:
        _gather_scatter_numpy(src, dst, src_rows, dst_rows)
        return
    # NOTE: numpy releases the GIL while it copies, so k threads copy in parallel. Unlike
    # torch's OpenMP team, a thread that is descheduled does not stall the others' pieces.
    run_in_parts(len(src_rows), num_helpers + 1, lambda lo, hi: _gather_scatter_numpy(
        src, dst, src_rows[lo:hi], dst_rows[lo:hi]), helpers)


def _consecutive(rows: list[int]) -> bool:
    return not rows or rows == list(range(rows[0], rows[0] + len(rows)))


def _gather_scatter_numpy(src_np: np.ndarray, dst_np: np.ndarray, src_rows: list[int],
                          dst_rows: list[int]) -> None:
    # NOTE: numpy copies on the calling thread only. Torch would start an OpenMP parallel
    # region per piece, and with the cores busy (the engine's forward) each region waits for a
    # descheduled team thread.
    # A job's slots are consecutive (the allocator hands them out in order), so a store is one
    # gather into them and a load one scatter out of them: checked by a list comparison rather
    # than planned row by row in Python (plan_pieces: several times slower, a visible part of
    # a 64 MiB job of 32 KiB blocks).
    n = len(src_rows)
    if _consecutive(dst_rows):
        pieces = [(0, n, 0)]
    elif _consecutive(src_rows):
        pieces = [(0, n, 1)]
    else:
        pieces = plan_pieces(src_rows, dst_rows)
    for i, j, kind in pieces:
        d, s = dst_rows[i], src_rows[i]
        if kind == 0:
            # mode="clip": with the default "raise" numpy buffers `out` (an extra copy). It
            # would clip an id out of range, so copy_rows_numpy checked them all first.
            np.take(src_np, src_rows[i:j], axis=0, out=dst_np[d:d + j - i], mode="clip")
        elif kind == 1:
            dst_np[dst_rows[i:j]] = src_np[s:s + j - i]
        else:
            dst_np[d] = src_np[s]


class HostTier:
    """`num_slots` slots of `slot_bytes` each, allocated once; the scheduler-side manager decides
    which slot holds which key, this object only moves bytes and counts them."""

    def __init__(self, num_slots: int, slot_bytes: int, strategy: str = DEFAULT_STRATEGY,
                 num_threads: int | None = None, pin_memory: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown copy strategy {strategy!r}; expected one of {STRATEGIES}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.strategy = strategy
        # pin_memory: for a pool on a GPU, whose DMA engine copies pinned pages asynchronously
        # (pageable ones through a synchronous bounce buffer); a host pool gains nothing.
        # zeros, not empty: every page is faulted in here, once, rather than by the first store
        # into it, beside the engine's forward (a first write to a page is several times slower
        # than later ones: docs/offloading.md, "Blocks and keys").
        self.buffer = torch.zeros((num_slots, slot_bytes), dtype=torch.uint8,
                                  pin_memory=pin_memory)  # (slots, slot_bytes)
        # Counts bytes and blocks moved. Occupancy is not tracked here: the scheduler's manager
        # owns the slots (which hold data, which are free) and reports it.
        self.stats = Counters(TierMetrics)
        self._pool: EnginePool | None = None  # the engine's KV pool, as rows of block bytes
        self._rows: torch.Tensor | None = None  # (num_slots * f, block row) view of buffer
        self.blocks_per_slot = 0  # f, set by register_engine_pool
        # Copy threads per transfer, the caller's included: torch's count by default, so a
        # transfer uses the cores a plain torch copy would.
        self.num_threads = torch.get_num_threads() if num_threads is None else num_threads
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        self._helpers = (ThreadPoolExecutor(self.num_threads - 1, "kvport-host-copy")
                         if self.num_threads > 1 else None)

    @classmethod
    def for_pool(cls, kv_cache: torch.Tensor | EnginePool, num_slots: int, blocks_per_slot: int,
                 strategy: str = "auto", num_threads: int | None = None) -> HostTier:
        """A tier whose slots hold `blocks_per_slot` engine blocks of this pool, registered.
        `strategy` "auto": the native copy for a pool in host memory, torch ops (and a pinned
        buffer) for a pool on a GPU."""
        pool = EnginePool.of(kv_cache)
        on_host = pool.device.type == "cpu"
        if strategy == "auto":
            strategy = DEFAULT_STRATEGY if on_host else "torch"
        tier = cls(num_slots, blocks_per_slot * pool.block_bytes, strategy, num_threads,
                   pin_memory=not on_host and pool.device.type != "meta")
        tier.register_engine_pool(pool)
        return tier

    def register_engine_pool(self, kv_cache: torch.Tensor | EnginePool) -> None:
        """Keep byte views of the engine pool (EnginePool.of); slot_bytes must be a whole number
        of blocks."""
        pool = EnginePool.of(kv_cache)
        if pool.device.type != "cpu" and self.strategy in HOST_ONLY:
            raise ValueError(f"the {self.strategy!r} copy reads host memory; this KV pool is on "
                             f"{pool.device}: copy it with strategy 'torch'")
        if self.slot_bytes % pool.block_bytes:
            raise ValueError(f"slot_bytes {self.slot_bytes} is not a multiple of the engine "
                             f"block's {pool.block_bytes} bytes")
        self._pool = pool
        self.blocks_per_slot = self.slot_bytes // pool.block_bytes
        self._rows = self.buffer.view(pool.dtype).view(self.num_slots * self.blocks_per_slot,
                                                       pool.row_elems)
        # numpy views made once: Tensor.numpy() costs 1.8 us a call, two per job (7 % of an
        # 8-block job of 32 KiB blocks, 50 us)
        host_side = self.strategy in HOST_ONLY
        self._pool_np = (pool.segments[0].numpy() if host_side and len(pool.segments) == 1
                         else None)
        self._rows_np = self._rows.numpy()
        self._native = (BlockCopier.for_pool(pool, self._rows) if self.strategy == "native"
                        else None)
        self._torch = TorchCopier(pool, self._rows) if self.strategy == "torch" else None
        if self.strategy == "native" and self._native is None:
            self.strategy = "numpy"  # block_copy.c could not be built (kvport.native warned)

    @property
    def device(self) -> torch.device:
        """The registered engine pool's device."""
        return self._registered()[0].device

    def slot(self, slot_id: int) -> torch.Tensor:
        """One slot's bytes, (slot_bytes,) uint8: a view the disk tier reads and writes."""
        if not 0 <= slot_id < self.num_slots:
            raise IdOutOfRangeError(f"slot {slot_id} out of range [0, {self.num_slots})")
        return self.buffer[slot_id]

    def store(self, src: EngineBlocks, dst: HostBlocks) -> TransferOutcome:
        """ENGINE -> HOST: engine blocks `f*i .. f*i+f-1` of src fill slot `dst.slot_ids[i]`."""
        pool, rows, f = self._registered()
        if src.skip:
            raise ValueError(f"a store copies whole offload blocks; got skip={src.skip}")
        if len(src.block_ids) != f * len(dst.slot_ids):
            raise ValueError(f"store of {len(dst.slot_ids)} offload blocks of {f} engine blocks "
                             f"needs {f * len(dst.slot_ids)} engine blocks, got "
                             f"{len(src.block_ids)}")
        self._check_slots(dst.slot_ids)
        start = time.perf_counter()
        self._copy(pool, rows, src.block_ids, slot_rows(dst.slot_ids, f), to_host=True)
        num_bytes = len(dst.slot_ids) * self.slot_bytes
        self.stats.add(bytes_stored=num_bytes, blocks_stored=len(dst.slot_ids),
                       store_seconds=time.perf_counter() - start)
        return TransferOutcome(num_bytes)

    def load(self, src: HostBlocks, dst: EngineBlocks) -> TransferOutcome:
        """HOST -> ENGINE: the engine-block rows of src's slots, minus the first `dst.skip`, fill
        `dst.block_ids` in order (see EngineBlocks for the partial first offload block)."""
        pool, rows, f = self._registered()
        if not 0 <= dst.skip < max(f, 1) or len(dst.block_ids) + dst.skip != f * len(src.slot_ids):
            raise ValueError(f"load of {len(src.slot_ids)} offload blocks of {f} engine blocks "
                             f"into {len(dst.block_ids)} engine blocks with skip={dst.skip}: "
                             f"need len(block_ids) + skip == {f * len(src.slot_ids)} and "
                             f"0 <= skip < {f}")
        self._check_slots(src.slot_ids)
        start = time.perf_counter()
        src_rows = slot_rows(src.slot_ids, f)[dst.skip:]
        self._copy(pool, rows, dst.block_ids, src_rows, to_host=False)
        num_bytes = len(dst.block_ids) * (self.slot_bytes // f)
        self.stats.add(bytes_loaded=num_bytes, blocks_loaded=len(src.slot_ids),
                       load_seconds=time.perf_counter() - start)
        return TransferOutcome(num_bytes)

    def _copy(self, pool: EnginePool, rows: torch.Tensor, block_ids: list[int],
              row_ids: list[int], to_host: bool) -> None:
        k = self.num_threads - 1
        if self._torch is not None:
            self._torch.copy(block_ids, row_ids, to_host)
        elif self._native is not None:
            self._native.copy(block_ids, row_ids, to_host, self._helpers, k)
        elif len(pool.segments) > 1:
            copy_segments(pool, rows, block_ids, row_ids, to_host, self._helpers, k,
                          self._rows_np)
        else:
            if self._pool_np is None:
                raise RuntimeError("HostTier: the numpy strategy lost its pool's numpy view")
            if to_host:
                copy_rows_numpy(self._pool_np, self._rows_np, block_ids, row_ids,
                                self._helpers, k)
            else:
                copy_rows_numpy(self._rows_np, self._pool_np, row_ids, block_ids,
                                self._helpers, k)

    def _registered(self) -> tuple[EnginePool, torch.Tensor, int]:
        if self._pool is None or self._rows is None:
            raise RuntimeError("HostTier: register_engine_pool(kv_cache) was not called")
        return self._pool, self._rows, self.blocks_per_slot

    def _check_slots(self, slot_ids: Sequence[int]) -> None:
        bad = [s for s in slot_ids if not 0 <= s < self.num_slots]
        if bad:
            raise IdOutOfRangeError(f"slots {bad} out of range [0, {self.num_slots})")
