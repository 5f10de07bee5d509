"""Small statistics every benchmark reports with, each of which may meet a missing value (a
configuration that failed, a counter a connector does not keep): then None, never a guess."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100), linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1), nearest rank: always one of the values; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[rank]


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None if either is unknown or the base is 0."""
    return None if value is None or not base else value / base


def mean_or_none(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are known; None if none is."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None
