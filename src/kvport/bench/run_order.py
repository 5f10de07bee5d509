"""The order in which side-by-side configurations run each phase of a workload benchmark.

A fixed order rotated each phase puts every configuration in every slot equally often, but always
right after the same one: `host` always ran right after `no-connector`'s long full prefills, and
`ideal` never did. This machine runs the slot right after another engine's run slower
(BENCHMARKS.md, connector overhead), so that was a carry-over effect on one configuration only.
The orders here are the rows of a Williams design: over n phases (2n for an odd n) every
configuration runs in every slot, and right after every other one, equally often."""

from __future__ import annotations


def run_order(n: int, phase: int) -> list[int]:
    """The positions 0..n-1 in the order they run in `phase`: row `phase` of a Williams design,
    the sequence 0, 1, n-1, 2, n-2, ... shifted by the row; for an odd n each row is followed by
    its mirror (so the first two phases already have each one after two different others)."""
    if n < 1:
        raise ValueError(f"need at least one configuration, got {n}")
    if phase < 0:
        raise ValueError(f"phase must be >= 0, got {phase}")
    base = [0]
    low, high = 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    shift, mirrored = (phase % n, False) if n % 2 == 0 else ((phase // 2) % n, phase % 2 == 1)
    row = [(x + shift) % n for x in base]
    return row[::-1] if mirrored else row
