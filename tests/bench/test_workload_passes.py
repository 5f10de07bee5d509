"""`--repeats`: several passes of a workload in one run, each on fresh engines and tiers, pooled
into one table; the pooling arithmetic, counters summed, and a real two-pass run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvport.bench.cli import main
from kvport.bench.common.process import EngineProcessFailed
from kvport.bench.common.stats import mean_or_none, percentile
from kvport.bench.workload import engines
from kvport.bench.workload.config import WorkloadBenchConfig
from kvport.bench.workload.passes import pool_outcomes
from kvport.bench.workload.plan import ConfigSpec
from kvport.bench.workload.run import run_workload_bench
from kvport.bench.workload.serving import ConfigRunner, Outcome, RequestRecord, metrics_sum
from kvport.bench.workload.targets import TargetResult, judge_over_passes
from kvport.bench.workload.workloads import LongDocSpec

TINY = "builtin:tiny-llama"
LD = LongDocSpec(docs=3, doc_len=96, queries=2, question_len=8, answer_tokens=4)


def _rec(phase: int, ttft: float, index: int = 1) -> RequestRecord:
    return RequestRecord("host", 0, index, phase, 10, 2, ttft, 2 * ttft, 0, 0, 0, 0, 1, [7, 8])


def _outcome(phases: dict[int, float], records: list[RequestRecord], loaded: int,
             evicted: int | None = 0) -> Outcome:
    return Outcome(tuple(records), sum(phases.values()), phases,
                   {"connector": {"offload_block_tokens": 16, "host": {"bytes_loaded": loaded}}},
                   evicted, None, False, 1)


def test_passes_pool_into_one_outcome_with_phases_numbered_on() -> None:
    first = {"host": _outcome({0: 1.0, 1: 2.0}, [_rec(0, 0.5, 0), _rec(1, 0.1)], 10)}
    second = {"host": _outcome({0: 3.0, 1: 4.0}, [_rec(0, 0.6, 0), _rec(1, 0.2)], 15, 2)}
    [host] = pool_outcomes([first, second], num_phases=2).values()
    assert [(r.phase, r.ttft_s) for r in host.records] == [(0, 0.5), (1, 0.1), (2, 0.6),
                                                            (3, 0.2)]
    assert host.phase_busy_s == {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0} and host.busy_s == 10.0
    # counters add up, levels and settings stay what they are
    assert host.metrics == {"connector": {"offload_block_tokens": 16,
                                          "host": {"bytes_loaded": 25}}}
    assert host.engine_evicted_blocks == 2 and host.resets_unsupported == 2
    assert first["host"].records[1].phase == 1  # the passes' own records are left as they were


def test_a_configuration_missing_from_a_pass_is_left_out_and_unknowns_stay_unknown() -> None:
    one = {"no-connector": _outcome({0: 1.0}, [_rec(0, 1.0)], 0, evicted=None),
           "host": _outcome({0: 1.0}, [_rec(0, 1.0)], 0)}
    two = {"no-connector": _outcome({0: 1.0}, [_rec(0, 1.0)], 0)}
    pooled = pool_outcomes([one, two], num_phases=1)
    assert list(pooled) == ["no-connector"]
    assert pooled["no-connector"].engine_evicted_blocks is None  # vLLM's: not known
    with pytest.raises(AssertionError, match="phases outside 0..0"):
        pool_outcomes([{"host": _outcome({1: 1.0}, [], 0)}], num_phases=1)


def test_metrics_sum_adds_counters_of_either_side() -> None:
    a = {"c": {"hits": 2, "gone": 1, "num_slots": 8, "tier": "host"}, "flag": True}
    b = {"c": {"hits": 3, "new": 4, "num_slots": 8, "tier": "host"}, "flag": True}
    assert metrics_sum(a, b) == {"c": {"hits": 5, "gone": 1, "new": 4, "num_slots": 8,
                                       "tier": "host"}, "flag": True}
    assert metrics_sum(None, None) is None and metrics_sum(a, None) == a
    assert mean_or_none([None, 1.0, 2.0]) == 1.5 and mean_or_none([None]) is None


def test_targets_are_judged_on_the_median_of_the_passes() -> None:
    """A machine that slowed between passes can pool to a ratio no pass had: the verdict is the
    passes' median (1.063 > 1.05: not met), the pooled ratio is kept beside it."""
    def target(ratio: float | None) -> TargetResult:
        return TargetResult("host", "ttft_p50_repeat_s", "ideal", ratio, None, 1.05, False, None)

    ratios = (1.063, 1.088, 1.056, 0.955, 1.065)
    [t] = judge_over_passes([target(1.007)], [[target(r)] for r in ratios])
    assert t.ratio == 1.063 and t.met is False and t.pooled_ratio == 1.007
    assert t.pass_ratios == ratios
    # one pass: its own ratio, nothing added
    assert judge_over_passes([target(1.0)], []) == [target(1.0)]
    [unknown] = judge_over_passes([target(None)], [[target(None)]] * 2)
    assert unknown.ratio is None and unknown.met is None


def test_repeats_and_explicit_specs_are_checked() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        WorkloadBenchConfig("long-doc", LD, model=TINY, repeats=0)
    with pytest.raises(ValueError, match=r"configs name \['ideal'\] more than once"):
        WorkloadBenchConfig("long-doc", LD, model=TINY, configs=("no-connector", "ideal", "ideal"))
    cfg = WorkloadBenchConfig("long-doc", LD, model=TINY, configs=("no-connector", "ideal"),
                              repeats=2)
    with pytest.raises(ValueError, match="explicit specs serve one pass; got repeats=2"):
        run_workload_bench(cfg, [ConfigSpec("no-connector")], progress=False)


def test_two_passes_run_on_fresh_engines_and_pool(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every pass runs every request once on fresh engines and tiers: pass 2's first queries
    find nothing in any tier (an engine or a disk directory kept from pass 1 would hit), and
    the tables pool both passes' requests."""
    out = tmp_path / "r.json"
    rc = main(["bench", "long-doc", "--model", TINY, "--configs",
               "no-connector,host,host+disk,ideal",
               "--docs", "3", "--doc-len", "96", "--queries", "2", "--question-len", "8",
               "--max-tokens", "4", "--repeats", "2", "--disk-dir", str(tmp_path),
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["params"]["repeats"] == 2 and len(result["passes"]) == 2
    n = LD.docs * LD.queries  # requests per pass, phases per pass
    for c in [*result["configs"], result["ideal"]]:
        recs = c["per_request"]
        assert len(recs) == 2 * n and sorted(r["phase"] for r in recs) == list(range(2 * n))
        assert len(c["phase_wall_s"]) == 2 * n and sum(c["phase_wall_s"]) == \
            pytest.approx(c["wall_s"])
        firsts = [r for r in recs if r["index"] == 0]
        assert len(firsts) == 2 * LD.docs
        assert all(r["num_cached_tokens"] == 0 for r in firsts), c["name"]  # nothing kept
        # the pooled p50 is over both passes' repeated queries; each pass has its own
        repeat = [r["ttft_s"] for r in recs if r["index"] >= 1]
        assert c["ttft_p50_repeat_s"] == pytest.approx(percentile(repeat, 50))
        per_pass = [p["configs"][c["name"]]["ttft_p50_repeat_s"] for p in result["passes"]]
        for k, got in enumerate(per_pass):
            mine = [r["ttft_s"] for r in recs if r["index"] >= 1 and r["phase"] // n == k]
            assert got == pytest.approx(percentile(mine, 50))
    disk = {c["name"]: c for c in result["configs"]}["host+disk"]
    assert disk["connector_hit_rate"] > 0  # later queries hit in both passes
    assert all(len(p["targets"]) == len(result["targets"]) for p in result["passes"])
    assert all(p["steal_cores"] is not None for p in result["passes"])
    assert "2 passes of the workload" in text
    [line] = [t for t in text.splitlines() if "host ttft_p50_repeat_s vs ideal" in t]
    ratios = [t["ratio"] for p in result["passes"] for t in p["targets"]
              if (t["config"], t["against"]) == ("host", "ideal")]
    [target] = [t for t in result["targets"] if (t["config"], t["against"]) == ("host", "ideal")]
    assert target["pass_ratios"] == ratios and target["ratio"] == pytest.approx(sum(ratios) / 2)
    host = {c["name"]: c for c in result["configs"]}["host"]
    assert target["pooled_ratio"] == pytest.approx(host["ttft_p50_repeat_s"]
                                                   / result["ideal"]["ttft_p50_repeat_s"])
    assert line.endswith(f"(median of passes {ratios[0]:.3f}, {ratios[1]:.3f}; pooled requests "
                         f"{target['pooled_ratio']:.3f}x)")


def test_a_configuration_that_crashes_in_one_pass_stays_out_of_the_later_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    original, started = ConfigRunner.run_phase, []

    def crash(self: ConfigRunner, phase: int) -> list[RequestRecord]:
        started.append(self.name)
        if self.name == "ideal" and phase == 1:
            raise EngineProcessFailed("the whole log", "RuntimeError: shape mismatch")
        return original(self, phase)

    names: list[str] = []
    start = engines.start

    def counted(cfg: Any, plan: Any, spec: Any, workload: Any) -> Any:
        names.append(spec.name)
        return start(cfg, plan, spec, workload)

    monkeypatch.setattr(ConfigRunner, "run_phase", crash)
    monkeypatch.setattr(engines, "start", counted)
    cfg = WorkloadBenchConfig("long-doc", LD, model=TINY, configs=("no-connector", "ideal"),
                              repeats=2)
    result = run_workload_bench(cfg, progress=False)
    assert result.failed == {"ideal": "pass 0 phase 1: RuntimeError: shape mismatch"}
    assert started.count("ideal") == 2  # phases 0 and 1 of pass 0
    assert names == ["no-connector", "ideal", "no-connector"]  # no engine for it in pass 1
    assert result.ideal is None and [c.name for c in result.configs] == ["no-connector"]
    assert len(result.configs[0].records) == 2 * LD.docs * LD.queries
