"""The side-by-side run order of the workload benchmarks: a Williams design."""

from __future__ import annotations

from collections import Counter

import pytest

from kvport.bench.workload.passes import run_order


@pytest.mark.parametrize("n", range(1, 9))
def test_every_configuration_in_every_slot_and_after_every_other_equally_often(n: int) -> None:
    period = n if n % 2 == 0 else 2 * n
    rows = [run_order(n, phase) for phase in range(period)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    slots = Counter((x, slot) for row in rows for slot, x in enumerate(row))
    assert len(slots) == n * n and len(set(slots.values())) == 1
    after = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1
    assert [run_order(n, phase + period) for phase in range(period)] == rows


def test_an_odd_number_has_each_after_two_others_from_the_second_phase() -> None:
    """The default workloads run 3 (long-doc) or 5 (multi-turn) configurations for a few phases:
    none may follow the same one in every phase (a rotated fixed order did)."""
    for n in (3, 5):
        before = {row[i + 1]: row[i] for row in [run_order(n, 0)] for i in range(n - 1)}
        mirrored = {row[i + 1]: row[i] for row in [run_order(n, 1)] for i in range(n - 1)}
        assert all(before[x] != mirrored[x] for x in before if x in mirrored)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="at least one configuration, got 0"):
        run_order(0, 0)
    with pytest.raises(ValueError, match="phase must be >= 0, got -1"):
        run_order(3, -1)
