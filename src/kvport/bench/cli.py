"""`kvport bench ...`: the benchmark subcommands.

`add_bench_parser(subparsers)` adds `bench` to the main CLI; each benchmark adds its own
subcommands (its cli module) and sets `func(args) -> exit code`. Heavy imports (torch, the
engine, transformers) happen inside those functions, so `kvport --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvport.bench.hybrid import cli as hybrid_cli
from kvport.bench.overhead import cli as overhead_cli
from kvport.bench.serve import cli as serve_cli
from kvport.bench.soak import cli as soak_cli
from kvport.bench.throughput import cli as throughput_cli
from kvport.bench.transfer import cli as transfer_cli
from kvport.bench.workload import cli as workload_cli


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="measure kvport against baselines (JSON out)")
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    throughput_cli.add_parser(commands)
    overhead_cli.add_parser(commands)
    transfer_cli.add_parser(commands)
    workload_cli.add_parsers(commands)
    soak_cli.add_parser(commands)
    hybrid_cli.add_parser(commands)
    serve_cli.add_parser(commands)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvport.bench.cli bench throughput ...`, the same as `kvport bench ...`."""
    parser = argparse.ArgumentParser(prog="kvport")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
