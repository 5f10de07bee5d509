"""Random weights that are the same bytes on every machine, for the builtin checkpoints."""

from __future__ import annotations

import torch


def uniform(gen: torch.Generator, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    """Uniform in [-bound, bound) from integer draws only, so the bytes are the same on every
    machine (torch's float samplers take vectorized code paths that differ between CPUs)."""
    ints = torch.randint(0, 1 << 24, shape, generator=gen, dtype=torch.int64)
    return (ints.to(torch.float32) / (1 << 23) - 1.0) * bound  # exact up to the final product
