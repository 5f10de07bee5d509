"""Mutation check: remove one guard at a time and check that the tests meant to catch it fail.

Each `Mutant` replaces one exact piece of source text (`old`, which must occur exactly once, so
a refactor that moves or rewrites a guard makes the check fail loudly instead of silently
checking nothing) with `new`, the code as it would be without the guard. The mutants live beside
the tests that kill them: every `tests/**/mutants*.py` defines `MUTANTS: list[Mutant]`, and the
tool collects them all (by path, then in list order; a name used twice is an error). The runner
copies `src/` into a temporary directory, applies one mutant at a time, and runs the mutant's
tests against the copy (`PYTHONPATH=<tmp>/src`, so spawned worker processes import it too). Each
copy has a zygote (`zygote.py`): a process that imported torch, pytest and the other third-party
modules once and forks a fresh child for every mutant's pytest run, which then imports only
kvport (from the copy) and the tests. A mutant is killed when its tests fail (or hang past
`MUTANT_LIMIT_S`); it survived when they pass. Exit code 1 if any mutant survived, could not be
applied, or its test run errored (a collection error is not a kill).

    python tools/mutation_check.py                 # every mutant (python -m tools.mutation too)
    python tools/mutation_check.py --list          # names, files and why
    python tools/mutation_check.py --only NAME...  # some of them
    python tools/mutation_check.py --changed REV   # those of the files changed since REV
    python tools/mutation_check.py --why           # also how each killed mutant failed
    python tools/mutation_check.py --jobs 1        # one mutant at a time (default: 2 at once)

Adding a guard: append a Mutant to the MUTANTS of the `mutants*.py` beside the smallest tests
that kill it. Standard library only: the mutants modules import this package and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout whose src/ and tests/ are checked


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # repo-relative file
    old: str  # exact text, must occur exactly once in the file
    new: str  # the same place without the guard
    tests: tuple[str, ...]  # pytest node ids; at least one must fail
    why: str  # what the guard protects, one line


def mutants_of(source: str, filename: str) -> list[Mutant]:
    """The MUTANTS a mutants module's source defines (run as a module of its own)."""
    namespace: dict[str, object] = {"__name__": f"mutants:{filename}", "__file__": filename}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the repository's own data
    mutants = namespace.get("MUTANTS")
    if not isinstance(mutants, list) or not all(isinstance(m, Mutant) for m in mutants):
        raise SystemExit(f"mutation: {filename} must define MUTANTS, a list of Mutant")
    return mutants


def collect(tests: Path = REPO / "tests") -> list[Mutant]:
    """Every mutant of `tests/**/mutants*.py`, by path, then in list order."""
    found: dict[str, Mutant] = {}
    where: dict[str, str] = {}
    for path in sorted(tests.rglob("mutants*.py")):
        name = path.relative_to(tests.parent).as_posix()
        for m in mutants_of(path.read_text(), name):
            if m.name in found:
                raise SystemExit(f"mutation: the mutant name {m.name} is used twice, "
                                 f"in {where[m.name]} and {name}")
            found[m.name], where[m.name] = m, name
    return list(found.values())
