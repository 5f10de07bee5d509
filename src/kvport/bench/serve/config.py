"""What `kvport bench serve` runs: scenarios, systems, sizes, and each system's server.

Scenarios (each a `vllm bench serve` run per system, same dataset, seed and request rate):
- `shared-prefix`: vLLM's prefix_repetition dataset on one server per system.
- `multi-turn`: chat transcripts that grow turn by turn (datasets.py) on one server.
- `two-instances`: other conversations of the same shape on two servers of the system, a
  conversation's turns alternating between them (forwarder.py).
- `prefill-decode`: vLLM's random dataset (prompts sharing nothing) on one server doing both
  (no-connector), against a prefill server and a decode server on one Redis (`split+redis`):
  each request prefilled by the first (one token), then decoded by the second (forwarder.py).

Systems: `no-connector` (vLLM's own prefix cache, on by default: the baseline), `host` (kvport's
OffloadingConnector, host tier), `host+disk` (and a disk tier in a temporary directory),
`host+redis` (and a Redis tier: a redis-server the bench starts, or --redis-url). In
`two-instances` each system is two servers (host+disk is not run there: a disk is one
machine's); its targets compare `host+redis` with `host`, the same two servers without Redis.
`split+redis` runs only in `prefill-decode`: a kv_producer and a kv_consumer on the Redis tier.

Sizes, and why (BENCHMARKS.md, "Serving"): every server's KV pool holds `concurrency` requests
of the longest kind and no more (`pool_plan`), the regime offloading is for: the requests in
flight fit, the prefixes worth keeping (8 documents or system prompts of 1024 tokens; 8 chats'
histories) do not, so vLLM evicts them between their uses. A pool that holds the whole working
set makes every system equal, and is not what this measures. Requests arrive at one rate for
every system, Poisson with the client's seed; the client keeps at most `concurrency` in flight
(vLLM's --max-concurrency, equal to the servers' --max-num-seqs), so a system slower than the
rate queues in the client (vLLM reports that wait apart from TTFT) instead of in the server.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kvport.bench.common.command import JsonObject
from kvport.bench.common.models import SMOLLM2
from kvport.bench.serve.datasets import ConversationSpec, RandomSpec, SharedPrefixSpec
from kvport.bench.vllm.engine import VLLM_CPU_BLOCK_SIZE
from kvport.bench.workload.plan import offloading_config

SHARED_PREFIX, MULTI_TURN, TWO_INSTANCES = "shared-prefix", "multi-turn", "two-instances"
PREFILL_DECODE = "prefill-decode"
SCENARIOS = (SHARED_PREFIX, MULTI_TURN, TWO_INSTANCES, PREFILL_DECODE)
BASELINE, HOST, HOST_DISK, HOST_REDIS = "no-connector", "host", "host+disk", "host+redis"
SPLIT_REDIS = "split+redis"  # a prefill (kv_producer) and a decode (kv_consumer) server
SYSTEMS = (BASELINE, HOST, HOST_DISK, HOST_REDIS, SPLIT_REDIS)
PAIR_SYSTEMS = (BASELINE, HOST, HOST_REDIS)  # the systems two-instances runs
SPLIT_SYSTEMS = (BASELINE, SPLIT_REDIS)  # the systems prefill-decode runs
# the multi-turn transcripts' replies: the model's own (replies.py), or drawn text
MODEL_REPLIES, DRAWN_REPLIES = "model", "drawn"
PREFILL, DECODE = 0, 1  # split+redis: its servers, in order
# split+redis's decode server waits this long for Redis to say which blocks it holds (the
# default, 50 ms, is for an instance whose miss costs the prompt's new part; a decode server's
# miss costs the whole prompt, and on a 2-vCPU machine running two servers, Redis and the
# client, a lookup past 50 ms is common: every one of them was a whole prompt computed).
CONSUMER_LOOKUP_TIMEOUT_MS = 500.0
# a transcript's token count is the tokenizer's; this covers a special token the server adds
LENGTH_MARGIN_TOKENS = 8

# --quick: 12 requests per run, 2 in flight; the same shapes, smaller (prefixes of 4 blocks)
QUICK_SHARED_PREFIX = SharedPrefixSpec(num_prefixes=3, prompts_per_prefix=4, prefix_len=512,
                                       suffix_len=64, output_len=16)
QUICK_CONVERSATION = ConversationSpec(conversations=3, turns=4, system_len=64, context_len=256,
                                      user_len=32, reply_len=32, output_len=16)
QUICK_RANDOM = RandomSpec(num_requests=8, input_len=512, output_len=16)


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = SMOLLM2
    dtype: str = "float32"
    scenarios: tuple[str, ...] = SCENARIOS
    systems: tuple[str, ...] = SYSTEMS
    shared_prefix: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    conversation: ConversationSpec = field(default_factory=ConversationSpec)
    random: RandomSpec = field(default_factory=RandomSpec)  # prefill-decode's requests
    replies: str = MODEL_REPLIES
    request_rate: float = 1.0  # requests per second, every system and scenario
    concurrency: int = 4  # requests in flight at most: client cap and servers' max_num_seqs
    seed: int = 0
    kv_blocks: int | None = None  # each server's KV pool; None: pool_plan's
    host_bytes: int = 2 << 30  # kvport's host tier, per server
    disk_bytes: int = 8 << 30
    redis_url: str | None = None  # None: start a redis-server for the run
    threads: int | None = None  # each server's OpenMP threads; None: cores - 1
    start_timeout_s: float = 600.0  # a server's start, to /health answering
    run_timeout_s: float = 3600.0  # one client run
    quick: bool = False
    model_fallback_note: str | None = None

    def __post_init__(self) -> None:
        _check_names("scenario", self.scenarios, SCENARIOS)
        _check_names("system", self.systems, SYSTEMS)
        if BASELINE not in self.systems:
            raise ValueError(f"systems must include the baseline {BASELINE!r}: every ratio is "
                             f"against it")
        if self.replies not in (MODEL_REPLIES, DRAWN_REPLIES):
            raise ValueError(f"replies must be {MODEL_REPLIES} or {DRAWN_REPLIES}, got "
                             f"{self.replies!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if not (self.request_rate > 0 and math.isfinite(self.request_rate)):
            raise ValueError(f"request rate must be a positive number of requests per second, "
                             f"got {self.request_rate}")
        for name in ("concurrency", "host_bytes", "disk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {self.kv_blocks}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if (TWO_INSTANCES in self.scenarios or MULTI_TURN in self.scenarios) \
                and self.conversation.conversations <= self.concurrency:
            # else a conversation's next turn may be sent while its previous one still runs
            raise ValueError(f"conversations ({self.conversation.conversations}) must exceed "
                             f"the concurrency ({self.concurrency})")

    def runs(self, system: str, scenario: str) -> bool:
        """Whether `system` runs in `scenario`."""
        if system not in self.systems or scenario not in self.scenarios:
            return False
        if scenario == PREFILL_DECODE:
            return system in SPLIT_SYSTEMS
        if scenario == TWO_INSTANCES:
            return system in PAIR_SYSTEMS
        return system != SPLIT_REDIS

    def instances(self, system: str) -> int:
        """Servers the system needs: two if it is split+redis or runs in two-instances."""
        return 2 if system == SPLIT_REDIS or self.runs(system, TWO_INSTANCES) else 1

    def params(self) -> JsonObject:
        return {"model": self.model, "dtype": self.dtype, "scenarios": list(self.scenarios),
                "systems": list(self.systems),
                "shared_prefix": dataclasses.asdict(self.shared_prefix),
                "conversation": dataclasses.asdict(self.conversation),
                "random": dataclasses.asdict(self.random), "replies": self.replies,
                "request_rate": self.request_rate, "concurrency": self.concurrency,
                "seed": self.seed, "kv_blocks": self.kv_blocks, "host_bytes": self.host_bytes,
                "disk_bytes": self.disk_bytes, "threads": self.threads, "quick": self.quick}


def _check_names(kind: str, names: tuple[str, ...], known: tuple[str, ...]) -> None:
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown {kind}(s) {bad or 'none given'}; known: {', '.join(known)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{kind}s {twice} named more than once")


@dataclass(frozen=True)
class PoolPlan:
    """Every server's KV geometry, from the longest request the run sends."""

    longest_request_tokens: int  # prompt + output, with LENGTH_MARGIN_TOKENS
    max_model_len: int  # that, rounded up to whole blocks
    kv_blocks: int  # usable blocks of each server's pool


def pool_plan(longest_request_tokens: int, concurrency: int, kv_blocks: int | None = None,
              block_size: int = VLLM_CPU_BLOCK_SIZE) -> PoolPlan:
    """`concurrency` requests of the longest kind, in whole blocks (or `kv_blocks` if given,
    which must hold one such request: vLLM refuses to start otherwise)."""
    tokens = longest_request_tokens + LENGTH_MARGIN_TOKENS
    per_request = math.ceil(tokens / block_size)
    blocks = concurrency * per_request if kv_blocks is None else kv_blocks
    if blocks < per_request:
        raise ValueError(f"a pool of {blocks} blocks cannot hold one request of {tokens} tokens "
                         f"({per_request} blocks of {block_size})")
    return PoolPlan(tokens, per_request * block_size, blocks)


def kv_transfer_config(cfg: ServeBenchConfig, system: str, disk_dir: str | None = None,
                       redis: JsonObject | None = None,
                       instance: int = 0) -> JsonObject | None:
    """The system's kv_transfer_config (vLLM's JSON shape; kvport's connector by module path)
    for its server `instance`. `disk_dir` for host+disk, `redis` (the tier's keys after
    "type": url, tenant) for host+redis and split+redis (whose PREFILL server is a kv_producer,
    its DECODE server a kv_consumer)."""
    if system == BASELINE:
        return None
    if system == SPLIT_REDIS:
        if redis is None:
            raise ValueError("split+redis needs its Redis tier")
        if instance == DECODE:
            redis = {**redis, "lookup_timeout_ms": CONSUMER_LOOKUP_TIMEOUT_MS}
        config = offloading_config(cfg.host_bytes, engine="vllm", redis=redis)
        config["kv_role"] = "kv_producer" if instance == PREFILL else "kv_consumer"
        return config
    if system == HOST:
        return offloading_config(cfg.host_bytes, engine="vllm")
    if system == HOST_DISK:
        if disk_dir is None:
            raise ValueError("host+disk needs its disk directory")
        return offloading_config(cfg.host_bytes, disk_dir, cfg.disk_bytes, engine="vllm")
    if system == HOST_REDIS:
        if redis is None:
            raise ValueError("host+redis needs its Redis tier")
        return offloading_config(cfg.host_bytes, engine="vllm", redis=redis)
    raise ValueError(f"unknown system {system!r}")
