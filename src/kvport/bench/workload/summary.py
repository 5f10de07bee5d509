"""One configuration's figures over a workload benchmark's requests (typed; JSON when written).

Latencies, token rates and the engine's and connector's hit rates come from the requests
themselves (timestamps, tokens, cached and loaded tokens); per-tier hit rates and bytes moved from
the connector's counters in `LLM.get_metrics()` (None where this kvport or connector has none).
Token rates count prompt and output tokens over the time the configuration ran its phases, over
all phases and over the later phases: rounds >= 2 (multi-turn), a document's later queries
(long-doc), where the first computation of every prefix is behind. Every ratio is against
`no-connector` measured in the same run, `ideal`'s included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvport.bench.common.command import JsonObject
from kvport.bench.common.stats import mean_or_none, percentile
from kvport.bench.workload.serving import Outcome, RequestRecord

TIERS = ("host", "disk", "redis")


def later_suffix(workload: str) -> str:
    """Names the requests after each prefix's first computation: rounds >= 2, later queries."""
    return "after_round1" if workload == "multi-turn" else "repeat"


@dataclass(frozen=True)
class Ratios:
    """A configuration's figures over no-connector's of the same run."""

    ttft: float | None = None  # TTFT p50
    throughput: float | None = None  # total tokens/s
    ttft_later: float | None = None  # TTFT p50 of the later requests
    throughput_later: float | None = None  # tokens/s of the later phases


@dataclass(frozen=True)
class ConfigSummary:
    name: str
    later: str  # the suffix of the later requests' keys (later_suffix)
    kv_transfer_config: JsonObject | None
    records: tuple[RequestRecord, ...]
    phase_wall: dict[int, float]  # phase -> seconds the configuration ran it
    wall_s: float
    input_tokens: int
    output_tokens: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    prefix_hit_rate: float | None  # share of prompt tokens the engine's own cache provided
    connector_hit_rate: float | None  # share a connector loaded
    cached_token_rate: float | None  # both
    engine_evicted_blocks: int | None
    resets_unsupported: int
    metrics: JsonObject | None
    tier_hit_rates: dict[str, float | None]  # tier -> share of all prompt tokens it served
    bytes_loaded: dict[str, float | None]
    bytes_stored: dict[str, float | None]
    load_seconds: dict[str, float | None]
    ttft_p50_later_s: float | None
    wall_s_later: float
    total_tokens_per_s_later: float | None
    # what a later request's TTFT is made of: prompt tokens it still computed (a hit that is
    # short of the ideal's), and engine steps to its first token (an async load adds steps)
    computed_tokens_mean_later: float | None
    ttft_steps_mean_later: float | None
    ratios: Ratios = field(default_factory=Ratios)
    ideal_ttft_p50_s: float | None = None  # ideal's, beside every configuration but the baseline
    ideal_ttft_p50_later_s: float | None = None

    @property
    def num_requests(self) -> int:
        return len(self.records)

    @property
    def total_tokens_per_s(self) -> float | None:
        return (self.input_tokens + self.output_tokens) / self.wall_s if self.wall_s else None

    def to_json(self) -> JsonObject:
        sfx, wall = self.later, self.wall_s
        return {
            "name": self.name, "kv_transfer_config": self.kv_transfer_config,
            "num_requests": self.num_requests, "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens, "wall_s": wall,
            "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s, "e2e_p50_s": self.e2e_p50_s,
            "input_tokens_per_s": self.input_tokens / wall if wall else None,
            "output_tokens_per_s": self.output_tokens / wall if wall else None,
            "total_tokens_per_s": self.total_tokens_per_s,
            "prefix_hit_rate": self.prefix_hit_rate,
            "connector_hit_rate": self.connector_hit_rate,
            "cached_token_rate": self.cached_token_rate,
            "ideal_ttft_p50_s": self.ideal_ttft_p50_s,
            "phase_wall_s": [self.phase_wall[p] for p in sorted(self.phase_wall)],
            "engine_evicted_blocks": self.engine_evicted_blocks,
            "resets_unsupported": self.resets_unsupported, "metrics": self.metrics,
            "tier_hit_rates": self.tier_hit_rates, "bytes_loaded": self.bytes_loaded,
            "bytes_stored": self.bytes_stored, "load_seconds": self.load_seconds,
            f"ttft_p50_{sfx}_s": self.ttft_p50_later_s, f"wall_s_{sfx}": self.wall_s_later,
            f"total_tokens_per_s_{sfx}": self.total_tokens_per_s_later,
            f"computed_tokens_mean_{sfx}": self.computed_tokens_mean_later,
            f"ttft_steps_mean_{sfx}": self.ttft_steps_mean_later,
            "per_request": [r.to_json() for r in self.records],
            "ttft_ratio_vs_baseline": self.ratios.ttft,
            "throughput_ratio_vs_baseline": self.ratios.throughput,
            f"ttft_p50_{sfx}_ratio_vs_baseline": self.ratios.ttft_later,
            f"throughput_{sfx}_ratio_vs_baseline": self.ratios.throughput_later,
            f"ideal_ttft_p50_{sfx}_s": self.ideal_ttft_p50_later_s}


def later_phases(records: tuple[RequestRecord, ...]) -> set[int]:
    """The phases of the requests after each prefix's first computation: a phase is one round
    (multi-turn) or one query (long-doc), so no phase mixes first and later requests."""
    first = {r.phase for r in records if r.index == 0}
    return {r.phase for r in records if r.phase not in first}


def summarize(name: str, outcome: Outcome, workload: str) -> ConfigSummary:
    recs = outcome.records
    later = later_phases(recs)
    later_recs = [r for r in recs if r.phase in later]
    later_wall = sum(outcome.phase_busy_s[p] for p in later)
    later_tokens = sum(r.prompt_tokens + r.output_tokens for r in later_recs)
    n_in = sum(r.prompt_tokens for r in recs)
    local = sum(r.num_cached_tokens - r.num_external_tokens for r in recs)
    tiers = (outcome.metrics or {}).get("connector") or {}
    return ConfigSummary(
        name=name, later=later_suffix(workload), kv_transfer_config=outcome.kv_transfer_config,
        records=recs, phase_wall=outcome.phase_busy_s, wall_s=outcome.busy_s,
        input_tokens=n_in, output_tokens=sum(r.output_tokens for r in recs),
        ttft_p50_s=percentile([r.ttft_s for r in recs], 50),
        ttft_p90_s=percentile([r.ttft_s for r in recs], 90),
        ttft_p99_s=percentile([r.ttft_s for r in recs], 99),
        e2e_p50_s=percentile([r.e2e_s for r in recs], 50),
        prefix_hit_rate=_rate(local, n_in),
        connector_hit_rate=_rate(sum(r.num_external_tokens for r in recs), n_in),
        cached_token_rate=_rate(sum(r.num_cached_tokens for r in recs), n_in),
        engine_evicted_blocks=outcome.engine_evicted_blocks,
        resets_unsupported=outcome.resets_unsupported, metrics=outcome.metrics,
        tier_hit_rates={t: _rate(tiers.get(t, {}).get("hit_tokens"), n_in) for t in TIERS},
        bytes_loaded={t: tiers.get(t, {}).get("bytes_loaded") for t in TIERS},
        bytes_stored={t: tiers.get(t, {}).get("bytes_stored") for t in TIERS},
        load_seconds={t: tiers.get(t, {}).get("load_seconds") for t in TIERS},
        # round >= 2 / a document's later queries
        ttft_p50_later_s=percentile([r.ttft_s for r in recs if r.index >= 1], 50),
        wall_s_later=later_wall,
        total_tokens_per_s_later=later_tokens / later_wall if later_wall else None,
        computed_tokens_mean_later=mean_or_none([r.prompt_tokens - r.num_cached_tokens
                                                 for r in later_recs]),
        ttft_steps_mean_later=mean_or_none([r.ttft_steps for r in later_recs]))


def _rate(hit: object, total: int) -> float | None:
    return hit / total if isinstance(hit, (int, float)) and total > 0 else None
