"""The terminal report of a workload benchmark: the title (model, workload, pool, the load other
processes added), the latency and throughput table, the hits and bytes table, the targets'
verdicts, and notes on what makes a figure less than it seems."""

from __future__ import annotations

import dataclasses

from kvport.bench.common.table import table_lines
from kvport.bench.workload.config import BASELINE
from kvport.bench.workload.result import WorkloadResult
from kvport.bench.workload.summary import TIERS, ConfigSummary
from kvport.bench.workload.targets import PHASE_METRICS, TargetResult


def _f(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f}"


def _rows(result: WorkloadResult) -> list[ConfigSummary]:
    ideal = result.ideal
    return [*result.configs, *([dataclasses.replace(ideal, name="(ideal)")] if ideal else [])]


def format_result(result: WorkloadResult) -> str:
    cfg = result.config
    tag = "r>=2" if cfg.workload == "multi-turn" else "rep"
    # first: a run of the fallback model must not pass for the demo
    lines = [f"NOTE: {cfg.model_fallback_note}"] if cfg.model_fallback_note else []
    lines.append(_title(result))
    if cfg.repeats > 1:
        lines.append(f"{cfg.repeats} passes of the workload, each on fresh engines and tiers, "
                     f"in Williams orders; the tables pool their requests; a target's ratio is "
                     f"the median of its passes' ratios")
        if any(c.name == "user" for c in result.configs):
            lines.append("note: 'user' (--kv-transfer-config) is the same configuration in every "
                         "pass: storage of its own outside the engine lasts from pass to pass")
    lines += _latency_table(result, tag) + [""] + _hits_table(result, tag)
    later = "rounds >= 2" if cfg.workload == "multi-turn" else "repeated queries"
    lines.append(f"computed / steps {tag}: per request of {later}, the mean prompt tokens "
                 f"computed (not hit) and engine steps to the first token")
    phase = "round" if cfg.workload == "multi-turn" else "query"
    lines += [_target_line(t, later if t.metric in PHASE_METRICS else f"without one {phase}")
              for t in result.targets]
    if not all(t.judged for t in result.targets):
        lines.append(f"not judged: within this one pass the ratio falls on both sides of the "
                     f"limit ({later} on their own, or the pass without one {phase}); single "
                     f"runs scatter on a shared machine: --repeats 3 judges on the median of 3 "
                     f"passes")
    return "\n".join(lines + _notes(result))


def _title(result: WorkloadResult) -> str:
    cfg, plan = result.config, result.plan
    return (f"kvport bench {cfg.workload}: {cfg.model}, {dataclasses.asdict(cfg.spec)}, "
            f"concurrency {cfg.concurrency}, pool {plan.num_kv_blocks} blocks "
            f"({plan.effective_pool_fraction:.2f} of the working set); seconds, "
            f"x = ratio to {BASELINE}; "
            f"other load {_f(result.other_load_cores, '{:.2f}')} cores "
            f"(hypervisor steal {_f(result.steal_cores, '{:.2f}')})")


def _latency_table(result: WorkloadResult, tag: str) -> list[str]:
    rows = [["config", "TTFT p50", "p90", "p99", f"TTFT p50 {tag}", "ideal", "e2e p50", "tok/s",
             f"tok/s {tag}", "TTFT x", "rep x", "tput x", f"tput x {tag}"]]
    for c in _rows(result):
        rows.append([c.name, _f(c.ttft_p50_s), _f(c.ttft_p90_s), _f(c.ttft_p99_s),
                     _f(c.ttft_p50_later_s), _f(c.ideal_ttft_p50_later_s), _f(c.e2e_p50_s),
                     _f(c.total_tokens_per_s, "{:.0f}"), _f(c.total_tokens_per_s_later, "{:.0f}"),
                     _f(c.ratios.ttft, "{:.2f}"), _f(c.ratios.ttft_later, "{:.2f}"),
                     _f(c.ratios.throughput, "{:.2f}"), _f(c.ratios.throughput_later, "{:.2f}")])
    return table_lines(rows)


def _hits_table(result: WorkloadResult, tag: str) -> list[str]:
    # the Redis tier's columns only when a configuration has one (runs without look as before)
    tiers = [t for t in TIERS if t != "redis" or any(
        c.bytes_stored.get("redis") is not None for c in result.configs)]
    short = "/".join(t[0] for t in tiers)
    rows = [["config", "prefix hit", "conn hit", *(f"{t} hit" for t in tiers),
             f"MiB loaded {short}", f"MiB stored {short}", f"load s {short}",
             f"computed {tag}", f"steps {tag}"]]
    for c in _rows(result):
        rows.append([c.name, _f(c.prefix_hit_rate, "{:.2f}"), _f(c.connector_hit_rate, "{:.2f}"),
                     *(_f(c.tier_hit_rates.get(t), "{:.2f}") for t in tiers),
                     "/".join(_mib(c.bytes_loaded.get(t)) for t in tiers),
                     "/".join(_mib(c.bytes_stored.get(t)) for t in tiers),
                     "/".join(_f(c.load_seconds.get(t), "{:.2f}") for t in tiers),
                     _f(c.computed_tokens_mean_later, "{:.0f}"),
                     _f(c.ttft_steps_mean_later, "{:.1f}")])
    return table_lines(rows)


def _target_line(t: TargetResult, within: str) -> str:
    """'target host ttft_p50_after_round1_s vs ideal: 1.190x (rounds >= 2: 0.981-1.342) <=
    1.100x: not judged'; with passes, their ratios instead of the pass's spread."""
    op = ">=" if t.at_least else "<="
    verdict = {True: "met", False: "NOT met", None: "n/a"}[t.met] if t.judged else "not judged"
    ideal_note = f" (ideal {_f(t.ideal_ratio, '{:.3f}x')})" if t.against == BASELINE else ""
    spread, passes = "", ""
    if t.pass_ratios:  # ' (median of passes 0.98, 1.10, 1.01; pooled requests 1.03x)'
        passes = (f" (median of passes {', '.join(_f(r) for r in t.pass_ratios)}; pooled "
                  f"requests {_f(t.pooled_ratio)}x)")
    elif t.spread is not None:
        spread = f" ({within}: {t.spread[0]:.3f}-{t.spread[1]:.3f})"
    return (f"target {t.config} {t.metric} vs {t.against}: {_f(t.ratio)}x{spread} {op} "
            f"{t.limit:.3f}x: {verdict}{ideal_note}{passes}")


def _notes(result: WorkloadResult) -> list[str]:
    cfg, ideal, notes = result.config, result.ideal, []
    if ideal is not None and ideal.engine_evicted_blocks:
        notes.append(f"note: ideal's pool evicted {ideal.engine_evicted_blocks} cached blocks, "
                     f"so some of its hits were recomputed: it is not quite the ideal")
    if result.plan.effective_pool_fraction >= 1:
        notes.append("note: the pool is as large as the working set: the engine's prefix cache "
                     "can keep it all, so offloading has little to add")
    if cfg.redis_url:
        deleted = result.redis_keys_deleted
        notes.append(f"redis: {result.params()['redis_url']}, " + (
            f"{deleted} keys of this run deleted afterwards" if deleted is not None else
            "this run's keys stay under its tenant salt (kv_transfer_config in the JSON) "
            "until Redis evicts them"))
    for name, why in result.failed.items():
        notes.append(f"FAILED {name}: its engine stopped ({why}); it is left out of the tables")
    unsupported = [c.name for c in result.configs if c.resets_unsupported]
    if unsupported:
        notes.append(f"note: {unsupported}: the connector could not drop its cache (reset_cache "
                     f"returned None), so the cold-host condition did not hold")
    return notes
