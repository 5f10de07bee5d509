"""`kvport trace check FILE [FILE...]`: check recorded connector traces against the contract.

Prints each violation as `FILE: step N request R: message` (the file prefix only when several
files are given) and exits 1 if there is any, 0 with a one-line summary if there is none, 2 if a
file cannot be read. Also runs alone: `python -m kvport.trace.cli check FILE`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvport.trace.checker import RULES, check_trace
from kvport.trace.events import read_events


def add_trace_parser(subparsers: Any) -> None:
    """Add `trace check` to the `kvport` command's subparsers; the handler is `args.func`."""
    trace = subparsers.add_parser("trace", help="recorded connector call traces")
    _add_trace_commands(trace.add_subparsers(dest="trace_command", required=True))


def _add_trace_commands(subparsers: Any) -> None:
    check = subparsers.add_parser(
        "check", help="check traces recorded with kv_connector_extra_config.record_trace",
        epilog="rules: " + "; ".join(f"{rule} {text}" for rule, text in RULES.items()))
    check.add_argument("files", nargs="+", metavar="FILE", help="a JSON-lines trace file")
    check.set_defaults(func=cmd_trace_check)


def cmd_trace_check(args: argparse.Namespace) -> int:
    num_violations = num_events = 0
    prefix_files = len(args.files) > 1
    for path in args.files:
        try:
            events = read_events(path)
        except (OSError, ValueError) as exc:
            print(f"kvport trace check: {exc}", file=sys.stderr)
            return 2
        num_events += len(events)
        for violation in check_trace(events):
            num_violations += 1
            print(f"{path}: {violation}" if prefix_files else str(violation))
    if num_violations:
        print(f"{num_violations} violation(s) in {num_events} records", file=sys.stderr)
        return 1
    print(f"ok: {num_events} records in {len(args.files)} file(s), no violations")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvport.trace.cli")
    _add_trace_commands(parser.add_subparsers(dest="trace_command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
