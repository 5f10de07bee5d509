"""Linear layers with their weights packed once, at load, in the layout their kernels read.

`torch.nn.functional.linear` on the CPU hands a float32 matmul to MKL's sgemm, which repacks the
weight matrix into its blocked layout on every call. For the few rows of a decode step that
repacking is most of the work: SmolLM2-135M's projections at 8 rows ran at 6-15 GB/s of weight
reads against 28-33 GB/s that this machine's two cores read (2026-12-01, AMD EPYC Zen 3 VM).

Two packings, one per layer, chosen at load:
- Tiled (`kernels.tile_weight`), where the native kernels build: up to SMALL_ROWS rows (decode
  steps, short prefill chunks) go to `small_matmul.c`, which streams each 16-column tile of the
  weight once, at 20-31 GB/s (oneDNN on the same weights, cold: 13.6-18 GB/s at 8 and 1 rows).
  More rows (long prefill chunks) view the tiles as W^T, copy that once per call (2 % of a
  2048-token prefill's multiply) and multiply with `torch.mm`, at 150-185 GFLOP/s here.
- oneDNN (`mkldnn._reorder_linear_weight`, then `mkldnn._linear_pointwise`) otherwise, and for
  half precision on CPUs with native half-precision kernels: a batch-8 decode step went from 131
  to 67 ms with it against torch's linear.

`pack_linears(model)` replaces every `nn.Linear` of a loaded model by a `PackedLinear` that holds
the packed weight only (the original is dropped: no second copy of the model in memory).

bfloat16 and float16 need CPU support in oneDNN (AVX-512 BF16/FP16, AMX, AVX-NE-CONVERT).
Without it torch's own half-precision matmul is a slow fallback (19 GFLOP/s here, against 170
in float32), so a half-precision weight is packed as float32 instead and the activations are
widened for the multiply and rounded back after it. The products of two half-precision numbers
are exact in float32 and the sums accumulate in float32, as in native half-precision kernels:
only the summation order differs. It reads twice the weight bytes of a native kernel.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvport.model import kernels

logger = logging.getLogger(__name__)

# Rows the packed layout is chosen for. oneDNN accepts any row count against a packed weight;
# the hint only picks the blocking (docs/engine-speed.md: the hints measured alike).
PACK_ROWS_HINT = 64
# Up to this many rows the tiled kernel runs: below a few hundred rows it beats copying the
# tiles back to W^T for torch.mm (docs/engine-speed.md has the crossover measured).
SMALL_ROWS = 256


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear ops (x86 and most aarch64 wheels)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def native_half(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` natively on this CPU (float32 always)."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W packed once (tiled or for oneDNN); x and y in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # The dtype the multiply runs in: the model's, or float32 where the CPU lacks it.
        self.compute_dtype = weight.dtype if native_half(weight.dtype) else torch.float32
        w = weight.detach().to(self.compute_dtype).contiguous()
        tiled = self.compute_dtype == torch.float32 and kernels.available()
        self.register_buffer("tiled_weight", kernels.tile_weight(w) if tiled else None)
        self.register_buffer("packed_weight", None if tiled
                             else torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT))
        self.register_buffer("bias", None if bias is None
                             else bias.detach().to(self.compute_dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if x2.shape[0] == 0:  # oneDNN rejects empty inputs
            return x.new_empty((*lead, self.out_features))
        if self.tiled_weight is None:
            y = torch.ops.mkldnn._linear_pointwise(
                x2, self.packed_weight, self.bias, "none", [], "")
        elif x2.shape[0] <= SMALL_ROWS:
            y = kernels.small_matmul(x2, self.tiled_weight, self.bias, self.out_features)
            assert y is not None, "a tiled weight without the kernel that reads it"
        else:  # a long prefill chunk: the tiles copied back to W^T once, then torch's matmul
            wt = kernels.untile_weight(self.tiled_weight, self.out_features)
            y = torch.mm(x2, wt) if self.bias is None else torch.addmm(self.bias, x2, wt)
        return y.to(self.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"dtype={self.dtype}, compute_dtype={self.compute_dtype}")


def try_pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """A PackedLinear of these weights, or None (logged) where oneDNN refuses them: the caller
    keeps torch's linear then."""
    try:
        return PackedLinear(weight, bias)
    except RuntimeError as exc:  # e.g. a CPU or dtype this oneDNN build does not take
        logger.warning("oneDNN cannot pack a %s weight of shape %s (%s); using torch's linear",
                       weight.dtype, tuple(weight.shape), exc)
        return None


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear below `module` by its packed form; returns how many it packed
    (0 where oneDNN is missing: the model then keeps torch's linear)."""
    if not onednn_available():
        logger.info("torch has no oneDNN linear ops; linear layers stay torch's")
        return 0
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (packed := try_pack(child.weight, child.bias)):
                setattr(parent, name, packed)
                count += 1
    return count
