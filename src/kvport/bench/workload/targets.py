"""The targets of the workload benchmarks: a configuration's figure over another's in the same
run must stay within a limit, for the engines a target names.

One pass scatters: a shared machine's speed moves while it runs. So each target also gets its
`spread` within the pass, the least and the largest of:
- for a figure of the later requests (rounds >= 2, repeated queries: phases that ask the same
  kind of request), its ratio in each of those phases (each phase compares both configurations
  back to back);
- for a figure over every phase, which mixes first and later requests whose ratios differ by
  design, its ratio over the pass without each one of its phases in turn.
Where the limit lies within that spread, one pass cannot decide: the target is not `judged`,
whatever side its ratio fell on.

With several passes (`--repeats`), a target's ratio is the median of its passes' ratios, and its
verdict that median's: each pass compares the configurations under one state of the machine,
phase by phase, while pooling the requests of passes that ran at different speeds mixes those
states. The pooled tables' ratio stays as `pooled_ratio`, each pass's as `pass_ratios`, their
range as the spread.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

from kvport.bench.common.command import JsonObject
from kvport.bench.common.stats import percentile, ratio
from kvport.bench.workload.config import BASELINE, IDEAL
from kvport.bench.workload.summary import ConfigSummary, later_phases


@dataclass(frozen=True)
class Target:
    """`config`'s `metric` over `against`'s in the same run must be <= `limit` (>= if
    `at_least`); checked only for the engines named."""

    workload: str
    config: str
    metric: str
    limit: float
    at_least: bool = False
    against: str = BASELINE
    engines: tuple[str, ...] = ("kvport", "vllm")


TARGETS = (
    Target("long-doc", "host", "ttft_p50_repeat_s", 1 / 8),
    Target("long-doc", "disk-cold-host", "ttft_p50_repeat_s", 1 / 5),
    # a document's KV from Redis (over the network, checked) still far below recomputing it
    Target("long-doc", "redis-cold-host", "ttft_p50_repeat_s", 1 / 4),
    Target("multi-turn", "host", "total_tokens_per_s", 2.0, at_least=True),
    Target("multi-turn", "host", "ttft_p50_after_round1_s", 1 / 3),
    # inside vLLM: close to vLLM keeping the documents itself, and faster than vLLM's own peer
    Target("long-doc", "host", "ttft_p50_repeat_s", 1.2, against=IDEAL, engines=("vllm",)),
    Target("long-doc", "host", "ttft_p50_repeat_s", 1.0, against="example", engines=("vllm",)),
    # host hits within a step of what free, local hits (ideal) give
    Target("multi-turn", "host", "ttft_p50_after_round1_s", 1.1, against=IDEAL,
           engines=("kvport",)),
    Target("multi-turn", "host", "total_tokens_per_s_after_round1", 0.9, at_least=True,
           against=IDEAL, engines=("kvport",)),
    Target("long-doc", "host", "ttft_p50_repeat_s", 1.05, against=IDEAL, engines=("kvport",)),
)

# a target's metric (its name in the JSON) -> the figure of a ConfigSummary
METRICS: dict[str, Callable[[ConfigSummary], float | None]] = {
    "ttft_p50_repeat_s": attrgetter("ttft_p50_later_s"),
    "ttft_p50_after_round1_s": attrgetter("ttft_p50_later_s"),
    "total_tokens_per_s": attrgetter("total_tokens_per_s"),
    "total_tokens_per_s_after_round1": attrgetter("total_tokens_per_s_later"),
}


def _phase_ttft_p50(c: ConfigSummary, phase: int) -> float | None:
    return percentile([r.ttft_s for r in c.records if r.phase == phase and r.index >= 1], 50)


def _phase_tokens_per_s(c: ConfigSummary, phase: int) -> float | None:
    wall = c.phase_wall.get(phase)
    tokens = sum(r.prompt_tokens + r.output_tokens for r in c.records if r.phase == phase)
    return tokens / wall if wall else None


def _tokens_per_s_without(c: ConfigSummary, phase: int) -> float | None:
    wall = sum(w for p, w in c.phase_wall.items() if p != phase)
    tokens = sum(r.prompt_tokens + r.output_tokens for r in c.records if r.phase != phase)
    return tokens / wall if wall else None


# a metric of the later requests -> its value in one phase
PHASE_METRICS: dict[str, Callable[[ConfigSummary, int], float | None]] = {
    "ttft_p50_repeat_s": _phase_ttft_p50,
    "ttft_p50_after_round1_s": _phase_ttft_p50,
    "total_tokens_per_s_after_round1": _phase_tokens_per_s,
}
# a metric over every phase -> its value over every phase but one
WITHOUT_PHASE_METRICS: dict[str, Callable[[ConfigSummary, int], float | None]] = {
    "total_tokens_per_s": _tokens_per_s_without,
}


@dataclass(frozen=True)
class TargetResult:
    config: str
    metric: str
    against: str
    ratio: float | None
    ideal_ratio: float | None  # ideal's ratio of the same metric, for targets vs the baseline
    limit: float
    at_least: bool
    met: bool | None  # None: a figure is missing
    pooled_ratio: float | None = None  # several passes: the pooled requests' ratio
    pass_ratios: tuple[float | None, ...] | None = None  # several passes: each pass's ratio
    # (least, largest) ratio of the pass's later phases, or of the passes; None: none measured
    spread: tuple[float, float] | None = None
    judged: bool = True  # False: one pass whose spread holds the limit cannot decide

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.config, self.metric, self.against)

    def to_json(self) -> JsonObject:
        out = dataclasses.asdict(self)
        if self.pass_ratios is None:  # one pass: the keys of a pass's own targets only
            del out["pooled_ratio"], out["pass_ratios"]
        else:
            out["pass_ratios"] = list(self.pass_ratios)
        out["spread"] = list(self.spread) if self.spread is not None else None
        return out


def met(value: float | None, limit: float, at_least: bool) -> bool | None:
    return None if value is None else (value >= limit if at_least else value <= limit)


def evaluate_targets(workload: str, engine: str,
                     items: Mapping[str, ConfigSummary]) -> list[TargetResult]:
    """Every target of this workload and engine whose configurations ran (`items`: by name,
    ideal's included), each with the spread of its phases and whether one pass decides it."""
    base, ideal = items.get(BASELINE), items.get(IDEAL)
    out = []
    for t in TARGETS:
        if t.workload != workload or engine not in t.engines or t.config not in items \
                or t.against not in items:
            continue
        figure = METRICS[t.metric]
        value = ratio(figure(items[t.config]), figure(items[t.against]))
        ideal_ratio = ratio(figure(ideal), figure(base)) \
            if ideal is not None and base is not None and t.against == BASELINE else None
        spread = phase_spread(t.metric, items[t.config], items[t.against])
        out.append(TargetResult(t.config, t.metric, t.against, value, ideal_ratio, t.limit,
                                t.at_least, met(value, t.limit, t.at_least), spread=spread,
                                judged=spread is None or not spread[0] <= t.limit <= spread[1]))
    return out


def phase_spread(metric: str, config: ConfigSummary,
                 against: ConfigSummary) -> tuple[float, float] | None:
    """(least, largest) ratio of `metric` within the pass (module docstring): per later phase,
    or without each phase in turn; None for fewer than two ratios."""
    if metric in PHASE_METRICS:
        figure = PHASE_METRICS[metric]
        phases = later_phases(config.records) & later_phases(against.records)
    else:
        figure = WITHOUT_PHASE_METRICS[metric]
        phases = set(config.phase_wall) & set(against.phase_wall)
    ratios = [r for r in (ratio(figure(config, p), figure(against, p)) for p in sorted(phases))
              if r is not None]
    return (min(ratios), max(ratios)) if len(ratios) >= 2 else None


def judge_over_passes(targets: Sequence[TargetResult],
                      passes: Sequence[Sequence[TargetResult]]) -> list[TargetResult]:
    """With several passes, each target's ratio the median of its passes' ratios, its verdict
    that median's, its spread the passes' (module docstring); with none, the targets as they
    are."""
    if not passes:
        return list(targets)
    judged = []
    for t in targets:
        ratios = tuple(next((x.ratio for x in p if x.key == t.key), None) for p in passes)
        known = [r for r in ratios if r is not None]
        median = statistics.median(known) if known else None
        judged.append(dataclasses.replace(t, ratio=median, pooled_ratio=t.ratio,
                                          pass_ratios=ratios,
                                          met=met(median, t.limit, t.at_least),
                                          spread=(min(known), max(known)) if known else None,
                                          judged=True))
    return judged
