"""run_in_parts: consecutive parts at once, results in order, none still running at the end."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvport.connectors.offloading.tiers.parts import run_in_parts


@pytest.mark.parametrize("n,k", [(7, 3), (2, 2), (10, 1), (5, 5)])
def test_parts_cover_the_range_in_order(n: int, k: int) -> None:
    with ThreadPoolExecutor(max(1, k - 1)) as helpers:
        got = run_in_parts(n, k, lambda lo, hi: list(range(lo, hi)), helpers)
    assert len(got) == k and [i for part in got for i in part] == list(range(n))
    assert all(part for part in got)  # no empty part while n >= k


def test_a_helpers_exception_is_raised() -> None:
    def part(lo: int, hi: int) -> int:
        if lo > 0:
            raise ValueError("helper part")
        return hi

    with ThreadPoolExecutor(1) as helpers, pytest.raises(ValueError, match="helper part"):
        run_in_parts(4, 2, part, helpers)


def test_every_part_has_ended_when_the_callers_part_raises() -> None:
    """The caller's part raises while the helper's part still runs; the call raises only after
    the helper's part ended (it writes into memory the caller hands on). The helper's part
    holds until the test, after the call, releases it, or for HOLD_S: so only a call that
    waits for it sees it end first."""
    started, released, order = threading.Event(), threading.Event(), []

    def part(lo: int, hi: int) -> None:
        if lo == 0:
            assert started.wait(10.0), "the helper's part never started"
            raise RuntimeError("caller part")
        started.set()
        released.wait(HOLD_S)
        order.append("helper ended")

    with ThreadPoolExecutor(1) as helpers:
        with pytest.raises(RuntimeError, match="caller part"):
            run_in_parts(2, 2, part, helpers)
        order.append("call ended")
        released.set()
    assert order == ["helper ended", "call ended"]


HOLD_S = 0.2
