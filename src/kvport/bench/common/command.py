"""The shape of every `kvport bench` subcommand: its flags become a frozen config (a bad value
is exit code 2 with its message), the run returns a typed result, the result is printed as a
table and, with --json, written as JSON; JSON exists only here, at the edge."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

JsonObject = dict[str, Any]  # what json.loads gives back: the one untyped shape, at the edges


class ToJson(Protocol):
    """A result that knows the JSON it is written as (its keys are what plots and users read)."""

    def to_json(self) -> JsonObject: ...


C = TypeVar("C")
R = TypeVar("R", bound=ToJson)


def name_list(text: str) -> tuple[str, ...]:
    """A command-line list of names, comma-separated; "none" (or nothing) is the empty list."""
    return tuple(p.strip() for p in text.split(",") if p.strip() and p.strip() != "none")


def int_list(text: str) -> tuple[int, ...]:
    """A command-line list of integers, comma-separated; at least one."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one integer")
    return values


def save_json(result: ToJson, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n")


def run_bench_command(name: str, json_path: str | None, make_config: Callable[[], C],
                      run: Callable[[C], R], fmt: Callable[[R], str],
                      finish: Callable[[R], int] | None = None) -> int:
    """Build the config (a ValueError: exit 2 with its message), run, print `fmt(result)`,
    write --json, then `finish(result)` gives the exit code (default 0)."""
    try:
        cfg = make_config()
    except ValueError as exc:
        print(f"kvport bench {name}: {exc}", file=sys.stderr)
        return 2
    result = run(cfg)
    print(fmt(result))
    if json_path:
        save_json(result, json_path)
        print(f"wrote {json_path}")
    return finish(result) if finish is not None else 0
