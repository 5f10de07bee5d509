"""The native decode attention (kvport.model.kernels, paged_attention.c) against plain attention,
its fallbacks, and the engine's output with it and without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvport import LLM, SamplingParams
from kvport.model import kernels


def reference(q: torch.Tensor, layer: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense float64 attention of each row over its first lens[i] keys, gathered block by block."""
    n, heads, d = q.shape
    bs, kvh = layer.shape[2], layer.shape[3]
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        keys = layer[tables[i], 0].reshape(-1, kvh, d)[: lens[i]].double()  # (len, kvh, d)
        vals = layer[tables[i], 1].reshape(-1, kvh, d)[: lens[i]].double()
        for h in range(heads):
            kv_head = h // (heads // kvh)
            w = torch.softmax(keys[:, kv_head] @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ vals[:, kv_head]
    return out


def make_case(n: int, heads: int, kv_heads: int, block_size: int, lens: list[int],
              dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    d, blocks, layers = 32, 40, 3
    pool = torch.randn(blocks, layers, 2, block_size, kv_heads, d, generator=gen).to(dtype)
    width = max(-(-x // block_size) for x in lens) + 1  # padded like the runner's tables
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in range(n)])
    # q as the model hands it over: a strided view into a wider projection output
    wide = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = wide[:, : heads * d].view(n, heads, d)
    return q, pool[:, 1], tables, torch.tensor(lens, dtype=torch.int64)


# Every machine kvport supports has a C compiler (README): a kernel that does not build fails
# these tests, unless it was switched off on purpose.
needs_kernel = pytest.mark.skipif(os.environ.get("KVPORT_NATIVE_KERNELS") == "0",
                                  reason="KVPORT_NATIVE_KERNELS=0")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("n", [1, 5])  # one sequence: split over its KV heads; five: one each
def test_decode_attention_equals_attention(dtype: torch.dtype, heads: int, kv_heads: int,
                                           n: int) -> None:
    lens = [1, 16, 17, 40, 63][:n]  # one key, whole blocks, a partial last block
    q, layer, tables, lens_t = make_case(n, heads, kv_heads, 16, lens, dtype, seed=heads + n)
    got = kernels.decode_attention(q, layer, tables, lens_t, 0.3)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    want = reference(q, layer, tables, lens_t, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7  # float32 sums; one bfloat16 rounding
    assert ((got.double() - want).abs() <= tol * want.abs().clamp(min=1.0)).all()


@needs_kernel
def test_decode_attention_reads_large_blocks_and_no_rows() -> None:
    q, layer, tables, lens = make_case(2, 6, 2, 128, [130, 255], torch.float32)
    got = kernels.decode_attention(q, layer, tables, lens, 0.2)
    assert got is not None
    torch.testing.assert_close(got.double(), reference(q, layer, tables, lens, 0.2), rtol=1e-5,
                               atol=1e-6)
    empty = kernels.decode_attention(q[:0], layer, tables[:0], lens[:0], 0.2)
    assert empty is not None and empty.shape == (0, 6, 32)


@needs_kernel
def test_loading_the_kernel_leaves_the_processs_float_arithmetic_alone() -> None:
    # Linked with -ffast-math, a shared library switches the whole process to flush-to-zero when
    # it loads: torch's and numpy's subnormals would silently become 0.
    assert kernels.available()
    tiny = torch.tensor([1e-40])
    assert (tiny * 1.0).item() != 0.0


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300: split over the threads
def test_store_kv_writes_what_index_put_writes(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    pool = torch.randn(50, 3, 2, 16, 2, 8, generator=gen).to(dtype)
    expected = pool.clone()
    slots = torch.randperm(50 * 16, generator=gen)[:tokens]  # distinct (block, offset) pairs
    blocks, offsets = slots // 16, slots % 16
    qkv = torch.randn(tokens, 6 * 8, generator=gen).to(dtype)  # k, v: views as the model has
    k, v = qkv[:, 2 * 8:4 * 8].view(tokens, 2, 8), qkv[:, 4 * 8:].view(tokens, 2, 8)
    assert kernels.store_kv(pool[:, 1], blocks, offsets, k, v)
    expected[blocks, 1, 0, offsets] = k
    expected[blocks, 1, 1, offsets] = v
    assert torch.equal(pool, expected)


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 40, 16), (5, 33, 37), (8, 64, 96), (9, 40, 3),
                                           (33, 17, 50)])  # 9, 33: a second pass of 8 rows
def test_small_matmul_equals_a_float64_product(m: int, k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * k + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    tiled = kernels.tile_weight(w)
    assert tiled.shape == (-(-n // 16), k, 16)
    got = kernels.small_matmul(x, tiled, b, n)
    assert got is not None and got.shape == (m, n)
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    # float32 sums over k terms of size ~1: a few ulps of the sum of magnitudes
    bound = 4 * k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t() + 1)
    assert ((got.double() - exact).abs() <= bound).all()


def test_tiled_weights_read_back_as_the_transposed_matrix() -> None:
    w = torch.randn(37, 9)
    tiled = kernels.tile_weight(w)
    assert torch.equal(tiled[2, :, :5], w[32:].t()) and not tiled[2, :, 5:].any()  # zero pad
    assert torch.equal(kernels.untile_weight(tiled, 37), w.t())


@needs_kernel
def test_store_kv_leaves_k_v_of_another_dtype_than_the_pools_to_torch() -> None:
    # The kernel copies bytes: K/V in another dtype than the pool's must be converted (index_put).
    pool = torch.zeros(4, 2, 2, 16, 2, 8)
    k = v = torch.ones(3, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2])
    assert not kernels.store_kv(pool[:, 0], slots, slots, k, v)
    assert not pool.any()


def test_other_dtypes_take_the_torch_path() -> None:
    q, layer, tables, lens = make_case(2, 4, 2, 16, [5, 9], torch.float16)
    assert kernels.decode_attention(q, layer, tables, lens, 0.5) is None


def test_without_a_compiler_decode_attention_falls_back_with_a_warning(
        no_c_compiler: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tmp_path = no_c_compiler
    kernels._library.cache_clear()
    try:
        q, layer, tables, lens = make_case(1, 4, 2, 16, [5], torch.float32)
        assert kernels.decode_attention(q, layer, tables, lens, 0.5) is None
        assert "torch path" in caplog.text
        monkeypatch.setenv("KVPORT_NATIVE_KERNELS", "0")
        monkeypatch.delenv("CC")
        kernels._library.cache_clear()
        assert not kernels.available()  # switched off: not even built
        assert not list(tmp_path.rglob("*.so"))
    finally:
        kernels._library.cache_clear()


@needs_kernel
def test_engine_output_is_the_same_with_and_without_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[5, 6, 7] * 9, [11, 12] * 20, [40] * 3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)

    def run() -> list[tuple[list[int], list[dict[int, float]]]]:
        llm = LLM("builtin:tiny-llama", num_kv_blocks=64)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            llm.engine.check_no_leaks()
            return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        finally:
            llm.shutdown()

    with_kernel = run()
    monkeypatch.setattr(kernels, "_library", lambda: None)  # every kernel: attention, KV, matmul
    without = run()
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(with_kernel, without, strict=True):
        assert tokens_a == tokens_b
        for a, b in zip(lp_a, lp_b, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) <= 1e-4 for t in a)
