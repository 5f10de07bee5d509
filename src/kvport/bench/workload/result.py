"""The result of a workload benchmark: each configuration's summary (ideal's apart), with its
ratios to no-connector of the same run, the targets, and with several passes each pass in
brief; and the JSON it is written as."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvport.bench.common.command import JsonObject
from kvport.bench.common.machine import MachineInfo
from kvport.bench.common.stats import ratio
from kvport.bench.workload.config import BASELINE, WorkloadBenchConfig
from kvport.bench.workload.plan import EnginePlan
from kvport.bench.workload.serving import Outcome
from kvport.bench.workload.summary import ConfigSummary, Ratios, summarize
from kvport.bench.workload.targets import TargetResult, evaluate_targets


@dataclass(frozen=True)
class Tables:
    """One pass's configurations, or every pass's pooled: the summaries and the targets."""

    configs: tuple[ConfigSummary, ...]  # no-connector first; ideal apart
    ideal: ConfigSummary | None
    targets: tuple[TargetResult, ...]

    @property
    def all(self) -> tuple[ConfigSummary, ...]:
        return self.configs + ((self.ideal,) if self.ideal is not None else ())


def build_tables(workload: str, engine: str, outcomes: Mapping[str, Outcome]) -> Tables:
    items = {name: summarize(name, o, workload) for name, o in outcomes.items()}
    ideal = next((items.pop(n) for n, o in outcomes.items() if o.ideal), None)
    base = items[BASELINE]
    ideal_later = ideal.ttft_p50_later_s if ideal is not None else None
    compared = []
    for item in items.values():
        beside = ideal is not None and item.name != BASELINE
        compared.append(dataclasses.replace(
            item, ratios=_ratios(item, base),
            ideal_ttft_p50_s=ideal.ttft_p50_s if beside and ideal is not None else None,
            ideal_ttft_p50_later_s=ideal_later if beside else None))
    ideal_row = dataclasses.replace(ideal, ratios=_ratios(ideal, base)) \
        if ideal is not None else None
    by_name = {c.name: c for c in compared}
    if ideal_row is not None:
        by_name[ideal_row.name] = ideal_row
    return Tables(tuple(compared), ideal_row,
                  tuple(evaluate_targets(workload, engine, by_name)))


def _ratios(item: ConfigSummary, base: ConfigSummary) -> Ratios:
    return Ratios(ratio(item.ttft_p50_s, base.ttft_p50_s),
                  ratio(item.total_tokens_per_s, base.total_tokens_per_s),
                  ratio(item.ttft_p50_later_s, base.ttft_p50_later_s),
                  ratio(item.total_tokens_per_s_later, base.total_tokens_per_s_later))


@dataclass(frozen=True)
class PassSummary:
    """One pass of a run of several, in brief: its load, each configuration's TTFT p50 and
    throughput of the later requests, and its targets' ratios."""

    other_load_cores: float | None
    steal_cores: float | None
    tables: Tables

    def to_json(self) -> JsonObject:
        def brief(c: ConfigSummary) -> JsonObject:
            return {f"ttft_p50_{c.later}_s": c.ttft_p50_later_s,
                    f"total_tokens_per_s_{c.later}": c.total_tokens_per_s_later}

        return {"other_load_cores": self.other_load_cores, "steal_cores": self.steal_cores,
                "configs": {c.name: brief(c) for c in self.tables.all},
                "targets": [{"config": t.config, "metric": t.metric, "against": t.against,
                             "ratio": t.ratio, "met": t.met} for t in self.tables.targets]}


@dataclass(frozen=True)
class WorkloadResult:
    config: WorkloadBenchConfig
    plan: EnginePlan
    machine: MachineInfo
    tables: Tables  # every pass's requests pooled; targets judged over the passes
    passes: tuple[PassSummary, ...]  # empty for one pass
    failed: dict[str, str]  # configuration -> why its engine process stopped
    other_load_cores: float | None  # cores other processes kept busy, mean over passes
    steal_cores: float | None  # of it, what the hypervisor took
    # Redis keys of this run deleted afterwards; None: none to delete or not known (a vLLM
    # engine's), so they stay under the run's tenant salt until Redis evicts them
    redis_keys_deleted: int | None
    vllm_info: JsonObject | None  # versions and threads as vLLM's processes reported them

    @property
    def configs(self) -> tuple[ConfigSummary, ...]:
        return self.tables.configs

    @property
    def ideal(self) -> ConfigSummary | None:
        return self.tables.ideal

    @property
    def targets(self) -> tuple[TargetResult, ...]:
        return self.tables.targets

    def params(self) -> JsonObject:
        from kvport.connectors.offloading.config import redacted_url

        cfg = self.config
        out = {**cfg.params(), "plan": dataclasses.asdict(self.plan), "disk_dir": cfg.disk_dir,
               "redis_url": redacted_url(cfg.redis_url) if cfg.redis_url else None}
        if cfg.engine == "vllm":
            out["vllm"] = self.vllm_info
        return out

    def to_json(self) -> JsonObject:
        cfg = self.config
        return {"benchmark": cfg.workload, "workload": cfg.workload, "model": cfg.model,
                "machine": self.machine.to_json(), "params": self.params(),
                "configs": [c.to_json() for c in self.configs],
                "ideal": self.ideal.to_json() if self.ideal is not None else None,
                "targets": [t.to_json() for t in self.targets],
                # not None when the default model fell back to tiny-llama: its numbers are no demo
                "model_fallback": cfg.model_fallback_note,
                "other_load_cores": self.other_load_cores, "steal_cores": self.steal_cores,
                "failed": self.failed, "redis_keys_deleted": self.redis_keys_deleted,
                "passes": [p.to_json() for p in self.passes]}
