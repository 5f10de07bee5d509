"""Several passes of a workload benchmark as one run: each configuration's requests pooled and its
counters summed, so the tables' percentiles and rates are over every pass's requests.

One pass of the default long-doc has 16 repeated queries per configuration; a p50 of 16 timings
on a shared 2-core VM moved by 25 % between runs of the same code (BENCHMARKS.md, issue 13).
Passes run with fresh engines and tiers and the same requests, so pooling them is the same
workload asked again, not a warmer one. The targets are not judged on the pooled tables but on
the median of the passes' own ratios (`report.judge_over_passes`): a machine whose speed drifts
between passes shifts every configuration's pooled percentile by a different amount.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from kvport.bench.serving import metrics_sum


def pool_outcomes(passes: list[dict[str, dict[str, Any]]],
                  num_phases: int) -> dict[str, dict[str, Any]]:
    """Each configuration's outcomes (as `workload_bench` collects them) of every pass as one
    outcome. Pass k's phases are numbered on from k * num_phases, so a phase still names one
    round of one pass; busy time and counters add up. A configuration missing from a pass (its
    engine failed) is left out."""
    assert passes, "pool_outcomes needs at least one pass"
    assert num_phases >= 1, f"num_phases must be >= 1, got {num_phases}"
    names = [n for n in passes[0] if all(n in p for p in passes)]
    pooled: dict[str, dict[str, Any]] = {}
    for name in names:
        outs = [p[name] for p in passes]
        for k, o in enumerate(outs):
            assert all(0 <= ph < num_phases for ph in o["phase_busy_s"]), \
                f"{name}: pass {k} has phases outside 0..{num_phases - 1}"
        evicted = [o["engine_evicted_blocks"] for o in outs]
        pooled[name] = {
            **outs[0],  # what every pass has alike: the config, ideal or not
            "records": [dataclasses.replace(r, phase=k * num_phases + r.phase)
                        for k, o in enumerate(outs) for r in o["records"]],
            "busy_s": sum(o["busy_s"] for o in outs),
            "phase_busy_s": {k * num_phases + ph: s for k, o in enumerate(outs)
                             for ph, s in o["phase_busy_s"].items()},
            "metrics": functools.reduce(metrics_sum, [o["metrics"] for o in outs]),
            "engine_evicted_blocks": None if None in evicted else sum(evicted),
            "resets_unsupported": sum(o["resets_unsupported"] for o in outs),
        }
    return pooled
