"""The host tier's copy path on torch ops: engine blocks of a pool on any device (a CUDA GPU's
included) to and from host rows, in a few kernels and one DMA per run of rows, whatever the
number of layers.

    store  gathered = layered.index_select(1, block_ids)        (segments, n, width) on the device
           staging[:n] = gathered.permute(1, 0, 2)              (n, row) on the device: host rows
           host_rows[d:d+k] <- staging[i:i+k]                   one copy per run of row ids
    load   staging[i:i+k] <- host_rows[s:s+k]                   one copy per run of row ids
           layered.index_copy_(1, block_ids, staging[:n] as (segments, n, width))

A pool in host memory skips the staging rows where the job's rows are one run (they are then
read and written in place: one pass less).

`layered` is the pool's `(segments, blocks, width)` view (EnginePool.layered: vLLM's layer-major
pool in one allocation, kvport's block-major pool as one segment); a pool without one (one
tensor per layer) loops over its segments, two kernels each. The staging buffer holds at most
`staging_bytes` of blocks (one buffer per direction and stream), so a larger job is copied in
chunks. Every op is enqueued on the current stream, and host copies are non_blocking: on CUDA
the caller (worker/streams.py) runs a job on a stream of its own and learns that it ended from
an event; host rows must then be pinned for the copies to be asynchronous DMAs. On CPU the same ops run at once; the native copy
(block_copy.c) stays the CPU's fast path (BENCHMARKS.md: "The torch copy path on CPU").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.row_checks import check_pairs

STAGING_BYTES = 64 << 20  # the largest chunk of a job: bounds the device memory a copier takes


def row_runs_of(row_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive row ids: `(position, first row, length)`, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, r in enumerate(row_ids):
        if runs and runs[-1][1] + runs[-1][2] == r:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, r, 1))
    return runs


class TorchCopier:
    """Copies blocks of one pool to and from the rows of one host buffer with torch ops. Holds
    one staging buffer per direction (a store and a load may run at once, on two streams)."""

    def __init__(self, pool: EnginePool, host_rows: torch.Tensor,
                 staging_bytes: int = STAGING_BYTES, staged: bool | None = None) -> None:
        """`staged`: copy between the pool and host rows through the staging buffer (default:
        for a pool off the host, where a copy between devices wants one contiguous source). A
        host pool's copy reads and writes the rows directly, one pass less."""
        if not (host_rows.dim() == 2 and host_rows.is_contiguous()
                and host_rows.shape[1] == pool.row_elems and host_rows.dtype == pool.dtype):
            raise ValueError(f"host rows: contiguous (rows, {pool.row_elems}) of {pool.dtype}, "
                             f"got {tuple(host_rows.shape)} of {host_rows.dtype}, strides "
                             f"{host_rows.stride()}")
        if host_rows.device.type != "cpu":
            raise ValueError(f"host rows must be in host memory, got {host_rows.device}")
        if staging_bytes < pool.block_bytes:
            raise ValueError(f"staging_bytes {staging_bytes} is below one engine block "
                             f"({pool.block_bytes} bytes)")
        self.pool, self.host_rows = pool, host_rows
        self.device = pool.device
        self.chunk_blocks = min(staging_bytes // pool.block_bytes, pool.num_blocks)
        self._layered = pool.layered
        self.staged = pool.device.type != "cpu" if staged is None else staged
        # Buffers per (use, stream), made on first use: a synchronous load on the expedited
        # stream must not share one with an asynchronous load on the load stream. "gather" is
        # index_select's `out`: a fresh 64 MiB result per job costs more than the copy (its
        # pages faulted in: 52 ms against 8 on the 2-vCPU VM).
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def copy(self, block_ids: Sequence[int], row_ids: Sequence[int], to_host: bool) -> None:
        """Host row row_ids[i] <- engine block block_ids[i] (`to_host`), or the reverse. Every
        id is checked before anything is enqueued (IdOutOfRangeError): an index kernel given
        one out of range would stop the whole device (a CUDA assert), not just this job."""
        check_pairs(block_ids, self.pool.num_blocks, row_ids, self.host_rows.shape[0])
        for lo in range(0, len(block_ids), self.chunk_blocks):
            hi = lo + self.chunk_blocks
            self._copy_chunk(list(block_ids[lo:hi]), list(row_ids[lo:hi]), to_host)

    def _copy_chunk(self, block_ids: list[int], row_ids: list[int], to_host: bool) -> None:
        n = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        runs = row_runs_of(row_ids)
        direct = not self.staged and len(runs) == 1
        rows = self.host_rows[row_ids[0]:row_ids[0] + n] if direct else self._buffer("rows")[:n]
        if to_host:
            self._gather(ids, rows)
            if not direct:
                for i, row, k in runs:
                    self.host_rows[row:row + k].copy_(rows[i:i + k], non_blocking=True)
        else:
            if not direct:
                for i, row, k in runs:
                    rows[i:i + k].copy_(self.host_rows[row:row + k], non_blocking=True)
            self._scatter(ids, rows)

    def _gather(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """rows (n, row) <- the blocks `ids` of every segment, side by side."""
        n = len(ids)
        if self._layered is not None:
            segs, _, width = self._layered.shape
            gathered = self._buffer("gather").view(-1)[:segs * n * width].view(segs, n, width)
            torch.index_select(self._layered, 1, ids, out=gathered)
            rows.view(n, segs, width).copy_(gathered.permute(1, 0, 2))
            return
        for seg, col in zip(self.pool.segments, self.pool.offsets):
            rows[:, col:col + seg.shape[1]].copy_(seg.index_select(0, ids))

    def _scatter(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """The blocks `ids` of every segment <- rows (n, row)."""
        if self._layered is not None:
            segs, _, width = self._layered.shape
            self._layered.index_copy_(1, ids, rows.view(-1, segs, width).permute(1, 0, 2))
            return
        for seg, col in zip(self.pool.segments, self.pool.offsets):
            seg.index_copy_(0, ids, rows[:, col:col + seg.shape[1]])

    def _buffer(self, use: str) -> torch.Tensor:
        """The staging rows ("rows", (chunk, row)) or index_select's output ("gather") of the
        current stream, on the pool's device."""
        stream = (torch.cuda.current_stream(self.device).cuda_stream
                  if self.device.type == "cuda" else 0)
        buf = self._buffers.get((use, stream))
        if buf is None:
            buf = torch.empty((self.chunk_blocks, self.pool.row_elems), dtype=self.pool.dtype,
                              device=self.device)
            self._buffers[(use, stream)] = buf
        return buf
