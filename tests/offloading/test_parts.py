"""run_in_parts: consecutive ranges pulled by the caller and its helpers, results in order,
threads at once, a late helper not waited for, none still running at the end."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvport.connectors.offloading.tiers.parts import RANGES_PER_THREAD, run_in_parts

HOLD_S = 0.2


@pytest.mark.parametrize("n,k", [(7, 3), (2, 2), (10, 1), (5, 5), (40, 2)])
def test_ranges_cover_the_range_in_order(n: int, k: int) -> None:
    with ThreadPoolExecutor(max(1, k - 1)) as helpers:
        got = run_in_parts(n, k, lambda lo, hi: list(range(lo, hi)), helpers)
    assert len(got) == min(n, RANGES_PER_THREAD * k)
    assert [i for part in got for i in part] == list(range(n))
    assert all(part for part in got)  # no empty range


def test_the_caller_and_a_helper_run_ranges_at_once() -> None:
    """The first two ranges each wait until two threads are inside a range: only ranges that
    run at the same time on two threads get past it."""
    both = threading.Barrier(2, timeout=10.0)
    threads: set[str] = set()

    def part(lo: int, hi: int) -> int:
        threads.add(threading.current_thread().name)
        if lo < 2:
            both.wait()
        return hi - lo

    with ThreadPoolExecutor(1, "helper") as helpers:
        assert sum(run_in_parts(8, 2, part, helpers)) == 8
    assert len(threads) == 2


def test_a_helper_that_has_not_started_is_not_waited_for() -> None:
    """The only helper thread is busy (another call's work) until the test, after the call,
    frees it, or for 2 s: the caller takes every range itself and returns while the helper is
    still busy; the queued task is dropped. A call that waited for it would end after it."""
    busy, released, order = threading.Event(), threading.Event(), []

    def other_work() -> None:
        busy.set()
        released.wait(2.0)
        order.append("helper free")

    with ThreadPoolExecutor(1) as helpers:
        helpers.submit(other_work)
        assert busy.wait(10.0)
        ran_on = []
        got = run_in_parts(4, 2, lambda lo, hi: ran_on.append(threading.current_thread().name),
                           helpers)
        order.append("call ended")
        released.set()
    assert order == ["call ended", "helper free"]
    assert len(got) == 4 and set(ran_on) == {threading.current_thread().name}


def test_a_helpers_exception_is_raised_and_no_range_starts_after_it() -> None:
    started: list[int] = []
    caller_in, helper_failed = threading.Event(), threading.Event()

    def part(lo: int, hi: int) -> int:
        started.append(lo)
        if threading.current_thread() is not threading.main_thread():
            assert caller_in.wait(10.0)  # each thread in one range, whichever came first
            helper_failed.set()
            raise ValueError("helper part")
        caller_in.set()
        assert helper_failed.wait(10.0)  # the caller's range ends once the helper's failed
        return hi

    with ThreadPoolExecutor(1) as helpers, pytest.raises(ValueError, match="helper part"):
        run_in_parts(8, 2, part, helpers)
    assert len(started) == 2  # one range each; none taken after the failure


def test_every_part_has_ended_when_the_callers_part_raises() -> None:
    """The caller's range raises while the helper's range still runs; the call raises only
    after the helper's range ended (it writes into memory the caller hands on). The helper's
    range holds until the test, after the call, releases it, or for HOLD_S: so only a call
    that waits for it sees it end first."""
    started, released, order = threading.Event(), threading.Event(), []

    def part(lo: int, hi: int) -> None:
        if threading.current_thread() is threading.main_thread():
            assert started.wait(10.0), "the helper's range never started"
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
