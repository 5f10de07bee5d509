"""The command line: `python tools/mutation_check.py` or `python -m tools.mutation` (the package's
docstring says what it does)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.mutation import REPO, Mutant, collect, mutants_of
from tools.mutation import __doc__ as ABOUT
from tools.mutation.runner import check_applicable, run


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"mutation: git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def changed_since(rev: str, mutants: list[Mutant],
                  repo: Path = REPO) -> tuple[list[Mutant], set[str]]:
    """The mutants a change since rev touched (committed or not): those whose file or tests'
    files changed, and those new or edited in a mutants module; and the files it changed."""
    files = set(git(repo, "diff", "--name-only", "--no-renames", rev, "--").splitlines())
    files |= set(git(repo, "ls-files", "--others", "--exclude-standard").splitlines())
    edited: set[Mutant] = set()
    for name in sorted(f for f in files if f.startswith("tests/")
                       and os.path.basename(f).startswith("mutants") and f.endswith(".py")):
        now = mutants_of((repo / name).read_text(), name) if (repo / name).is_file() else []
        before = (mutants_of(git(repo, "show", f"{rev}:{name}"), name)
                  if git(repo, "ls-tree", "--name-only", rev, "--", name).strip() else [])
        edited |= set(now) - set(before)
    chosen = [m for m in mutants if m in edited or m.path in files
              or any(node.partition("::")[0] in files for node in m.tests)]
    return chosen, files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mutation_check",
                                     description=(ABOUT or "").split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--changed", metavar="REV",
                        help="run only the mutants of the files changed since REV (git diff "
                             "REV, uncommitted changes included): their guarded file, their "
                             "tests' files or their own entry")
    parser.add_argument("--why", action="store_true", help="print how each killed mutant failed")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="mutants tested at once, each in a copy of src/ of its own")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    mutants = everything = collect()
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in everything})
        if unknown:
            print(f"unknown mutant(s) {unknown}; see --list", file=sys.stderr)
            return 2
        mutants = [m for m in everything if m.name in args.only]
    if args.changed:
        mutants, files = changed_since(args.changed, mutants)
        print(f"--changed {args.changed}: {len(mutants)} of {len(everything)} mutants selected "
              f"({len(files)} changed file{'s'[:len(files) != 1]})", flush=True)
    if args.list:
        width = max((len(m.name) for m in mutants), default=0)
        for m in mutants:
            print(f"{m.name:<{width}}  {m.path}: {m.why}")
        return 0
    problems = check_applicable(mutants)
    if problems:
        print("mutation: cannot apply:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if not mutants:
        return 0
    start = time.monotonic()
    results = run(mutants, args.jobs, args.why)
    bad = [m.name for m, outcome in results if outcome != "killed"]
    print(f"{len(results) - len(bad)}/{len(results)} mutants killed in "
          f"{time.monotonic() - start:.0f}s" + (f"; not killed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
