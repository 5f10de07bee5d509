"""The typed result of `kvport bench serve`: one `RunResult` per (scenario, system) summarized
from vLLM's saved client result and the servers' counters, the ratios against the no-connector
run of the same scenario, and the targets' verdicts.

TTFT, ITL and throughputs are vLLM's client's own figures (`median_ttft_ms`, `p99_ttft_ms`,
`p50_itl_ms`, `output_throughput`, `total_token_throughput`: prompt plus output tokens of
finished requests per second of the run). Only "TTFT p50 after the first turn" is computed
here, from the client's per-request `ttfts` and the turn each row of the dataset is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvport.bench.common.command import JsonObject
from kvport.bench.common.stats import percentile, ratio
from kvport.bench.serve.config import (
    BASELINE,
    DECODE,
    HOST,
    HOST_REDIS,
    PREFILL_DECODE,
    SHARED_PREFIX,
    SPLIT_REDIS,
    TWO_INSTANCES,
)
from kvport.bench.serve.metrics import HitSummary
from kvport.bench.vllm.engine import VLLM_CPU_BLOCK_SIZE

MS = 1e-3


@dataclass(frozen=True)
class ClientFigures:
    """What one client run measured (seconds; tokens per second)."""

    requests: int  # rows the dataset sent
    completed: int
    failed: int
    duration_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    ttft_p50_after_first_turn_s: float | None  # None: the dataset has no turns
    output_tokens_per_s: float
    total_tokens_per_s: float
    client_queue_p50_s: float | None  # time a request waited in the client for a free slot
    prompt_tokens_mean: float | None
    first_error: str | None


def client_figures(raw: JsonObject, turns: Sequence[int] | None) -> ClientFigures:
    """Summarize vLLM's saved result (with --save-detailed); `turns[i]` is row i's turn."""
    errors = [str(e or "") for e in raw.get("errors", [])]
    ok = [not e for e in errors]
    ttfts = [float(t) for t in raw.get("ttfts", [])]
    after_first = None
    if turns is not None:
        if len(turns) != len(ttfts):
            raise ValueError(f"the client sent {len(ttfts)} requests; the dataset has "
                             f"{len(turns)} rows")
        after_first = percentile([t for t, k, good in zip(ttfts, turns, ok) if k > 0 and good],
                                 50)
    queue = [float(q) for q, good in zip(raw.get("queue_times", []), ok) if good]
    lens = [int(n) for n, good in zip(raw.get("input_lens", []), ok) if good]

    def ms(key: str) -> float | None:
        value = raw.get(key)
        return None if value is None or not raw.get("completed") else float(value) * MS

    return ClientFigures(
        requests=len(errors), completed=int(raw.get("completed", 0)),
        failed=int(raw.get("failed", 0)), duration_s=float(raw.get("duration", 0.0)),
        ttft_p50_s=ms("median_ttft_ms"), ttft_p99_s=ms("p99_ttft_ms"), itl_p50_s=ms("p50_itl_ms"),
        ttft_p50_after_first_turn_s=after_first,
        output_tokens_per_s=float(raw.get("output_throughput", 0.0)),
        total_tokens_per_s=float(raw.get("total_token_throughput", 0.0)),
        client_queue_p50_s=percentile(queue, 50), prompt_tokens_mean=(
            sum(lens) / len(lens) if lens else None),
        first_error=next((e.strip().splitlines()[-1] for e in errors if e.strip()), None))


@dataclass(frozen=True)
class RunResult:
    scenario: str
    system: str
    instances: int
    figures: ClientFigures
    hits: HitSummary
    counters: dict[str, float]  # the servers' counters' change over the run, summed
    requests_per_instance: list[int] | None  # through the forwarder: as it routed them
    other_load_cores: float | None  # CPU other processes used meanwhile (common.machine)
    raw: JsonObject = field(repr=False)  # vLLM's saved result, whole
    instance_hits: list[HitSummary] | None = None  # several servers: each one's
    prefill_p50_s: float | None = None  # split+redis: the prefill server's answer, p50
    # model replies: rows whose answer now equals the reply the transcripts carry
    replies_matched: int | None = None

    @property
    def decode_computed_per_request(self) -> float | None:
        """split+redis: prompt tokens the decode server computed per finished request."""
        if self.system != SPLIT_REDIS or not self.instance_hits or not self.figures.completed:
            return None
        return self.instance_hits[DECODE].computed_tokens / self.figures.completed

    def value(self, metric: str) -> float | None:
        """A client figure, or DECODE_COMPUTED."""
        if metric == DECODE_COMPUTED:
            return self.decode_computed_per_request
        value: float | None = getattr(self.figures, metric)
        return value

    def to_json(self) -> JsonObject:
        return {"scenario": self.scenario, "system": self.system, "instances": self.instances,
                **asdict(self.figures), "hits": self.hits.to_json(), "counters": self.counters,
                "requests_per_instance": self.requests_per_instance,
                "instance_hits": None if self.instance_hits is None else [
                    h.to_json() for h in self.instance_hits],
                "prefill_p50_s": self.prefill_p50_s, "replies_matched": self.replies_matched,
                DECODE_COMPUTED: self.decode_computed_per_request,
                "other_load_cores": self.other_load_cores, "vllm_bench_serve": self.raw}


DECODE_COMPUTED = "decode_computed_prompt_tokens_per_request"


METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "ttft_p50_after_first_turn_s",
           "output_tokens_per_s", "total_tokens_per_s")


def versus(runs: Sequence[RunResult], scenario: str, system: str, other: str,
           metric: str) -> float | None:
    """`system`'s `metric` over `other`'s in `scenario` (None if either is missing)."""
    by_name = {r.system: r for r in runs if r.scenario == scenario}
    if system not in by_name or other not in by_name:
        return None
    return ratio(by_name[system].value(metric), by_name[other].value(metric))


def ratios(runs: Sequence[RunResult], run: RunResult) -> dict[str, float | None]:
    """Every METRIC of `run` over the no-connector run of its scenario."""
    return {m: versus(runs, run.scenario, run.system, BASELINE, m) for m in METRICS}


@dataclass(frozen=True)
class Target:
    scenario: str
    system: str
    metric: str
    versus: str | None  # the system it is compared with, in the same scenario; None: the
    limit: float  # value itself is held to the limit
    at_most: bool  # True: value <= limit; False: value >= limit


# The targets: shared prefix, host tier vs no connector at the same request rate; two
# instances on one Redis vs the same two instances without it; a decode server that computes at
# most the last, partial block of each prompt.
TARGETS = (
    Target(SHARED_PREFIX, HOST, "ttft_p50_s", BASELINE, 1 / 5, at_most=True),
    Target(SHARED_PREFIX, HOST, "output_tokens_per_s", BASELINE, 1.0, at_most=False),
    Target(TWO_INSTANCES, HOST_REDIS, "ttft_p50_after_first_turn_s", HOST, 1 / 3, at_most=True),
    Target(TWO_INSTANCES, HOST_REDIS, "total_tokens_per_s", HOST, 1.8, at_most=False),
    Target(PREFILL_DECODE, SPLIT_REDIS, DECODE_COMPUTED, None, VLLM_CPU_BLOCK_SIZE, at_most=True),
)


@dataclass(frozen=True)
class Verdict:
    target: Target
    ratio: float | None  # of the two systems; for a target without `versus`, the value
    met: bool | None  # None: not measured

    def to_json(self) -> JsonObject:
        return {**asdict(self.target), "ratio": self.ratio, "met": self.met}


def evaluate_targets(runs: Sequence[RunResult]) -> list[Verdict]:
    """A verdict per target whose scenario ran (failed requests make it unjudged: the figures
    of a run that lost requests are not comparable)."""
    verdicts = []
    for t in TARGETS:
        if not any(r.scenario == t.scenario for r in runs):
            continue
        if t.versus is None:
            value = next((r.value(t.metric) for r in runs
                          if r.scenario == t.scenario and r.system == t.system), None)
        else:
            value = versus(runs, t.scenario, t.system, t.versus, t.metric)
        clean = all(r.figures.failed == 0 for r in runs if r.scenario == t.scenario)
        met = None if value is None or not clean else (
            value <= t.limit if t.at_most else value >= t.limit)
        verdicts.append(Verdict(t, value, met))
    return verdicts


@dataclass(frozen=True)
class ServeBenchResult:
    params: JsonObject
    model_dir: str
    pool: JsonObject  # config.PoolPlan, and the working sets it is compared with
    machine: JsonObject
    vllm_version: str | None
    runs: list[RunResult]
    servers: list[JsonObject]  # each started server: system, port, command, ready_s
    redis: JsonObject | None  # where the Redis tier was, and the keys deleted after
    wall_s: float
    notes: list[str]

    @property
    def verdicts(self) -> list[Verdict]:
        return evaluate_targets(self.runs)

    def to_json(self) -> JsonObject:
        return {"benchmark": "serve", "params": self.params, "model_dir": self.model_dir,
                "pool": self.pool, "machine": self.machine, "vllm_version": self.vllm_version,
                "runs": [{**r.to_json(), "ratio_vs_no_connector": ratios(self.runs, r)}
                         for r in self.runs],
                "targets": [v.to_json() for v in self.verdicts], "servers": self.servers,
                "redis": self.redis, "wall_s": self.wall_s, "notes": self.notes}
