"""`kvport bench hybrid-pool`: its flags, and the run they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from kvport.bench.common.command import run_bench_command


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "hybrid-pool", help="vLLM's KV pool concurrency on a hybrid model: hybrid allocator "
                            "on (kvport's connector is SupportsHMA) vs forced off",
        description="Two vLLM engines with kvport's OffloadingConnector and the same KV memory, "
                    "vLLM's hybrid KV cache allocator on and forced off: vLLM's own count of "
                    "requests of --prompt-len tokens the pool holds, and the most requests the "
                    "scheduler ran at once when --requests of them arrive together; see "
                    "kvport.bench.hybrid.")
    p.add_argument("--model", default="builtin:tiny-gemma3",
                   help="a hybrid model: builtin:NAME or a Hugging Face-format directory")
    p.add_argument("--prompt-len", type=int, default=2048, help="tokens per request")
    p.add_argument("--requests", type=int, default=8,
                   help="requests each engine runs, whose greedy outputs must be equal")
    p.add_argument("--kv-gib", type=int, default=1, help="KV memory, GiB (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="vLLM's prefill chunk (and most requests running): a sliding group "
                        "holds a chunk's blocks while it prefills, then only its window")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens each request decodes (it stays in the pool meanwhile)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the Python that has vLLM and kvport installed (default: this one)")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: cores)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from kvport.bench.hybrid.report import format_pool
    from kvport.bench.hybrid.run import PoolBenchConfig, run_pool

    def config() -> PoolBenchConfig:
        return PoolBenchConfig(model=args.model, prompt_len=args.prompt_len,
                               requests=args.requests, kv_gib=args.kv_gib,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               max_tokens=args.max_tokens,
                               vllm_python=args.vllm_python, threads=args.threads)

    return run_bench_command("hybrid-pool", args.json, config, run_pool, format_pool)
