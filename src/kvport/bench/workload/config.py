"""What `kvport bench multi-turn` / `long-doc` run: the workload, the configurations, the model.

Configurations: `no-connector` (the engine's prefix cache only: the baseline), `host` (the
OffloadingConnector's host tier), `host+disk`, `disk-cold-host` (host + disk, the engine's cache
and the host tier dropped before every phase, so hits come only from disk), optionally
`redis-cold-host` (host + the Redis tier at `redis_url`, no disk, dropped alike: repeats come only
from Redis), optionally `user` (the --kv-transfer-config given), `example` (the engine's own
ExampleConnector; vLLM's inside vLLM), and `ideal` (plan: no connector, the working set kept in
the engine's prefix cache, admission as the others').
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvport.bench.common.command import JsonObject
from kvport.bench.common.models import TINY
from kvport.bench.common.redis import check_redis_url, require_redis_py
from kvport.bench.vllm.engine import VLLM_CPU_BLOCK_SIZE
from kvport.bench.workload.workloads import LongDocSpec, MultiTurnSpec

WORKLOADS = ("multi-turn", "long-doc")
ENGINES = ("kvport", "vllm")
BASELINE, IDEAL, USER, EXAMPLE = "no-connector", "ideal", "user", "example"
REDIS_COLD = "redis-cold-host"  # only with a redis_url: appended to the defaults then
DEFAULT_CONFIGS = (BASELINE, "host", "host+disk", "disk-cold-host", IDEAL)
# inside vLLM, vLLM's own ExampleConnector is the peer on the same hits
VLLM_DEFAULT_CONFIGS = (BASELINE, EXAMPLE, "host", "host+disk", "disk-cold-host", IDEAL)
REDIS_URL_EXAMPLE = "redis://127.0.0.1:6379/0"

WorkloadSpec = MultiTurnSpec | LongDocSpec


def default_spec(workload: str, quick: bool) -> WorkloadSpec:
    """Sizes chosen so that the default model finishes in minutes on 2 cores (quick: a few)."""
    if workload == "multi-turn":
        if quick:
            return MultiTurnSpec(users=4, rounds=4, system_len=128, context_len=512,
                                 question_len=32, answer_tokens=4)
        return MultiTurnSpec()
    if workload == "long-doc":
        return LongDocSpec(docs=2, queries=3, answer_tokens=4) if quick else LongDocSpec()
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


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
    user_kv_transfer_config: JsonObject | None = None
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
        for name in ("concurrency", "repeats", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "vllm" and self.block_size != VLLM_CPU_BLOCK_SIZE:
            raise ValueError(f"vLLM's CPU KV block is {VLLM_CPU_BLOCK_SIZE} tokens; "
                             f"got block_size={self.block_size}")
        self._check_configs()

    def _check_configs(self) -> None:
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
            check_redis_url(self.redis_url)
            if self.engine == "kvport":
                require_redis_py(f"configuration {REDIS_COLD!r}")

    def params(self) -> JsonObject:
        """The parameters the result records (the plan's and the vLLM engine's come with it)."""
        return {"workload": dataclasses.asdict(self.spec), "concurrency": self.concurrency,
                "pool_fraction": self.pool_fraction, "seed": self.seed, "dtype": self.dtype,
                "block_size": self.block_size, "quick": self.quick, "threads": self.threads,
                "engine": self.engine, "repeats": self.repeats}
