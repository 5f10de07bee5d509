"""`kvport trace check` and `kvport trace show`: read recorded connector call traces.

    kvport trace check FILE [FILE...] [--profile legacy|vllm-0.32] [--show N] [--context N]
                                      [--json PATH|-]
    kvport trace show FILE --request ID

check prints, per file, the contract profile each connector group was held to and why, then the
violations grouped by rule (count, rule text, why, the first --show of them with --context
records around each), then a summary line per file. Exit status: 1 if any violation, 0 if none,
2 if a file cannot be read, a header is malformed or an argument is bad (the message names the
value and what to do). --json writes the same result as one document (report.json_document);
with `--json -` it goes to stdout and the text report to stderr.

show prints the calls one request went through (show.py says in what order); an id no record
names exits 2, listing some that are there. Both also run alone: `python -m kvport.trace.cli`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from kvport.trace.checker import RULES, analyze
from kvport.trace.events import LEGACY, VLLM_0_32, VLLM_MRV2, TraceEvent, read_events
from kvport.trace.profiles import PROFILE_RULES, PROFILES
from kvport.trace.report import json_document, json_file_entry, summary_line, text_report
from kvport.trace.show import UnknownRequestError, format_request


def add_trace_parser(subparsers: Any) -> None:
    """Add `trace check|show` to the `kvport` command's subparsers; the handler is `args.func`."""
    trace = subparsers.add_parser("trace", help="recorded connector call traces")
    _add_trace_commands(trace.add_subparsers(dest="trace_command", required=True))


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _add_trace_commands(subparsers: Any) -> None:
    check = subparsers.add_parser(
        "check", help="check traces recorded with kv_connector_extra_config.record_trace",
        epilog=f"rules ({LEGACY} profile): "
               + "; ".join(f"{rule} {text}" for rule, text in RULES.items())
               + f". Under {VLLM_0_32} instead: "
               + "; ".join(f"{rule} {PROFILES[VLLM_0_32].rules[rule]}"
                           for rule in sorted(PROFILE_RULES))
               + f". Under {VLLM_MRV2} (vLLM's Model Runner V2), as {VLLM_0_32} but: "
               + "; ".join(f"{rule} {PROFILES[VLLM_MRV2].rules[rule]}"
                           for rule in sorted(PROFILE_RULES)
                           if PROFILES[VLLM_MRV2].rules[rule] != PROFILES[VLLM_0_32].rules[rule]))
    check.add_argument("files", nargs="+", metavar="FILE", help="a JSON-lines trace file")
    check.add_argument("--profile", choices=list(PROFILES), default=None,
                       help="hold every connector group to this call order (default: the one "
                            f"its trace_header names, {LEGACY} without a header)")
    check.add_argument("--show", type=_count, default=3, metavar="N",
                       help="violations shown per rule, with their context (default 3)")
    check.add_argument("--context", type=_count, default=3, metavar="N",
                       help="records of the same connector group shown before and after each "
                            "shown violation (default 3)")
    check.add_argument("--json", metavar="PATH", default=None,
                       help="also write the result as JSON to PATH ('-': stdout, and the text "
                            "report goes to stderr)")
    check.set_defaults(func=cmd_trace_check)
    show = subparsers.add_parser("show", help="the calls one request went through")
    show.add_argument("file", metavar="FILE", help="a JSON-lines trace file")
    show.add_argument("--request", required=True, metavar="ID", help="the request id")
    show.set_defaults(func=cmd_trace_show)


def _read(path: str, command: str) -> list[TraceEvent] | None:
    try:
        return read_events(path)
    except (OSError, ValueError) as exc:
        print(f"kvport trace {command}: {exc}", file=sys.stderr)
        return None


def cmd_trace_check(args: argparse.Namespace) -> int:
    # Read and check every file before printing anything: a bad file or header stops the run
    # with exit 2 instead of leaving half a report behind.
    checked = []
    for path in args.files:
        events = _read(path, "check")
        if events is None:
            return 2
        try:
            checked.append((path, events, analyze(events, args.profile)))
        except ValueError as exc:
            print(f"kvport trace check: {path}: {exc}", file=sys.stderr)
            return 2
    json_out: TextIO | None = None
    if args.json not in (None, "-"):
        try:  # opened before the report is printed: a bad path fails the run, not after it
            json_out = open(args.json, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            print(f"kvport trace check: cannot write --json {args.json!r}: {exc}; pass a path "
                  "in a writable directory, or '-' for stdout", file=sys.stderr)
            return 2
    text: TextIO = sys.stderr if args.json == "-" else sys.stdout
    for path, events, check in checked:
        for line in text_report(path, events, check, show=args.show, context=args.context):
            print(line, file=text)
    for path, events, check in checked:
        print(summary_line(path, len(events), check.violations), file=text)
    if args.json is not None:
        doc = json_document([json_file_entry(p, e, c) for p, e, c in checked])
        if json_out is None:
            sys.stdout.write(doc)
        else:
            with json_out:
                json_out.write(doc)
    return 1 if any(check.violations for _, _, check in checked) else 0


def cmd_trace_show(args: argparse.Namespace) -> int:
    events = _read(args.file, "show")
    if events is None:
        return 2
    try:
        lines = format_request(args.file, events, args.request)
    except UnknownRequestError as exc:
        print(f"kvport trace show: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvport.trace.cli")
    _add_trace_commands(parser.add_subparsers(dest="trace_command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
