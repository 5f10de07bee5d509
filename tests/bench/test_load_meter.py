"""OtherLoadMeter: other processes' cores and the hypervisor's steal over a measured span."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvport.bench.common.machine import OtherLoadMeter


def test_other_load_and_steal_are_cores_over_the_wall_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # (machine busy s, our tree's s, wall s, stolen s): 2 s wall, 3 s busy of which 1.2 ours
    samples: Iterator[tuple[float, float, float, float]] = iter(
        [(10.0, 4.0, 100.0, 5.0), (13.0, 5.2, 102.0, 5.5)])
    monkeypatch.setattr(OtherLoadMeter, "_sample", staticmethod(lambda: next(samples)))
    meter = OtherLoadMeter()
    assert meter.steal_cores is None
    meter.start()
    assert meter.stop() == pytest.approx(0.9)
    assert meter.steal_cores == pytest.approx(0.25)


def test_without_proc_nothing_is_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OtherLoadMeter, "_sample",
                        staticmethod(lambda: (-1.0, 0.0, 1.0, 0.0)))
    meter = OtherLoadMeter()
    meter.start()
    assert meter.stop() is None and meter.steal_cores is None


def test_on_this_machine_both_are_read_from_proc() -> None:
    meter = OtherLoadMeter()
    meter.start()
    sum(i * i for i in range(200_000))  # some wall time
    other = meter.stop()
    assert other is not None and other >= 0.0
    assert meter.steal_cores is not None and meter.steal_cores >= 0.0
