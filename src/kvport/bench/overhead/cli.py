"""`kvport bench connector-overhead`: its flags, and the run they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from kvport.bench.common.command import run_bench_command


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "connector-overhead", help="decode tokens/s with a no-op connector (and recording) vs none",
        description="The connector framework's own cost; see kvport.bench.overhead.")
    p.add_argument("--model", default=None,
                   help="default: builtin:tiny-llama; with --engine vllm the workload "
                        "benchmarks' default (SmolLM2 if installed)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=None, help="default 128; vLLM 256")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 128; vLLM 256")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds; median reported (default 7; vLLM 5)")
    p.add_argument("--engine", default="kvport", choices=("kvport", "vllm"),
                   help="vllm: vLLM without a connector vs vLLM with kvport's "
                        "OffloadingConnector storing and never loading "
                        "(kvport.bench.overhead.vllm)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --engine vllm: the Python that has vLLM and kvport installed")
    p.add_argument("--threads", type=int, default=None,
                   help="with --engine vllm: OMP threads per engine (default: one per core)")
    p.add_argument("--recorder", action="store_true",
                   help="with --engine vllm: vLLM's ExampleConnector unwrapped vs inside "
                        "kvport.vllm's RecordingConnector with recording off")
    p.add_argument("--recording", action="store_true",
                   help="with --engine vllm: vLLM's ExampleConnector unwrapped vs inside "
                        "kvport.vllm's RecordingConnector writing its trace")
    p.add_argument("--events", action="store_true",
                   help="with --engine vllm: kvport storing without vs with vLLM's KV events "
                        "(ZMQ publisher) and stats logging on")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from kvport.bench.overhead.config import OverheadConfig
    from kvport.bench.overhead.report import format_overhead
    from kvport.bench.overhead.run import run_overhead

    given = {k: v for k, v in (("prompt_len", args.prompt_len), ("rounds", args.rounds),
                               ("decode_tokens", args.decode_tokens)) if v is not None}

    def config() -> OverheadConfig:
        if args.engine == "kvport" and (args.events or args.recorder or args.recording):
            raise ValueError("--events, --recorder and --recording compare vLLM engines: add "
                             "--engine vllm")
        if args.engine == "kvport":
            return OverheadConfig.for_engine("kvport", args.model or "builtin:tiny-llama",
                                             dtype=args.dtype, batch=args.batch, **given)
        from kvport.bench.common.models import default_model
        from kvport.bench.vllm.engine import require_vllm

        require_vllm(args.vllm_python)
        return OverheadConfig.for_engine(
            "vllm", args.model or default_model().model, dtype=args.dtype, batch=args.batch,
            vllm_python=args.vllm_python, threads=args.threads, recorder=args.recorder,
            recording=args.recording, events=args.events, **given)

    return run_bench_command("connector-overhead", args.json, config, run_overhead,
                             format_overhead)
