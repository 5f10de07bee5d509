"""The verdicts of the workload benchmarks' targets: one pass is judged only where its spread
(the ratio per later phase, or without each phase in turn) leaves the limit on one side (single
runs scatter); several passes are judged on their median; the report says which."""

from __future__ import annotations

from kvport.bench.workload.serving import Outcome, RequestRecord
from kvport.bench.workload.summary import summarize
from kvport.bench.workload.targets import TargetResult, evaluate_targets, judge_over_passes


def _outcome(ttfts: dict[int, float], ideal: bool = False,
             walls: dict[int, float] | None = None) -> Outcome:
    """Two users; phase 0 their first rounds (TTFT 1 s), phase p >= 1 their rounds p + 1 with
    the TTFT given; each phase 200 tokens in `walls[p]` seconds (1 s each by default)."""
    recs = [RequestRecord("c", user, phase, phase, 90, 10, 1.0 if phase == 0 else ttft,
                          2.0, 0, 0, 0, 0, 1, [1])
            for phase, ttft in {0: 1.0, **ttfts}.items() for user in range(2)]
    walls = walls or {p: 1.0 for p in range(len(ttfts) + 1)}
    return Outcome(tuple(recs), sum(walls.values()), walls, None, 0, None, ideal, 0)


def _targets(host: dict[int, float]) -> dict[tuple[str, str], TargetResult]:
    items = {"no-connector": summarize("no-connector", _outcome({1: 1.0, 2: 1.0, 3: 1.0}),
                                       "multi-turn"),
             "host": summarize("host", _outcome(host), "multi-turn"),
             "ideal": summarize("ideal", _outcome({1: 0.1, 2: 0.1, 3: 0.1}, ideal=True),
                                "multi-turn")}
    return {(t.config, t.against): t for t in evaluate_targets("multi-turn", "kvport", items)
            if t.metric == "ttft_p50_after_round1_s"}


def test_one_pass_whose_phases_fall_on_both_sides_of_the_limit_is_not_judged() -> None:
    # host over ideal per round: 1.0, 1.2, 1.3 around the limit 1.1; the pooled p50 1.2
    got = _targets({1: 0.10, 2: 0.12, 3: 0.13})
    vs_ideal = got["host", "ideal"]
    assert vs_ideal.spread is not None
    assert vs_ideal.spread[0] == 1.0 and round(vs_ideal.spread[1], 6) == 1.3
    assert vs_ideal.met is False and not vs_ideal.judged
    assert vs_ideal.to_json()["judged"] is False
    # against the baseline the same rounds are far below 1/3: judged
    assert got["host", "no-connector"].judged and got["host", "no-connector"].met


def test_one_pass_whose_phases_agree_is_judged() -> None:
    got = _targets({1: 0.125, 2: 0.12, 3: 0.13})["host", "ideal"]
    assert got.judged and got.met is False  # every round above 1.1: not met, and decided


def test_a_figure_over_every_phase_is_spread_by_leaving_each_phase_out() -> None:
    """Round 1 costs both the same, later rounds a tenth in host: the pass's ratio without
    round 1 is 10, without a later round lower; never 2 (the limit) or below: judged."""
    base = _outcome({1: 1.0, 2: 1.0})
    host = _outcome({1: 0.1, 2: 0.1}, walls={0: 1.0, 1: 0.1, 2: 0.1})
    items = {"no-connector": summarize("no-connector", base, "multi-turn"),
             "host": summarize("host", host, "multi-turn")}
    [total] = [t for t in evaluate_targets("multi-turn", "kvport", items)
               if t.metric == "total_tokens_per_s"]
    assert total.ratio is not None and round(total.ratio, 6) == 2.5  # 3 s against 1.2 s
    assert total.spread is not None and round(total.spread[0], 6) == round(2 / 1.1, 6)
    assert round(total.spread[1], 6) == 10.0 and not total.judged  # 2 / 1.1 < 2 <= 10
    items["host"] = summarize("host", _outcome({1: 0.1, 2: 0.1}, walls={0: 0.5, 1: 0.1, 2: 0.1}),
                              "multi-turn")
    [total] = [t for t in evaluate_targets("multi-turn", "kvport", items)
               if t.metric == "total_tokens_per_s"]
    assert total.judged and total.met  # 2 / 0.6 > 2 without any one round


def test_passes_are_judged_on_their_median_and_their_range_is_the_spread() -> None:
    t = _targets({1: 0.10, 2: 0.12, 3: 0.13})["host", "ideal"]
    [judged] = judge_over_passes([t], [[t], [t], [t]])
    assert judged.judged and judged.spread == (t.ratio, t.ratio)


def test_the_report_prints_the_spread_and_says_not_judged() -> None:
    from kvport.bench.common.machine import machine_info
    from kvport.bench.workload.config import WorkloadBenchConfig, default_spec
    from kvport.bench.workload.plan import plan_engine
    from kvport.bench.workload.report import format_result
    from kvport.bench.workload.result import WorkloadResult, build_tables

    cfg = WorkloadBenchConfig("multi-turn", default_spec("multi-turn", True),
                              model="builtin:tiny-llama", concurrency=2)
    tables = build_tables("multi-turn", "kvport", {
        "no-connector": _outcome({1: 1.0, 2: 1.0, 3: 1.0}),
        "host": _outcome({1: 0.10, 2: 0.12, 3: 0.13}),
        "ideal": _outcome({1: 0.1, 2: 0.1, 3: 0.1}, ideal=True)})
    text = format_result(WorkloadResult(cfg, plan_engine(cfg), machine_info(), tables, (), {},
                                        None, None, None, None))
    assert ("target host ttft_p50_after_round1_s vs ideal: 1.200x (rounds >= 2: 1.000-1.300) "
            "<= 1.100x: not judged") in text
    assert "target host ttft_p50_after_round1_s vs no-connector: 0.120x (rounds >= 2: " \
           "0.100-0.130) <= 0.333x: met (ideal 0.100x)" in text
    assert "not judged: within this one pass the ratio falls on both sides of the limit" in text
