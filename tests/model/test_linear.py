"""Prepacked linear layers (kvport.model.linear): same products as torch's linear, tiled for the
native small matmul or packed for oneDNN, the model's weights packed once and the unpacked copies
dropped, and torch's linear where oneDNN is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_models import hf_logits, kvport_logits, make_random_hf_model, sample_prompts
from needs import native_switched_off, require
from torch import nn

import kvport.model.linear as linear_mod
import kvport.model.llama as llama_mod
from kvport.model import kernels
from kvport.model.linear import (SMALL_ROWS, PackedLinear, native_half, onednn_available,
                                 pack_linears)
from kvport.model.loader import load_model

@pytest.fixture
def onednn() -> None:
    """The torch CI installs (the CPU wheel of torch 2.13, README) has oneDNN's linear ops: a
    torch without them fails these tests rather than skipping them."""
    require(onednn_available(), "this torch has no oneDNN linear ops (install the CPU wheel of "
                                "torch 2.13, as the README says)")


needs_onednn = pytest.mark.usefixtures("onednn")


@pytest.fixture(params=["tiled", "onednn"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both packings of a float32 weight: tiled where the native kernels build, else oneDNN."""
    if request.param == "tiled":
        if native_switched_off():
            pytest.skip("native code switched off on purpose (KVPORT_NATIVE_KERNELS=0)")
        require(kernels.available(), "the native kernels did not build (kvport.native warned)")
    if request.param == "onednn":
        monkeypatch.setattr(kernels, "available", lambda: False)
    return str(request.param)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, SMALL_ROWS, SMALL_ROWS + 1, 300])
def test_packed_float32_equals_torch_linear(rows: int, bias: bool, packing: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(90, 40, generator=gen)  # 90: the last 16-column tile is partly padding
    b = torch.randn(90, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    layer = PackedLinear(w, b)
    assert (layer.tiled_weight is not None) == (packing == "tiled")
    assert (layer.packed_weight is not None) == (packing == "onednn")
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 90)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_rounded_like_a_half_precision_matmul(dtype: torch.dtype,
                                                                packing: str) -> None:
    # Natively, or widened to float32 where this CPU lacks half-precision oneDNN kernels: either
    # way the float32 product of the half-precision inputs, accumulated in float32, rounded once.
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(64, 48, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    layer = PackedLinear(w, b)
    assert layer.compute_dtype == (dtype if native_half(dtype) else torch.float32)
    got = layer(x)
    assert got.dtype == dtype
    exact = F.linear(x.double(), w.double(), b.double())
    # one rounding to half precision (2^-8 relative for bfloat16) plus float32 sums
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    assert ((got.double() - exact).abs() <= tol * exact.abs() + 1e-3).all()


@needs_onednn
def test_packed_takes_empty_and_batched_inputs(packing: str) -> None:
    w = torch.randn(16, 8)
    layer = PackedLinear(w, None)
    assert layer(torch.empty(0, 8)).shape == (0, 16)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, w))


@needs_onednn
def test_pack_linears_replaces_every_linear_and_drops_its_weight() -> None:
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(3, 8)
    want = net(x)
    assert pack_linears(net) == 2
    assert not any(isinstance(m, nn.Linear) for m in net.modules())
    assert not any(n.endswith("weight") for n, _ in net.named_parameters())
    torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_loaded_model_is_packed_with_a_packed_tied_head(tmp_path: Path) -> None:
    model_dir = make_random_hf_model(tmp_path, "llama", tie_word_embeddings=True)
    model = load_model(str(model_dir), torch.float32).model
    assert model is not None
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    assert model.lm_head is None and isinstance(model.tied_head, PackedLinear)
    # the embedding stays a plain matrix for the token lookups
    assert model.embed_tokens.weight.layout == torch.strided
    model.pack_weights()  # idempotent
    assert isinstance(model.tied_head, PackedLinear)


def test_without_onednn_the_model_keeps_torchs_linear(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch build without oneDNN (or an op it lacks) is not an error: the model runs as before,
    # bit for bit transformers' products.
    monkeypatch.setattr(linear_mod, "onednn_available", lambda: False)
    monkeypatch.setattr(llama_mod, "onednn_available", lambda: False)
    model_dir = make_random_hf_model(tmp_path, "qwen2")
    model = load_model(str(model_dir), torch.float32).model
    assert model is not None
    assert isinstance(model.layers[0].self_attn.qkv_proj, nn.Linear) and model.tied_head is None
    prompts = sample_prompts(seed=2, lengths=(6, 11))
    for a, b in zip(kvport_logits(model, prompts), hf_logits(model_dir, prompts), strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_a_weight_onednn_refuses_falls_back_to_torchs_linear(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(*_: object) -> None:
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr(PackedLinear, "__init__", refuse)
    monkeypatch.setattr(linear_mod, "onednn_available", lambda: True)
    net = nn.Sequential(nn.Linear(8, 4))
    x = torch.randn(2, 8)
    want = net(x)
    assert pack_linears(net) == 0
    assert isinstance(net[0], nn.Linear)
    assert torch.equal(net(x), want)
    assert "using torch's linear" in caplog.text
