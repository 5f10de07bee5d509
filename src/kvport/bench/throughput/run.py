"""Engine throughput: kvport against transformers' `generate` (and vLLM's CPU build), side by side.

Methodology, chosen so that the comparison is fair:

- Same model files, dtype and thread count for every system. `builtin:NAME` resolves to the
  Hugging Face-format directory kvport materializes, and transformers and vLLM load that very
  directory. kvport and transformers run in this process with `torch.get_num_threads()` threads;
  vLLM runs in a process of its own with `OMP_NUM_THREADS` set to the same number, and reports the
  count it ended up with (recorded per system).
- Same prompts: random token ids from a seeded generator, special tokens (BOS, EOS, PAD, UNK and
  every special added token) excluded, equal lengths within a batch so nothing is padded.
- Greedy decoding with EOS ignored: kvport `SamplingParams(max_tokens=N, temperature=0.0,
  ignore_eos=True)`, transformers `min_new_tokens=N, max_new_tokens=N, do_sample=False`, vLLM the
  same as kvport. Every run is checked to have produced exactly N tokens per prompt.
- Decode throughput at batch B = B * (N - 1) / (t(generate N tokens) - t(generate 1 token)) with
  the same B prompts: the difference removes prefill and per-call overhead, leaving N - 1 decode
  steps. Prefill throughput = L / t(generate 1 token from one L-token prompt).
- Nothing is served from a cache: prefix caching is off in kvport and vLLM (transformers keeps no
  cache across calls). kvport and vLLM get `max_num_batched_tokens >= L` so the prompt is one
  chunk; if L exceeds kvport's default budget, kvport with its default chunking is measured too.
- Each system is warmed up once (every task, with few tokens), then systems are interleaved
  across repeats (A B C A B C ...) so slow drifts of a noisy machine hit all of them alike, and
  each time is the median over repeats.
- Next to the systems, per model, the ceilings this machine sets (floors): decode tokens/s if a
  step cost only its weight reads at the measured read bandwidth, prefill tokens/s if it cost
  only its flops at the rate torch.mm reaches.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvport.bench.common.command import JsonObject
from kvport.bench.common.machine import MachineInfo, loadavg, machine_info
from kvport.bench.common.models import resolve_model_dir
from kvport.bench.common.stats import ratio
from kvport.bench.throughput.config import ThroughputConfig
from kvport.bench.throughput.floors import Ceilings, ceilings
from kvport.bench.throughput.measure import Measured, measure_systems


@dataclass(frozen=True)
class DecodeResult:
    batch: int
    tokens_per_s: float | None  # from median times; None when noise made t(N) <= t(1)
    best_tokens_per_s: float | None  # the best round's: less hurt by other load on the machine
    t1_s: list[float]  # per repeat: generate 1 token
    tn_s: list[float]  # per repeat: generate N tokens


@dataclass(frozen=True)
class PrefillResult:
    prompt_len: int
    tokens_per_s: float  # from the median time
    best_tokens_per_s: float  # from the fastest round
    t_s: list[float]  # per repeat


@dataclass(frozen=True)
class SystemResult:
    system: str
    status: str  # "ok", "skipped" (could not start) or "failed" (broke while measured)
    reason: str | None = None
    version: str | None = None
    threads: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    decode: tuple[DecodeResult, ...] = ()
    prefill: PrefillResult | None = None
    ratio_to_transformers: dict[str, float | None] = field(default_factory=dict)
    ratio_to_vllm: dict[str, float | None] = field(default_factory=dict)
    greedy_agreement: float | None = None  # mean share of tokens before divergence from HF
    other_load: tuple[float | None, ...] = ()  # per round, see OtherLoadMeter

    def metrics(self) -> dict[str, float | None]:
        """{"decode_b1": tok/s, ..., "prefill": tok/s}."""
        out: dict[str, float | None] = {f"decode_b{d.batch}": d.tokens_per_s for d in self.decode}
        if self.prefill is not None:
            out["prefill"] = self.prefill.tokens_per_s
        return out


@dataclass(frozen=True)
class ModelResult:
    model: str
    model_dir: str
    ceilings: Ceilings
    systems: tuple[SystemResult, ...]

    def to_json(self) -> JsonObject:
        return {"model": self.model, "model_dir": self.model_dir,
                "ceilings": self.ceilings.to_json(),
                "systems": [dataclasses.asdict(s) for s in self.systems]}


@dataclass(frozen=True)
class ThroughputResult:
    config: ThroughputConfig
    machine: MachineInfo
    models: tuple[ModelResult, ...]
    loadavg_end: tuple[float, float, float] | None

    def to_json(self) -> JsonObject:
        return {"benchmark": "throughput", "config": self.config.to_json(),
                "machine": {**self.machine.to_json(), "loadavg_end": self.loadavg_end},
                "models": [m.to_json() for m in self.models]}


def run_throughput(cfg: ThroughputConfig,
                   log: Callable[[str], None] | None = None) -> ThroughputResult:
    """Measures every model of `cfg`: per model, one SystemResult per system."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    machine = machine_info()
    models = tuple(run_model(cfg, spec, say) for spec in cfg.models)
    return ThroughputResult(cfg, machine, models, loadavg())


def run_model(cfg: ThroughputConfig, spec: str, say: Callable[[str], None]) -> ModelResult:
    """Starts, warms up and measures every system on one model, interleaved across repeats."""
    model_dir = resolve_model_dir(spec)
    measured = measure_systems(cfg, spec, model_dir, say)
    systems = [_result(cfg, m) for m in measured]
    return ModelResult(spec, str(model_dir),
                       ceilings(model_dir, cfg.dtype, cfg.batch_sizes, cfg.prefill_len),
                       tuple(compare(cfg, systems, {m.name: m for m in measured})))


def _result(cfg: ThroughputConfig, m: Measured) -> SystemResult:
    base = SystemResult(m.name, m.status, m.reason, m.version, m.threads, m.settings,
                        other_load=tuple(m.other_load))
    return summarize(cfg, base, m.rounds) if m.status == "ok" else base


def summarize(cfg: ThroughputConfig, result: SystemResult,
              rounds: Sequence[dict[str, float]]) -> SystemResult:
    """`result` with `decode` and `prefill` from the timed rounds' seconds per task: throughput
    from the median times (the reported figure) and that of the best round (less sensitive to
    other load on the machine)."""
    times = {key: [r[key] for r in rounds] for key in rounds[0]}
    decode = []
    for b in cfg.batch_sizes:
        t1, tn = times.get(f"decode/b{b}/n1"), times.get(f"decode/b{b}/nN")
        if t1 is None or tn is None:
            continue
        tokens = b * (cfg.decode_tokens - 1)
        per_round = [r for r in (_rate(tokens, n - one) for one, n in zip(t1, tn)) if r is not None]
        median = _rate(tokens, statistics.median(tn) - statistics.median(t1))
        decode.append(DecodeResult(b, median, max(per_round, default=None), t1, tn))
    prefill = None
    if "prefill" in times:
        t = times["prefill"]
        prefill = PrefillResult(cfg.prefill_len, cfg.prefill_len / statistics.median(t),
                                cfg.prefill_len / min(t), t)
    return dataclasses.replace(result, decode=tuple(decode), prefill=prefill)


def compare(cfg: ThroughputConfig, results: list[SystemResult],
            measured: dict[str, Measured]) -> list[SystemResult]:
    """Each result with its ratios to transformers' and to vLLM's metrics, and its greedy
    agreement with transformers' outputs: a check that every system really ran the same model
    (float32 greedy should agree almost everywhere)."""
    ok = {r.system: r for r in results if r.status == "ok"}
    vllm, base = ok.get("vllm"), ok.get("transformers")
    key = f"decode/b{max(cfg.batch_sizes)}/nN"
    base_out = measured["transformers"].last_outputs.get(key) if base is not None else None
    out = []
    for r in results:
        if r.status != "ok":
            out.append(r)
            continue
        changes: dict[str, Any] = {}
        if vllm is not None:
            changes["ratio_to_vllm"] = _ratios(r, vllm)
        if base is not None:
            changes["ratio_to_transformers"] = _ratios(r, base)
            mine = measured[r.system].last_outputs.get(key)
            if mine is not None and base_out is not None and r is not base:
                changes["greedy_agreement"] = statistics.mean(
                    _common_prefix(a, b) / len(b) for a, b in zip(mine, base_out))
        out.append(dataclasses.replace(r, **changes))
    return out


def _ratios(result: SystemResult, base: SystemResult) -> dict[str, float | None]:
    theirs = base.metrics()
    return {m: ratio(v, theirs.get(m)) for m, v in result.metrics().items()}


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
