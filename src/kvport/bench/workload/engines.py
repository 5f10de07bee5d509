"""The engines of a workload benchmark's pass: each configuration's, started (kvport's in this
process, or a vLLM engine process), its outcome collected, and all shut down even if one fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvport.bench.common.command import JsonObject
from kvport.bench.common.models import resolve_model_dir
from kvport.bench.workload.config import WorkloadBenchConfig
from kvport.bench.workload.plan import ConfigSpec, EnginePlan, max_step_tokens
from kvport.bench.workload.serving import ConfigRunner, Outcome, PhaseRunner
from kvport.bench.workload.workloads import Workload
from kvport.connectors.offloading.config import redacted_url


@dataclass(frozen=True)
class Run:
    """A configuration and the runner of its engine, for one pass."""

    spec: ConfigSpec
    runner: PhaseRunner


def start(cfg: WorkloadBenchConfig, plan: EnginePlan, spec: ConfigSpec,
          workload: Workload) -> Run:
    if cfg.engine == "vllm":
        return _start_vllm(cfg, plan, spec, workload)
    from kvport import LLM

    llm = LLM(cfg.model, dtype=cfg.dtype, block_size=cfg.block_size,
              num_kv_blocks=plan.ideal_num_kv_blocks if spec.ideal else plan.num_kv_blocks,
              max_model_len=plan.max_model_len, max_num_seqs=cfg.concurrency,
              enable_prefix_caching=True, kv_transfer_config=spec.kv_transfer_config, seed=cfg.seed)
    if spec.ideal:
        # The extra blocks only keep prefixes cached: requests hold at most what the other
        # configurations' pool holds, so admission and preemption are theirs. A knob of the
        # engine's block manager, not an LLM argument: only this benchmark needs it.
        llm.engine.kv_cache_manager.max_blocks_in_use = plan.num_kv_blocks
    runner = ConfigRunner(spec.name, llm, workload.start(), cfg.concurrency,
                          cfg.spec.answer_tokens, cold_host=spec.cold_host)
    return Run(spec, runner)


def _start_vllm(cfg: WorkloadBenchConfig, plan: EnginePlan, spec: ConfigSpec,
                workload: Workload) -> Run:
    """The configuration as a vLLM engine in its own process. vLLM has no cap on blocks in use,
    so `ideal` is only the larger pool: with `max_num_seqs = concurrency` and a closed loop, and
    the others' pool holding `concurrency` requests of the longest kind, no configuration ever
    waits for blocks, and admission is the same in all of them."""
    from kvport.bench.workload.vllm_runner import VllmConfigRunner

    blocks = plan.ideal_num_kv_blocks if spec.ideal else plan.num_kv_blocks
    kwargs: JsonObject = {
        "model": str(resolve_model_dir(cfg.model)), "dtype": cfg.dtype, "seed": cfg.seed,
        "enforce_eager": True, "skip_tokenizer_init": True, "enable_prefix_caching": True,
        "max_model_len": plan.max_model_len, "max_num_seqs": cfg.concurrency,
        # every prompt of a step prefills whole, never in chunks: vLLM 0.32's ExampleConnector
        # saves a chunked prompt's first chunk under the whole prompt's name, and loading it
        # later fails (a shape mismatch that stops the engine)
        "max_num_batched_tokens": max_step_tokens(cfg, plan.max_model_len),
        "num_gpu_blocks_override": blocks + 1,  # vLLM holds block 0 back (its null block)
    }
    if spec.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = spec.kv_transfer_config
    # the process loads its model while the next configuration's starts
    runner = VllmConfigRunner(spec.name, kwargs, workload.start(), cfg.concurrency,
                              cfg.spec.answer_tokens, cold_host=spec.cold_host,
                              python=cfg.vllm_python, threads=cfg.threads)
    return Run(spec, runner)


def check_block_size(cfg: WorkloadBenchConfig, run: Run) -> None:
    """A vLLM engine's KV block must be the one the plan sized the pools with."""
    info: JsonObject = getattr(run.runner, "info", {})
    got = info.get("kv_block_size", cfg.block_size)
    if got != cfg.block_size:
        raise RuntimeError(f"config {run.spec.name}: vLLM's KV block is {got} tokens, the plan "
                           f"assumed {cfg.block_size}")


def outcome(run: Run) -> Outcome:
    r = run.runner
    return Outcome(tuple(r.records), r.busy_s, dict(r.phase_busy_s), r.metrics(),
                   r.evicted_blocks(), without_password(run.spec.kv_transfer_config),
                   run.spec.ideal, r.resets_unsupported)


def without_password(config: JsonObject | None) -> JsonObject | None:
    """The config as the JSON records it: a Redis URL's password replaced by ***."""
    if config is None:
        return None
    extra = config.get("kv_connector_extra_config")
    if not isinstance(extra, dict) or not isinstance(extra.get("secondary_tiers"), list):
        return config
    tiers: list[Any] = [dict(t, url=redacted_url(t["url"])) if isinstance(t, dict)
                        and isinstance(t.get("url"), str) else t
                        for t in extra["secondary_tiers"]]
    return {**config, "kv_connector_extra_config": {**extra, "secondary_tiers": tiers}}


def shutdown(runs: list[Run]) -> None:
    """Shut every engine down even if one fails (its worker threads would outlive the run)."""
    errors: list[BaseException] = []
    for run in runs:
        try:
            run.runner.shutdown()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others' shutdown
            errors.append(exc)
    if errors:
        raise errors[0]
