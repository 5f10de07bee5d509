"""What the native kernels (paged_attention.c, small_matmul.c) need of their arguments, checked
in front of each call, and the errors for the ids the C side refuses.

The C code trusts shapes, strides and dtypes: these are ValueErrors here, not asserts (which
`python -O` strips). Block ids and slots are checked by the C code itself, which returns a code
having touched nothing; `table_error` and `slot_error` turn that code into a ValueError naming
the bad id and its bound.
"""

from __future__ import annotations

import torch


class KernelInputError(ValueError, IndexError):
    """An argument the native kernels refuse: a shape they cannot read, or an id outside the
    pool. A ValueError (a bad argument) and an IndexError (what indexing raises)."""


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise KernelInputError(message)


def check_decode(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                 lens: torch.Tensor) -> None:
    """decode_attention's shapes: q (n, heads, head_dim), the pool's layer view (blocks, 2,
    block_size, kv_heads, head_dim) with the head dimension contiguous, int64 tables and lens."""
    _need(q.dim() == 3 and layer_cache.dim() == 5,
          f"q {tuple(q.shape)} and the pool's layer view {tuple(layer_cache.shape)}: 3-D and 5-D")
    n, heads, head_dim = q.shape
    _, two, block_size, kv_heads, d = layer_cache.shape
    _need(two == 2 and d == head_dim and kv_heads > 0 and heads % kv_heads == 0
          and block_size > 0,
          f"q {tuple(q.shape)} does not fit the pool's layer view {tuple(layer_cache.shape)}")
    _need(q.stride(-1) == 1 and layer_cache.stride(-1) == 1 and layer_cache.stride(-2) == d,
          "the head dimension must be contiguous")
    _need(block_tables.dtype == lens.dtype == torch.int64 and block_tables.dim() == 2
          and block_tables.is_contiguous() and lens.is_contiguous()
          and block_tables.shape[0] == lens.shape[0] == n,
          f"block tables {tuple(block_tables.shape)} {block_tables.dtype} and lengths "
          f"{tuple(lens.shape)} {lens.dtype}: contiguous int64, one row per sequence of {n}")


def check_store(layer_cache: torch.Tensor, slot_blocks: torch.Tensor,
                slot_offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """store_kv's shapes: k, v (T, kv_heads, head_dim) rows contiguous, one int64 slot each."""
    _need(k.dim() == 3 and layer_cache.dim() == 5,
          f"K {tuple(k.shape)} and the pool's layer view {tuple(layer_cache.shape)}: 3-D and 5-D")
    t, kv_heads, head_dim = k.shape
    _need(v.shape == k.shape and layer_cache.shape[1] == 2
          and layer_cache.shape[3:] == (kv_heads, head_dim),
          f"K/V {tuple(k.shape)} do not fit the pool's layer view {tuple(layer_cache.shape)}")
    _need(k.stride()[1:] == v.stride()[1:] == (head_dim, 1)
          and layer_cache.stride()[3:] == (head_dim, 1), "K/V rows must be contiguous per token")
    _need(slot_blocks.dtype == slot_offsets.dtype == torch.int64
          and slot_blocks.is_contiguous() and slot_offsets.is_contiguous()
          and len(slot_blocks) == len(slot_offsets) == t,
          f"one int64 slot per token: {t} tokens, {len(slot_blocks)} blocks "
          f"({slot_blocks.dtype}), {len(slot_offsets)} offsets ({slot_offsets.dtype})")


def check_matmul(x: torch.Tensor, tiled: torch.Tensor, bias: torch.Tensor | None, n: int,
                 tile: int) -> None:
    """small_matmul's shapes: x (m, k) float32 against a weight tiled (tiles, k, tile)."""
    _need(x.dim() == 2 and tiled.dim() == 3, f"x {tuple(x.shape)}: 2-D, the tiles 3-D")
    k = x.shape[1]
    _need(x.dtype == tiled.dtype == torch.float32 and tiled.shape[1:] == (k, tile)
          and 0 <= n <= tiled.shape[0] * tile and tiled.is_contiguous(),
          f"x {tuple(x.shape)} {x.dtype} does not fit the tiled weight {tuple(tiled.shape)}")
    _need(bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)
                           and bias.is_contiguous()), "bias: contiguous float32, one per column")


BAD_LEN, BAD_BLOCK = 1, 2  # kvport_check_tables' codes (paged_attention.c)


def table_error(code: int, where: tuple[int, int], block_tables: torch.Tensor,
                lens: torch.Tensor, num_blocks: int, block_size: int) -> KernelInputError:
    """The error for kvport_decode_attention's code > 0 at `where` (sequence, table column)."""
    i, column = where
    table_len = block_tables.shape[1]
    if code == BAD_LEN:
        return KernelInputError(
            f"sequence {i}: {int(lens[i])} keys, outside [0, {table_len * block_size}] (its "
            f"block table holds {table_len} blocks of {block_size})")
    if code == BAD_BLOCK:
        return KernelInputError(
            f"sequence {i}: block table entry {column} is block {int(block_tables[i, column])}, "
            f"out of range [0, {num_blocks})")
    return KernelInputError(f"decode attention refused its input (code {code})")


def slot_error(t: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, num_blocks: int,
               block_size: int) -> KernelInputError:
    """The error for kvport_store_kv's refusal of token t."""
    return KernelInputError(
        f"token {t}: slot (block {int(slot_blocks[t])}, offset {int(slot_offsets[t])}) out of "
        f"range: blocks [0, {num_blocks}), offsets [0, {block_size})")
