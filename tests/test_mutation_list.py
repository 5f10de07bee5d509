"""tools/mutation_check.py's mutant list still fits the code: every mutant's text occurs exactly
once and its tests exist, so a refactor that moves a guard fails here, in the normal suite,
instead of silently checking nothing (running the mutants themselves is the script's job)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def mutation_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_check",
                                                  REPO / "tools" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutant_applies_exactly_once_and_names_existing_tests() -> None:
    tool = mutation_check()
    assert tool.check_applicable(tool.MUTANTS) == []
    for mutant in tool.MUTANTS:
        for node in mutant.tests:
            path, _, name = node.partition("::")
            test = re.sub(r"\[.*\]$", "", name)
            assert re.search(rf"^def {test}\(", (REPO / path).read_text(), re.M), node


def test_a_mutant_whose_text_moved_is_reported() -> None:
    tool = mutation_check()
    gone = tool.Mutant("gone", "src/kvport/connectors/offloading/worker.py", "no such text\n",
                       "", ("tests/x.py::test_x",), "a guard that was rewritten")
    twice = tool.Mutant("twice", "src/kvport/connectors/offloading/worker.py", "self", "",
                        ("tests/x.py::test_x",), "text that is not unique")
    problems = tool.check_applicable([gone, twice])
    assert problems[0].startswith("gone: its old text occurs 0 times")
    assert re.match(r"twice: its old text occurs \d+ times", problems[1])
    assert tool.main(["--only", "no-such-mutant"]) == 2
