"""The engines of a workload benchmark, sized from its workload: every configuration's pool, the
ideal's, the tiers; and each configuration's connector config for one pass.

The pool holds `concurrency` whole requests of the longest kind (or `pool_fraction` of the working
set if that is more), so requests in flight never wait for pool space, but not every user's or
document's KV: between two rounds of a user the others evict it.

`ideal`: no connector, a pool large enough to keep the whole working set in the engine's prefix
cache, but with the blocks requests may hold at once capped to the others' pool size
(`KVCacheManager.max_blocks_in_use`). It admits and preempts exactly as the others' pool does,
runs the same requests in the same timed phases (nothing computed before the run), and differs
only in that every prefix hit is a free local hit: as if the connector's loads, and the stores
that feed them, cost nothing.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvport.bench.common.command import JsonObject
from kvport.config import EngineConfig
from kvport.bench.common.models import resolve_model_dir
from kvport.bench.workload.config import (
    BASELINE,
    EXAMPLE,
    IDEAL,
    REDIS_COLD,
    USER,
    WorkloadBenchConfig,
    WorkloadSpec,
)
from kvport.bench.workload.workloads import (
    MultiTurnSpec,
    Workload,
    make_long_doc,
    make_multi_turn,
    token_source,
)

MIN_HOST_BYTES = 64 << 20
BENCH_SALT_PREFIX = "kvport-bench-"  # + 16 random hex digits: a run's own tenant salt


# vLLM's step budget in these benchmarks: at least this, and every prompt of a step whole.
VLLM_MIN_STEP_TOKENS = 2048

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


@dataclass(frozen=True)
class ConfigSpec:
    name: str
    kv_transfer_config: JsonObject | None = None
    cold_host: bool = False  # drop the engine's cache and the host tier before every phase
    # no connector; a pool that keeps the working set, blocks in use capped to the others' pool
    ideal: bool = False


def plan_engine(cfg: WorkloadBenchConfig) -> EnginePlan:
    import torch

    from kvport.engine.core import blocks_per_request
    from kvport.model.attention import kv_block_bytes
    from kvport.model.kv_groups import kv_cache_groups
    from kvport.model.loader import read_config

    bs = cfg.block_size
    mc = read_config(resolve_model_dir(cfg.model))
    per_token = kv_block_bytes(mc, bs, getattr(torch, cfg.dtype)) // bs
    ws = cfg.spec.working_set_tokens
    max_len = cfg.spec.max_seq_len  # longest prompt + its answer: no more than needed
    # A hybrid model's pool blocks hold one KV cache group's layers each: a request takes a
    # block per group (a sliding group its window and a step's tokens), and the working set's
    # bytes are `per_group` times as many blocks (1 for every other model).
    groups = kv_cache_groups(mc)
    per_group = mc.num_hidden_layers / max(len(g.layer_ids) for g in groups)
    per_seq = blocks_per_request(groups, max_len, bs, max_step_tokens(cfg, max_len))
    if cfg.engine == "vllm":  # vLLM counts a sliding group one block more than its span
        per_seq += sum(g.sliding_window is not None for g in groups)
    # Room for `concurrency` requests of the longest kind at once: requests in flight never
    # queue for pool space or get preempted (a request computes at most max_len - 1 tokens, and
    # the closed loop never has more than `concurrency` requests in the engine).
    pool = max(math.ceil(ws * cfg.pool_fraction / bs * per_group), cfg.concurrency * per_seq)
    # The working set, each session's longest request once more (blocks that straddle its
    # shared and own tokens, a long-doc query's own blocks), and the cap's worth for requests
    # in flight: the LRU free queue hands out never-used blocks before it evicts anything.
    ideal = (math.ceil(ws / bs * per_group) + (_num_sessions(cfg.spec) + 1) * per_seq
             + pool)
    host = max(MIN_HOST_BYTES, ws * per_token * 3 // 2)
    # A hybrid pool block holds one group's layers: the working set is `per_group` times as many.
    return EnginePlan(per_token, ws, max_len, pool, ideal, host, 2 * host,
                      pool * bs / (ws * per_group))


def max_step_tokens(cfg: WorkloadBenchConfig, max_model_len: int) -> int:
    """Tokens one engine step computes at most: kvport's engine's default budget; vLLM's is
    set so that every prompt of a step prefills whole (engines.py)."""
    if cfg.engine == "vllm":
        return max(VLLM_MIN_STEP_TOKENS, cfg.concurrency * max_model_len)
    return int(EngineConfig.__dataclass_fields__["max_num_batched_tokens"].default)


def _num_sessions(spec: WorkloadSpec) -> int:
    return spec.users if isinstance(spec, MultiTurnSpec) else spec.docs


def offloading_config(host_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0,
                      block_tokens: int | None = None, engine: str = "kvport",
                      redis: JsonObject | None = None) -> JsonObject:
    """The OffloadingConnector's config (vLLM's key names): host tier, optionally a disk tier
    and a Redis tier (`redis`: the tier's keys after "type", e.g. url and tenant_salt);
    `block_tokens` overrides the connector's offload block size (default: the engine's block).
    For vLLM: kvport's connector by module path, and failed loads recomputed (docs/vllm.md)."""
    extra: JsonObject = {"cpu_bytes_to_use": int(host_bytes)}
    if block_tokens is not None:
        extra["block_size"] = int(block_tokens)
    tiers: list[JsonObject] = []
    if disk_dir is not None:
        tiers.append({"type": "disk", "root_dir": str(disk_dir), "max_bytes": int(disk_bytes)})
    if redis is not None:
        tiers.append({"type": "redis", **redis})
    if tiers:
        extra["secondary_tiers"] = tiers
    config: JsonObject = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": extra}
    if engine == "vllm":
        config.update(kv_connector_module_path="kvport.vllm", kv_load_failure_policy="recompute")
    return config


def build_config_specs(cfg: WorkloadBenchConfig, plan: EnginePlan, disk_root: Path,
                       block_tokens: int | None = None) -> list[ConfigSpec]:
    """The configurations of one pass: their disk directories under `disk_root`, and a Redis
    tenant salt of their own unless the config gives one."""
    def offload(disk: str | None) -> JsonObject:
        if disk is None:
            return offloading_config(plan.host_bytes, block_tokens=block_tokens, engine=cfg.engine)
        (disk_root / disk).mkdir(parents=True, exist_ok=True)  # one per config: no shared hits
        return offloading_config(plan.host_bytes, str(disk_root / disk), plan.disk_bytes,
                                 block_tokens, engine=cfg.engine)

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
        (disk_root / EXAMPLE).mkdir(parents=True, exist_ok=True)
        made[EXAMPLE] = ConfigSpec(EXAMPLE, {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(disk_root / EXAMPLE)}})
    return [made[name] for name in cfg.configs]


def make_workload(cfg: WorkloadBenchConfig) -> Workload:
    source = token_source(cfg.model, resolve_model_dir(cfg.model), cfg.seed)
    if isinstance(cfg.spec, MultiTurnSpec):
        return make_multi_turn(cfg.spec, source)
    return make_long_doc(cfg.spec, source)
