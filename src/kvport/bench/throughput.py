"""Engine throughput: kvport against transformers' `generate` (and vLLM's CPU build), side by side.

Methodology, chosen so that the comparison is fair:

- Same model files, dtype and thread count for every system. `builtin:NAME` resolves to the
  Hugging Face-format directory kvport materializes, and transformers and vLLM load that very
  directory. kvport and transformers run in this process with `torch.get_num_threads()` threads;
  vLLM runs in its own virtualenv with `OMP_NUM_THREADS` set to the same number, and reports the
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
- Next to the systems, per model, the ceilings this machine sets (kvport.bench.floors): decode
  tokens/s if a step cost only its weight reads at the measured read bandwidth, prefill tokens/s
  if it cost only its flops at the rate torch.mm reaches.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvport.bench import (
    KvportSystem,
    OtherLoadMeter,
    System,
    machine_info,
    prompt_sampler,
    resolve_model_dir,
)
from kvport.bench.floors import ceilings
from kvport.bench.vllm_baseline import DEFAULT_VLLM_PYTHON, default_vllm_python

BASELINES = ("transformers", "vllm")
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class ThroughputConfig:
    models: tuple[str, ...] = ("builtin:tiny-llama",)
    dtype: str = "float32"
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 128
    decode_tokens: int = 128
    prefill_len: int = 2048
    repeats: int = 3
    baselines: tuple[str, ...] = BASELINES
    vllm_python: str | None = field(default_factory=default_vllm_python)
    vllm_kv_space_gib: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models: need at least one model")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes {self.batch_sizes}: need positive integers")
        for name in ("prompt_len", "prefill_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens={self.decode_tokens}: must be >= 2")
        unknown = set(self.baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; accepted: {list(BASELINES)}")

    @property
    def max_model_len(self) -> int:
        return max(self.prefill_len + 1, self.prompt_len + self.decode_tokens)

    @property
    def max_num_seqs(self) -> int:
        return max(64, *self.batch_sizes)


@dataclass
class DecodeResult:
    batch: int
    tokens_per_s: float | None  # from median times; None when noise made t(N) <= t(1)
    best_tokens_per_s: float | None  # the best round's: less hurt by other load on the machine
    t1_s: list[float]  # per repeat: generate 1 token
    tn_s: list[float]  # per repeat: generate N tokens


@dataclass
class PrefillResult:
    prompt_len: int
    tokens_per_s: float  # from the median time
    best_tokens_per_s: float  # from the fastest round
    t_s: list[float]  # per repeat


@dataclass
class SystemResult:
    system: str
    status: str  # "ok", "skipped" (could not start) or "failed" (broke while measured)
    reason: str | None = None
    version: str | None = None
    threads: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    decode: list[DecodeResult] = field(default_factory=list)
    prefill: PrefillResult | None = None
    ratio_to_transformers: dict[str, float | None] = field(default_factory=dict)
    ratio_to_vllm: dict[str, float | None] = field(default_factory=dict)
    greedy_agreement: float | None = None  # mean share of tokens before divergence from HF
    other_load: list[float | None] = field(default_factory=list)  # per round, see OtherLoadMeter

    def metrics(self) -> dict[str, float | None]:
        """{"decode_b1": tok/s, ..., "prefill": tok/s}."""
        out: dict[str, float | None] = {f"decode_b{d.batch}": d.tokens_per_s for d in self.decode}
        if self.prefill is not None:
            out["prefill"] = self.prefill.tokens_per_s
        return out


def make_tasks(cfg: ThroughputConfig, max_tokens_cap: int | None = None) -> list[dict[str, Any]]:
    n = cfg.decode_tokens if max_tokens_cap is None else min(cfg.decode_tokens, max_tokens_cap)
    tasks: list[dict[str, Any]] = []
    for b in cfg.batch_sizes:
        tasks.append({"key": f"decode/b{b}/n1", "set": "decode", "batch": b, "max_tokens": 1})
        tasks.append({"key": f"decode/b{b}/nN", "set": "decode", "batch": b, "max_tokens": n,
                      "keep_output": True})
    tasks.append({"key": "prefill", "set": "prefill", "batch": 1, "max_tokens": 1})
    return tasks


def _starters(cfg: ThroughputConfig, spec: str, model_dir: Path
              ) -> list[tuple[str, Callable[[], System], list[dict[str, Any]]]]:
    """(name, start, tasks) of every system to measure on one model, kvport first."""
    from kvport.config import EngineConfig

    tasks = make_tasks(cfg)
    default_budget = EngineConfig.max_num_batched_tokens
    budget = max(cfg.prefill_len, max(cfg.batch_sizes) * cfg.prompt_len, default_budget)
    common = {"max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs}
    out: list[tuple[str, Callable[[], System], list[dict[str, Any]]]] = [
        ("kvport", lambda: KvportSystem("kvport", spec, cfg.dtype, budget, **common), tasks)]
    if cfg.prefill_len > default_budget:
        # Measured for prefill only: that is where one chunk versus several matters.
        prefill_only = [t for t in tasks if t["key"] == "prefill"]
        out.append(("kvport-default-chunking",
                    lambda: KvportSystem("kvport-default-chunking", spec, cfg.dtype, None, **common),
                    prefill_only))
    if "transformers" in cfg.baselines:
        from kvport.bench.hf_baseline import HFSystem

        out.append(("transformers", lambda: HFSystem(model_dir, cfg.dtype), tasks))
    if "vllm" in cfg.baselines:
        from kvport.bench.vllm_baseline import VllmSystem

        def start_vllm() -> System:
            if cfg.vllm_python is None:
                raise FileNotFoundError(f"no vLLM interpreter ({DEFAULT_VLLM_PYTHON} does not "
                                        "exist; pass --vllm-python)")
            return VllmSystem(cfg.vllm_python, model_dir, cfg.dtype, torch.get_num_threads(),
                              max_num_batched_tokens=budget, kv_space_gib=cfg.vllm_kv_space_gib,
                              **common)

        out.append(("vllm", start_vllm, tasks))
    return out


def _start(name: str, start: Callable[[], System], warmup: list[dict[str, Any]],
           sets: dict[str, list[list[int]]]) -> System:
    system = start()
    try:
        system.run_tasks(sets, warmup)
    except BaseException:
        system.close()
        raise
    return system


def run_model(cfg: ThroughputConfig, spec: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Starts, warms up and measures every system on one model, interleaved across repeats."""
    model_dir = resolve_model_dir(spec)
    draw = prompt_sampler(model_dir, cfg.seed)
    sets = {"decode": draw(max(cfg.batch_sizes), cfg.prompt_len), "prefill": draw(1, cfg.prefill_len)}
    active: list[tuple[System, list[dict[str, Any]]]] = []
    results: dict[str, SystemResult] = {}
    rounds: dict[str, list[dict[str, Any]]] = {}
    warmup = make_tasks(cfg, WARMUP_TOKENS)  # every task shape once, with few tokens
    meter = OtherLoadMeter()
    try:
        for name, start, tasks in _starters(cfg, spec, model_dir):
            say(f"[{spec}] starting {name}")
            keys = {t["key"] for t in tasks}
            try:
                system = _start(name, start, [t for t in warmup if t["key"] in keys], sets)
            except Exception as exc:  # noqa: BLE001 - one that cannot run is reported, others go on
                results[name] = SystemResult(name, "skipped", reason=_reason(exc))
                say(f"[{spec}] {name} skipped: {results[name].reason}")
                continue
            results[name] = SystemResult(name, "ok", version=system.version,
                                         threads=system.threads, settings=system.settings)
            if system.threads != torch.get_num_threads():
                say(f"[{spec}] warning: {name} runs {system.threads} threads, "
                    f"not {torch.get_num_threads()}")
            rounds[name] = []
            active.append((system, tasks))
        for r in range(cfg.repeats):
            for system, tasks in list(active):
                try:
                    meter.start()
                    rounds[system.name].append(system.run_tasks(sets, tasks))
                    results[system.name].other_load.append(meter.stop())
                except Exception as exc:  # noqa: BLE001 - reported; the others go on
                    results[system.name].status = "failed"
                    results[system.name].reason = _reason(exc)
                    active.remove((system, tasks))
                    system.close()
            say(f"[{spec}] round {r + 1}/{cfg.repeats} done")
    finally:
        for system, _ in active:
            system.close()
    for name, result in results.items():
        if result.status == "ok":
            summarize(cfg, result, rounds[name])
    _compare(cfg, list(results.values()), rounds)
    return {"model": spec, "model_dir": str(model_dir), "ceilings": ceilings(
                model_dir, cfg.dtype, cfg.batch_sizes, cfg.prefill_len),
            "systems": [asdict(r) for r in results.values()]}


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def summarize(cfg: ThroughputConfig, result: SystemResult, rounds: list[dict[str, Any]]) -> None:
    """Fills `decode` and `prefill` from the timed rounds: throughput from the median times (the
    reported figure) and that of the best round (less sensitive to other load on the machine)."""
    times = {key: [r["times"][key] for r in rounds] for key in rounds[0]["times"]}
    for b in cfg.batch_sizes:
        t1, tn = times.get(f"decode/b{b}/n1"), times.get(f"decode/b{b}/nN")
        if t1 is None or tn is None:
            continue
        tokens = b * (cfg.decode_tokens - 1)
        per_round = [r for r in (_rate(tokens, n - one) for one, n in zip(t1, tn)) if r is not None]
        median = _rate(tokens, statistics.median(tn) - statistics.median(t1))
        result.decode.append(DecodeResult(b, median, max(per_round, default=None), t1, tn))
    if "prefill" in times:
        t = times["prefill"]
        result.prefill = PrefillResult(cfg.prefill_len, cfg.prefill_len / statistics.median(t),
                                       cfg.prefill_len / min(t), t)


def _compare(cfg: ThroughputConfig, results: list[SystemResult],
             rounds: dict[str, list[dict[str, Any]]]) -> None:
    """Ratio of each metric to transformers' and to vLLM's, and greedy agreement with
    transformers' outputs: a check that every system really ran the same model (fp32 greedy
    should agree almost everywhere)."""
    vllm = next((r for r in results if r.system == "vllm" and r.status == "ok"), None)
    if vllm is not None:
        for r in results:
            if r.status == "ok":
                r.ratio_to_vllm = {m: _ratio(v, vllm.metrics().get(m))
                                   for m, v in r.metrics().items()}
    base = next((r for r in results if r.system == "transformers" and r.status == "ok"), None)
    if base is None:
        return
    base_metrics = base.metrics()
    key = f"decode/b{max(cfg.batch_sizes)}/nN"
    base_out = rounds["transformers"][-1]["outputs"].get(key)
    for r in results:
        if r.status != "ok":
            continue
        r.ratio_to_transformers = {m: _ratio(v, base_metrics.get(m)) for m, v in r.metrics().items()}
        out = rounds[r.system][-1]["outputs"].get(key)
        if out is not None and base_out is not None and r is not base:
            r.greedy_agreement = statistics.mean(
                _common_prefix(a, b) / len(b) for a, b in zip(out, base_out))


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_throughput(cfg: ThroughputConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measures every model of `cfg`; returns the JSON-ready result: config, machine facts and,
    per model, one `SystemResult` per system."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    machine = machine_info()
    models = [run_model(cfg, spec, say) for spec in cfg.models]
    machine["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"benchmark": "throughput", "config": asdict(cfg), "machine": machine, "models": models}
