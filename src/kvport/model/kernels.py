"""The engine's native kernels: decode attention over the paged pool and the write of a step's
K/V into it (paged_attention.c), and the decode step's projections (small_matmul.c).

Built on first use by kvport.native (the machine's C compiler, cached per CPU) and loaded with
ctypes, which releases the GIL for the call. The library links OpenMP: torch has loaded its
libgomp already, so the kernel runs on torch's own thread team (`torch.set_num_threads` applies).

Where it cannot be built or run (no compiler, another dtype), `decode_attention` and
`small_matmul` return None and `store_kv` False: the caller takes the torch path, after one
warning. `KVPORT_NATIVE_KERNELS=0` turns them all off. The kernels read host memory: for tensors
on a GPU, `decode_attention` and `store_kv` return None / False too (torch's path runs there;
handing C a device pointer would read garbage or crash), and `small_matmul` only ever sees the
CPU's packed weights (kvport.model.linear).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvport import native
from kvport.model import kernel_checks

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_attention.c", "small_matmul.c"))
# -ffast-math lets the sums use several accumulators and the exponentials vectorize (a third
# faster). It is a compile flag only: linked with it, gcc adds crtfastmath.o, which sets
# flush-to-zero for the whole process when the library loads, and torch's arithmetic changes.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c11", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
LIBRARY = native.NativeLibrary(
    "kernels", SOURCES, COMPILE_FLAGS, LINK_FLAGS,
    "decode attention and the decode projections take the slower torch paths")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class _Geometry(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "n", "heads", "kv_heads", "head_dim", "block_size", "table_len", "q_tok", "q_head",
        "kv_block", "kv_kv", "kv_tok", "kv_head", "o_tok", "o_head", "num_blocks")] + [
        ("scale", ctypes.c_float), ("bf16", ctypes.c_int32)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.load(LIBRARY)
    if lib is None:
        return None
    fn = lib.kvport_decode_attention
    fn.argtypes = [ctypes.POINTER(_Geometry)] + [ctypes.c_void_p] * 6
    fn.restype = ctypes.c_int
    store = lib.kvport_store_kv
    store.argtypes = [ctypes.POINTER(_Geometry), *[ctypes.c_void_p] * 4, ctypes.c_int64,
                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    store.restype = ctypes.c_int64
    matmul = lib.kvport_small_matmul
    matmul.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    matmul.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def _on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels may read these tensors: host memory only."""
    return all(t.device.type == "cpu" for t in tensors)


def decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of q (n, heads, head_dim), one query per sequence, over the first lens[i] keys
    of sequence i's blocks in `layer_cache` (blocks, 2, block_size, kv_heads, head_dim), a
    strided view of the pool; None where the kernel cannot run (take the torch path). A length
    beyond its table or a block id outside the pool raises KernelInputError (a ValueError)."""
    lib = _library()
    if (lib is None or q.dtype not in DTYPES or layer_cache.dtype != q.dtype
            or not _on_cpu(q, layer_cache, block_tables, lens)):
        return None
    kernel_checks.check_decode(q, layer_cache, block_tables, lens)
    n, heads, head_dim = q.shape
    num_blocks, _, block_size, kv_heads, _ = layer_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    geometry = _Geometry(
        n, heads, kv_heads, head_dim, block_size, block_tables.shape[1], q.stride(0),
        q.stride(1), layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2),
        layer_cache.stride(3), out.stride(0), out.stride(1), num_blocks, scale, DTYPES[q.dtype])
    where = (ctypes.c_int64 * 2)(-1, -1)
    rc = lib.kvport_decode_attention(ctypes.byref(geometry), q.data_ptr(),
                                     layer_cache.data_ptr(), block_tables.data_ptr(),
                                     lens.data_ptr(), out.data_ptr(), where)
    if rc > 0:  # an id or length out of range: C read nothing
        raise kernel_checks.table_error(rc, (where[0], where[1]), block_tables, lens, num_blocks,
                                        block_size)
    return out if rc == 0 else None


def store_kv(layer_cache: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> bool:
    """layer_cache[slot_blocks[t], 0 / 1, slot_offsets[t]] = k[t] / v[t] for every token t (k, v:
    (T, kv_heads, head_dim), heads side by side); False where the kernel cannot (torch path). A
    slot outside the pool raises KernelInputError (a ValueError), nothing written."""
    lib = _library()
    if (lib is None or not (k.dtype == v.dtype == layer_cache.dtype)
            or not _on_cpu(layer_cache, slot_blocks, slot_offsets, k, v)):
        return False
    kernel_checks.check_store(layer_cache, slot_blocks, slot_offsets, k, v)
    t, kv_heads, head_dim = k.shape
    num_blocks, _, block_size = layer_cache.shape[:3]
    geometry = _Geometry(n=t, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                         kv_block=layer_cache.stride(0), kv_kv=layer_cache.stride(1),
                         kv_tok=layer_cache.stride(2), kv_head=layer_cache.stride(3),
                         num_blocks=num_blocks)
    bad = lib.kvport_store_kv(ctypes.byref(geometry), layer_cache.data_ptr(),
                              slot_blocks.data_ptr(), slot_offsets.data_ptr(), k.data_ptr(),
                              k.stride(0), v.data_ptr(), v.stride(0), k.element_size())
    if bad >= 0:
        raise kernel_checks.slot_error(bad, slot_blocks, slot_offsets, num_blocks, block_size)
    return True


TILE = 16  # output columns per tile of a small-matmul weight (small_matmul.c)


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """(n, k) float32 -> (ceil(n / 16), k, 16), the layout `small_matmul` reads: tile t holds
    output columns 16 t .. 16 t + 15, zero-padded past n."""
    n, k = weight.shape
    tiles = -(-n // TILE)
    padded = weight.new_zeros(tiles * TILE, k)
    padded[:n] = weight
    return padded.view(tiles, TILE, k).transpose(1, 2).contiguous()


def untile_weight(tiled: torch.Tensor, n: int) -> torch.Tensor:
    """W^T (k, n) for torch's matmuls, from the tiles: one copy of the weight (a strided view of
    it where n was padded)."""
    tiles, k, _ = tiled.shape
    return tiled.permute(1, 0, 2).reshape(k, tiles * TILE)[:, :n]


def small_matmul(x: torch.Tensor, tiled: torch.Tensor, bias: torch.Tensor | None, n: int
                 ) -> torch.Tensor | None:
    """x (m, k) float32 @ W^T (+ bias) -> (m, n), W tiled by `tile_weight`; None where the
    kernel is not built (take torch's matmul)."""
    lib = _library()
    if lib is None:
        return None
    kernel_checks.check_matmul(x, tiled, bias, n, TILE)
    m, k = x.shape
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    lib.kvport_small_matmul(x.data_ptr(), tiled.data_ptr(),
                            None if bias is None else bias.data_ptr(), y.data_ptr(), m, k, n)
    return y
