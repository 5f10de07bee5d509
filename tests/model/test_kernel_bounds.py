"""The native decode attention and KV write (paged_attention.c) refuse every block id, slot and
length outside the pool, as block_copy.c does: a ValueError naming the id and its bound, and
nothing read or written. The pool here is a view into a larger tensor with a guard block on
each side, so an unchecked id would land in memory the test owns (and sees change) instead of
crashing the process."""

from __future__ import annotations

import pytest
import torch
from needs import native_switched_off, require

from kvport.model import kernels
from kvport.model.kernel_checks import KernelInputError

BLOCKS, LAYERS, BS, KVH, D, HEADS = 6, 2, 4, 2, 8, 4


@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    if native_switched_off():
        pytest.skip("native code switched off on purpose (KVPORT_NATIVE_KERNELS=0)")
    require(kernels.available(), "paged_attention.c did not build (kvport.native warned)")


def guarded_pool(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole allocation, layer 1's view of blocks 1 .. BLOCKS): blocks -1 and BLOCKS of
    the view are the guard blocks 0 and BLOCKS + 1 of the allocation."""
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(BLOCKS + 2, LAYERS, 2, BS, KVH, D, generator=gen).to(dtype)
    return whole, whole[1:BLOCKS + 1, 1]


def query(n: int) -> torch.Tensor:
    return torch.randn(n, HEADS, D, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bad", [BLOCKS, -1])
@pytest.mark.parametrize("column", [0, 2])
def test_decode_attention_refuses_a_block_outside_the_pool(bad: int, column: int) -> None:
    _, layer = guarded_pool()
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int64)
    tables[1, column] = bad
    lens = torch.tensor([5, 3 * BS], dtype=torch.int64)
    with pytest.raises(KernelInputError, match=rf"sequence 1: block table entry {column} is "
                                               rf"block {bad}, out of range \[0, {BLOCKS}\)"):
        kernels.decode_attention(query(2), layer, tables, lens, 0.5)


def test_only_the_blocks_a_sequence_reads_are_checked() -> None:
    """Tables are padded past a sequence's last block (the runner pads with block 0): a column
    beyond its length is never read, so whatever it holds is not an error."""
    _, layer = guarded_pool()
    tables = torch.tensor([[2, 99, -7]], dtype=torch.int64)
    assert kernels.decode_attention(query(1), layer, tables, torch.tensor([BS]), 0.5) is not None
    with pytest.raises(KernelInputError, match=r"entry 1 is block 99"):
        kernels.decode_attention(query(1), layer, tables, torch.tensor([BS + 1]), 0.5)


@pytest.mark.parametrize("length", [3 * BS + 1, -1])
def test_decode_attention_refuses_a_length_beyond_its_table(length: int) -> None:
    _, layer = guarded_pool()
    whole_tables = torch.tensor([[0, 1, 2], [3, 4, 5], [0, 0, 0]], dtype=torch.int64)
    tables = whole_tables[:2]  # an unchecked length would read row 2 as more of row 1
    lens = torch.tensor([2, length], dtype=torch.int64)
    with pytest.raises(KernelInputError, match=rf"sequence 1: {length} keys, outside "
                                               rf"\[0, {3 * BS}\] \(its block table holds 3 "
                                               rf"blocks of {BS}\)"):
        kernels.decode_attention(query(2), layer, tables, lens, 0.5)


@pytest.mark.parametrize(("block", "offset"), [(BLOCKS, 0), (-1, 3), (2, BS), (2, -1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_refuses_a_slot_outside_the_pool_and_writes_nothing(
        block: int, offset: int, dtype: torch.dtype) -> None:
    whole, layer = guarded_pool(dtype)
    before = whole.clone()
    k = torch.ones(3, KVH, D, dtype=dtype)
    blocks = torch.tensor([0, 1, block], dtype=torch.int64)
    offsets = torch.tensor([0, 1, offset], dtype=torch.int64)
    with pytest.raises(KernelInputError, match=rf"token 2: slot \(block {block}, offset "
                                               rf"{offset}\) out of range: blocks \[0, {BLOCKS}\), "
                                               rf"offsets \[0, {BS}\)"):
        kernels.store_kv(layer, blocks, offsets, k, k)
    assert torch.equal(whole, before)  # not even tokens 0 and 1: checked before any write


def test_bad_shapes_are_value_errors_not_asserts() -> None:
    """python -O strips asserts; these guard what the C code trusts."""
    _, layer = guarded_pool()
    tables = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="one row per sequence"):
        kernels.decode_attention(query(2), layer, tables, torch.tensor([1]), 0.5)
    with pytest.raises(ValueError, match="int64"):
        kernels.decode_attention(query(1), layer, tables.int(), torch.tensor([1]), 0.5)
    k = torch.ones(2, KVH, D)
    with pytest.raises(ValueError, match="one int64 slot per token"):
        kernels.store_kv(layer, torch.tensor([0]), torch.tensor([0]), k, k)
    tiled = kernels.tile_weight(torch.ones(20, 8))
    with pytest.raises(ValueError, match="does not fit the tiled weight"):
        kernels.small_matmul(torch.ones(2, 9), tiled, None, 20)
