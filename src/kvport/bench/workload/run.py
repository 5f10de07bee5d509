"""`kvport bench multi-turn` / `long-doc`: one workload, several configurations, one run.

Every configuration gets its own engine (same model, same pool size, same requests: plan) and
they run side by side, alternating a phase at a time (a round; one query), in the orders of a
Williams design (passes.run_order: each in every slot and right after every other equally often),
so drift in the load of a shared machine, and what the run just before leaves behind, hit them
all alike. A configuration cannot be repeated ABBA-style: a run changes what its caches hold,
which is exactly what is measured. `repeats` runs whole passes, each on fresh engines and tiers
(passes).

Greedy outputs must be equal for equal requests across configurations; if not, `OutputMismatch`.
A configuration whose engine process stops fails alone (the baseline's fails the run), and is left
out from then on.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.bench.common.command import JsonObject
from kvport.bench.common.machine import OtherLoadMeter, machine_info
from kvport.bench.common.models import resolve_model_dir
from kvport.bench.common.process import EngineProcessFailed
from kvport.bench.common.stats import mean_or_none
from kvport.bench.workload import engines
from kvport.bench.workload.config import BASELINE, WorkloadBenchConfig
from kvport.bench.workload.passes import pool_outcomes, run_order
from kvport.bench.workload.plan import (
    ConfigSpec,
    EnginePlan,
    build_config_specs,
    make_workload,
    plan_engine,
)
from kvport.bench.workload.redis_keys import delete_redis_keys, run_redis_keys
from kvport.bench.workload.result import PassSummary, Tables, WorkloadResult, build_tables
from kvport.bench.workload.serving import Outcome, RequestRecord
from kvport.bench.workload.targets import judge_over_passes
from kvport.bench.workload.workloads import RandomTokens, Workload


class OutputMismatch(RuntimeError):
    """Two configurations gave different greedy outputs for the same request."""


@dataclass(frozen=True)
class PassRun:
    """What one pass gave: each configuration's outcome (those whose engine did not fail), the
    load other processes added, the Redis keys deleted, what vLLM's processes reported."""

    outcomes: dict[str, Outcome]
    other_load_cores: float | None
    steal_cores: float | None
    redis_keys_deleted: int | None
    vllm_info: JsonObject | None


def run_workload_bench(cfg: WorkloadBenchConfig, specs: list[ConfigSpec] | None = None,
                       progress: bool = True) -> WorkloadResult:
    """Run every configuration on the same requests, `cfg.repeats` passes of the whole workload
    (fresh engines and tiers each): the tables pool the passes' requests, a target's ratio is the
    median of its passes' ratios. `specs` (default: `build_config_specs` per pass) serve one pass
    only: their disk directories would carry a pass's entries into the next."""
    from tqdm.auto import tqdm

    _check_specs(cfg, specs)
    if cfg.threads is not None and cfg.engine == "kvport":
        # on a shared machine, fewer threads than cores keeps torch's barriers from waiting on a
        # thread that another process's load has descheduled
        import torch

        torch.set_num_threads(cfg.threads)
    plan = plan_engine(cfg)
    workload = make_workload(cfg)
    # distinct from every workload token stream: warming up must not pre-fill any prefix
    warm_prompt = RandomTokens(resolve_model_dir(cfg.model),
                               cfg.seed + 7919).take(2 * cfg.block_size)
    num_configs = len(specs) if specs is not None else len(cfg.configs)
    bar = tqdm(total=workload.num_phases * num_configs * cfg.repeats, desc=cfg.workload,
               disable=not progress, unit="phase")
    failed: dict[str, str] = {}
    passes = [_run_pass(cfg, plan, workload, specs, k, warm_prompt, bar, failed)
              for k in range(cfg.repeats)]
    bar.close()
    return _result(cfg, plan, workload, passes, failed)


def _check_specs(cfg: WorkloadBenchConfig, specs: list[ConfigSpec] | None) -> None:
    if specs is not None and cfg.repeats > 1:
        raise ValueError(f"explicit specs serve one pass; got repeats={cfg.repeats}: leave "
                         f"specs out (each pass builds its own) or run one pass")
    if specs is not None and [s.name for s in specs].count(BASELINE) != 1:
        raise ValueError(f"exactly one configuration must be named {BASELINE!r}")


def _result(cfg: WorkloadBenchConfig, plan: EnginePlan, workload: Workload,
            passes: list[PassRun], failed: dict[str, str]) -> WorkloadResult:
    outcomes = [{n: o for n, o in p.outcomes.items() if n not in failed} for p in passes]
    pooled = build_tables(cfg.workload, cfg.engine, pool_outcomes(outcomes, workload.num_phases))
    # each pass on its own; the targets are judged on the median of the passes' ratios
    per_pass = [] if cfg.repeats == 1 else [
        PassSummary(p.other_load_cores, p.steal_cores, build_tables(cfg.workload, cfg.engine, o))
        for p, o in zip(passes, outcomes)]
    tables = Tables(pooled.configs, pooled.ideal, tuple(judge_over_passes(
        pooled.targets, [s.tables.targets for s in per_pass])))
    deleted = [p.redis_keys_deleted for p in passes if p.redis_keys_deleted is not None]
    return WorkloadResult(
        cfg, plan, machine_info(), tables, tuple(per_pass), failed,
        mean_or_none([p.other_load_cores for p in passes]),
        mean_or_none([p.steal_cores for p in passes]),
        sum(deleted) if deleted else None, passes[0].vllm_info)


def _run_pass(cfg: WorkloadBenchConfig, plan: EnginePlan, workload: Workload,
              specs: list[ConfigSpec] | None, k: int, warm_prompt: list[int], bar: Any,
              failed: dict[str, str]) -> PassRun:
    """Pass k: every configuration not in `failed` on fresh engines, its phases in the Williams
    orders that go on from pass k - 1's; a configuration whose engine fails is added to
    `failed` and left out from then on."""
    # a fresh directory even under --disk-dir: entries of an earlier run would be free hits
    with tempfile.TemporaryDirectory(prefix="kvport-bench-", dir=cfg.disk_dir) as tmp:
        pass_specs = specs if specs is not None else build_config_specs(cfg, plan, Path(tmp))
        runs: list[engines.Run] = []
        try:
            for spec in pass_specs:
                if spec.name not in failed:
                    runs.append(engines.start(cfg, plan, spec, workload))
            for run in runs:
                engines.check_block_size(cfg, run)
                run.runner.warm_up(warm_prompt)
            load = OtherLoadMeter()
            load.start()
            for phase in range(workload.num_phases):
                _run_phase(cfg, runs, k * workload.num_phases + phase, phase, k, bar, failed)
            other_load = load.stop()
            done = [r for r in runs if r.spec.name not in failed]
            check_equal_outputs({r.spec.name: r.runner.records for r in done})
            outcomes = {r.spec.name: engines.outcome(r) for r in done}
        finally:
            ours = [key for key in (run_redis_keys(cfg, r) for r in runs) if key is not None]
            try:
                engines.shutdown(runs)  # the connectors' last write-throughs end here
            finally:
                redis_deleted = delete_redis_keys(ours)
    return PassRun(outcomes, other_load, load.steal_cores, redis_deleted,
                   getattr(runs[0].runner, "info", None))


def _run_phase(cfg: WorkloadBenchConfig, runs: list[engines.Run], row: int, phase: int, k: int,
               bar: Any, failed: dict[str, str]) -> None:
    """One phase of every live configuration, in row `row` of the Williams design."""
    live = [r for r in runs if r.spec.name not in failed]
    for run in [live[i] for i in run_order(len(live), row)]:
        bar.set_postfix_str(run.spec.name)
        try:
            run.runner.run_phase(phase)
        except EngineProcessFailed as exc:
            # a peer's engine that crashed fails alone; the others go on
            if run.spec.name == BASELINE:
                raise
            failed[run.spec.name] = f"pass {k} phase {phase}: {exc.reason}" \
                if cfg.repeats > 1 else f"phase {phase}: {exc.reason}"
        bar.update(1)


def check_equal_outputs(records: dict[str, list[RequestRecord]]) -> None:
    """Raise OutputMismatch naming the first request (in run order) whose greedy output differs
    between the first configuration and another one."""
    names = list(records)
    if not names:
        return
    ref_name = names[0]
    ref = {(r.session, r.index): r for r in records[ref_name]}
    for name in names[1:]:
        got = {(r.session, r.index): r for r in records[name]}
        if got.keys() != ref.keys():
            missing = sorted(ref.keys() ^ got.keys())[:5]
            raise OutputMismatch(f"configs {ref_name!r} and {name!r} ran different requests "
                                 f"(session, index): {missing}")
        for key in sorted(ref, key=lambda k: (ref[k].phase, k)):
            a, b = ref[key].output_token_ids, got[key].output_token_ids
            if a != b:
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise OutputMismatch(
                    f"greedy outputs differ for request session={key[0]} index={key[1]} "
                    f"(phase {ref[key].phase}) between configs {ref_name!r} and {name!r}: first "
                    f"difference at output token {at}: {a[at:at + 4]} vs {b[at:at + 4]}")
