"""The terminal report of `kvport bench serve`: one table row per (scenario, system), the ratios
against no connector in the same scenario, where the prompt tokens came from, and one line per
target."""

from __future__ import annotations

from kvport.bench.common.table import table_lines
from kvport.bench.serve.config import SCENARIOS, SYSTEMS
from kvport.bench.serve.result import RunResult, ServeBenchResult, Verdict, ratios

HEADER = ("scenario", "system", "TTFT p50", "p99", "TTFT p50 t>1", "ITL p50", "out tok/s",
          "tot tok/s", "TTFT x", "t>1 x", "out x", "tot x", "cached", "from tiers", "fail")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _share(part: int, whole: int) -> str:
    return "-" if whole <= 0 else f"{100 * part / whole:.0f}%"


def run_row(runs: list[RunResult], run: RunResult) -> tuple[str, ...]:
    f, h, x = run.figures, run.hits, ratios(runs, run)
    tiers = " ".join(f"{tier} {_share(n, h.prompt_tokens)}" for tier, n in h.tier_hit_tokens.items()
                     if n) or "-"
    return (run.scenario, run.system if run.instances == 1 else f"{run.instances}x {run.system}",
            _s(f.ttft_p50_s), _s(f.ttft_p99_s), _s(f.ttft_p50_after_first_turn_s),
            _s(f.itl_p50_s), _rate(f.output_tokens_per_s), _rate(f.total_tokens_per_s),
            _x(x["ttft_p50_s"]), _x(x["ttft_p50_after_first_turn_s"]),
            _x(x["output_tokens_per_s"]), _x(x["total_tokens_per_s"]),
            _share(h.device_hit_tokens + h.connector_hit_tokens, h.prompt_tokens), tiers,
            str(f.failed))


def verdict_line(v: Verdict) -> str:
    t = v.target
    sign = "<=" if t.at_most else ">="
    state = "not measured" if v.ratio is None else (
        "not judged (failed requests)" if v.met is None else "met" if v.met else "NOT met")
    if t.versus is None:
        value = "-" if v.ratio is None else f"{v.ratio:.1f}"
        return f"target {t.scenario}: {t.system} {t.metric}: {value} {sign} {t.limit:g}: {state}"
    value = "-" if v.ratio is None else f"{v.ratio:.3f}x"
    return (f"target {t.scenario}: {t.system} {t.metric} vs {t.versus}: {value} {sign} "
            f"{t.limit:.3f}x: {state}")


def format_result(result: ServeBenchResult) -> str:
    pool = result.pool
    params = result.params
    title = (f"kvport bench serve: {params['model']} in vLLM {result.vllm_version} (vllm bench "
             f"serve), {params['request_rate']:g} requests/s, at most {params['concurrency']} "
             f"in flight, seed {params['seed']}")
    sets = ", ".join(f"{s} {n}" for s, n in pool["working_set_blocks"].items())
    sizes = (f"each server's KV pool: {pool['kv_blocks']} blocks of {pool['block_tokens']} "
             f"tokens; working sets (full blocks): {sets}")
    lines = [title, sizes, ""]
    # grouped by scenario (the run goes system by system: each system's servers once)
    order = sorted(result.runs, key=lambda r: (SCENARIOS.index(r.scenario),
                                               SYSTEMS.index(r.system)))
    rows = [HEADER] + [run_row(result.runs, r) for r in order]
    lines += table_lines(rows, left=2)
    lines += ["", *LEGEND.splitlines(), "", *(verdict_line(v) for v in result.verdicts)]
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"wall time {result.wall_s:.0f} s")
    return "\n".join(lines)


LEGEND = """\
Times in seconds (vLLM's client: TTFT from sending a request to its first streamed token; ITL
between streamed tokens). t>1: requests after each conversation's first turn. tok/s: output, and
prompt plus output, tokens of finished requests per second of the run. x: ratio to no-connector
in the same scenario. cached: prompt tokens not computed (vLLM's prefix cache and the connector);
from tiers: the share kvport's tiers loaded."""
