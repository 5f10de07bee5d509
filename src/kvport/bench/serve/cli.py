"""`kvport bench serve`: its flags, the config they make, and the run (exit code 1 if a server
or vLLM's client failed, or a kvport system lost requests; 130 on Ctrl-C)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from kvport.bench.common.command import name_list, run_bench_command

if TYPE_CHECKING:
    from kvport.bench.serve.config import ServeBenchConfig
    from kvport.bench.serve.result import ServeBenchResult

_SHARED_PREFIX_FLAGS = ("num_prefixes", "prompts_per_prefix", "prefix_len", "suffix_len")
_CONVERSATION_FLAGS = ("conversations", "turns", "system_len", "context_len", "user_len",
                       "reply_len")
_RANDOM_FLAGS = {"split_requests": "num_requests", "split_input_len": "input_len"}


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "serve", help="vLLM's serving benchmark client against vllm serve, with and without "
                      "kvport's tiers",
        description="Starts OpenAI-compatible vLLM servers on loopback ports (python -m "
                    "kvport.vllm serve) for each system (no-connector, host, host+disk, "
                    "host+redis, split+redis) and runs vLLM's own client (vllm bench serve) on "
                    "a shared-prefix, a multi-turn, a two-instance multi-turn and a prefill/"
                    "decode workload at one request rate; see kvport.bench.serve and "
                    "BENCHMARKS.md.")
    p.add_argument("--model", default=None,
                   help="builtin:NAME or a Hugging Face-format directory with a BPE "
                        "tokenizer (default: builtin:smollm2-135m)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true",
                   help="smaller: 12 requests per run, 2 in flight (about 10 minutes on 2 cores)")
    p.add_argument("--scenarios", type=name_list, default=None, metavar="NAMES",
                   help="comma-separated subset of shared-prefix, multi-turn, two-instances, "
                        "prefill-decode")
    p.add_argument("--systems", type=name_list, default=None, metavar="NAMES",
                   help="comma-separated subset of no-connector, host, host+disk, host+redis, "
                        "split+redis (no-connector is required: the ratios are against it)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests per second, Poisson, every run (default 1)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight at most: the client's --max-concurrency and the "
                        "servers' --max-num-seqs (default 4; --quick 2)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="each server's KV pool in 128-token blocks (default: --concurrency "
                        "requests of the longest kind)")
    p.add_argument("--host-mib", type=int, default=None,
                   help="kvport's host tier per server (default 2048; --quick 1024)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="host+redis's Redis (default: a redis-server the bench starts on a "
                        "free loopback port); only the run's own keys are deleted after")
    p.add_argument("--output-len", type=int, default=None, help="tokens per answer")
    for flag in _SHARED_PREFIX_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                       help="shared-prefix dataset size")
    for flag in _CONVERSATION_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                       help="multi-turn dataset size")
    for flag in _RANDOM_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                       help="prefill-decode dataset size")
    p.add_argument("--replies", choices=("model", "drawn"), default="model",
                   help="the multi-turn transcripts' assistant replies: the model's own (made "
                        "by a server before the run) or drawn words (default: model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="each server's OpenMP threads (default: one per core but one, left to "
                        "the API server, the scheduler and the client, as vLLM itself does)")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health")
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' and clients' logs here (default: removed)")
    p.add_argument("--json", metavar="PATH",
                   help="write parameters, machine facts, results and vLLM's raw results")
    p.add_argument("--plot", metavar="PATH.png", help="TTFT, ITL and throughput bars")
    p.set_defaults(func=run_command)


def serve_config(args: argparse.Namespace) -> ServeBenchConfig:
    """The ServeBenchConfig the flags ask for (ValueError naming a bad one)."""
    import importlib.util
    import shutil

    from kvport.bench.common.models import SMOLLM2
    from kvport.bench.common.redis import check_redis, require_redis_py
    from kvport.bench.serve.config import (
        HOST_REDIS,
        QUICK_CONVERSATION,
        QUICK_RANDOM,
        QUICK_SHARED_PREFIX,
        SCENARIOS,
        SPLIT_REDIS,
        SYSTEMS,
        ServeBenchConfig,
    )
    from kvport.bench.serve.datasets import ConversationSpec, RandomSpec, SharedPrefixSpec
    from kvport.bench.vllm.engine import require_vllm

    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before, not after
        raise ValueError("--plot needs matplotlib: pip install 'kvport[bench]'")
    require_vllm(None)
    shared = QUICK_SHARED_PREFIX if args.quick else SharedPrefixSpec()
    chat = QUICK_CONVERSATION if args.quick else ConversationSpec()
    shared = dataclasses.replace(shared, **_given(args, _SHARED_PREFIX_FLAGS + ("output_len",)))
    chat = dataclasses.replace(chat, **_given(args, _CONVERSATION_FLAGS + ("output_len",)))
    split = QUICK_RANDOM if args.quick else RandomSpec()
    split = dataclasses.replace(split, **{_RANDOM_FLAGS.get(k, k): v for k, v in _given(
        args, (*_RANDOM_FLAGS, "output_len")).items()})
    host_mib = args.host_mib or (1024 if args.quick else 2048)
    cfg = ServeBenchConfig(
        model=args.model or SMOLLM2, dtype=args.dtype,
        scenarios=tuple(args.scenarios) if args.scenarios else SCENARIOS,
        systems=tuple(args.systems) if args.systems else SYSTEMS,
        shared_prefix=shared, conversation=chat, random=split, replies=args.replies,
        request_rate=1.0 if args.request_rate is None else args.request_rate,
        concurrency=args.concurrency or (2 if args.quick else 4), seed=args.seed,
        kv_blocks=args.kv_blocks, host_bytes=host_mib << 20, redis_url=args.redis_url,
        threads=args.threads, start_timeout_s=args.start_timeout, quick=args.quick)
    if any(cfg.runs(system, s) for s in cfg.scenarios for system in (HOST_REDIS, SPLIT_REDIS)):
        if cfg.redis_url is not None:
            check_redis(cfg.redis_url)  # a Redis that is down would only give misses: say so
        elif shutil.which("redis-server") is None:
            raise ValueError("host+redis and split+redis need a Redis: install redis-server "
                             "(the bench starts one) or pass --redis-url")
        else:
            require_redis_py("host+redis")  # the bench's own client deletes the run's keys
    return cfg


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, int]:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def run_command(args: argparse.Namespace) -> int:
    from kvport.bench.serve.client import ClientFailed
    from kvport.bench.serve.config import BASELINE
    from kvport.bench.serve.plot import plot_result
    from kvport.bench.serve.report import format_result
    from kvport.bench.serve.run import run_serve_bench
    from kvport.bench.serve.server import ServerFailed

    def finish(result: ServeBenchResult) -> int:
        if args.plot:
            plot_result(result.to_json(), args.plot)
            print(f"wrote {args.plot}")
        lost = [r for r in result.runs if r.figures.failed and r.system != BASELINE]
        return 1 if lost else 0

    try:
        return run_bench_command("serve", args.json, lambda: serve_config(args),
                                 lambda cfg: run_serve_bench(cfg, args.log_dir),
                                 format_result, finish)
    except (ServerFailed, ClientFailed, RuntimeError, OSError) as exc:
        print(f"kvport bench serve: FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvport bench serve: interrupted; every server it started was stopped",
              file=sys.stderr)
        return 130
