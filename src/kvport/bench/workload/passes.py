"""Passes of a workload benchmark: the order configurations run each phase in, and several
passes pooled into one run.

Order. A fixed order rotated each phase puts every configuration in every slot equally often,
but always right after the same one (so `host` always ran right after `no-connector`'s long
full prefills, and `ideal` never did), and the slot right after another engine's run can run
slower: a carry-over effect on one configuration only. The orders here are the rows of a
Williams design: over n phases (2n for an odd n) every configuration runs in every slot, and
right after every other one, equally often.

Pooling. A p50 of the few repeated requests one pass has moves between runs of the same code on
a shared machine, so `--repeats` runs whole passes, with fresh engines and tiers and the same
requests: pooling them is the same workload asked again, not a warmer one. Each configuration's
requests are pooled and its counters summed, so the tables' percentiles and rates are over
every pass's requests. The targets are judged on the median of the passes' own ratios instead
(targets.judge_over_passes): a machine whose speed drifts between passes shifts every
configuration's pooled percentile by a different amount.
"""

from __future__ import annotations

import dataclasses
import functools

from kvport.bench.workload.serving import Outcome, metrics_sum


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


def pool_outcomes(passes: list[dict[str, Outcome]], num_phases: int) -> dict[str, Outcome]:
    """Each configuration's outcomes of every pass as one outcome. Pass k's phases are numbered
    on from k * num_phases, so a phase still names one round of one pass; busy time and counters
    add up. A configuration missing from a pass (its engine failed) is left out."""
    assert passes, "pool_outcomes needs at least one pass"
    assert num_phases >= 1, f"num_phases must be >= 1, got {num_phases}"
    names = [n for n in passes[0] if all(n in p for p in passes)]
    pooled: dict[str, Outcome] = {}
    for name in names:
        outs = [p[name] for p in passes]
        for k, o in enumerate(outs):
            assert all(0 <= ph < num_phases for ph in o.phase_busy_s), \
                f"{name}: pass {k} has phases outside 0..{num_phases - 1}"
        evicted = [o.engine_evicted_blocks for o in outs]
        pooled[name] = dataclasses.replace(
            outs[0],  # what every pass has alike: the config, ideal or not
            records=tuple(dataclasses.replace(r, phase=k * num_phases + r.phase)
                          for k, o in enumerate(outs) for r in o.records),
            busy_s=sum(o.busy_s for o in outs),
            phase_busy_s={k * num_phases + ph: s for k, o in enumerate(outs)
                          for ph, s in o.phase_busy_s.items()},
            metrics=functools.reduce(metrics_sum, [o.metrics for o in outs]),
            engine_evicted_blocks=None if None in evicted else sum(
                e for e in evicted if e is not None),
            resets_unsupported=sum(o.resets_unsupported for o in outs))
    return pooled
