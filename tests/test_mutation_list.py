"""tools/mutation_check.py's mutant list still fits the code: every mutant's text occurs exactly
once and its tests exist, so a refactor that moves a guard fails here, in the normal suite,
instead of silently checking nothing (running the mutants themselves is the script's job)."""

from __future__ import annotations

import importlib.util
import os
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
    gone = tool.Mutant("gone", "src/kvport/connectors/offloading/worker/half.py", "no such text\n",
                       "", ("tests/x.py::test_x",), "a guard that was rewritten")
    twice = tool.Mutant("twice", "src/kvport/connectors/offloading/worker/half.py", "self", "",
                        ("tests/x.py::test_x",), "text that is not unique")
    problems = tool.check_applicable([gone, twice])
    assert problems[0].startswith("gone: its old text occurs 0 times")
    assert re.match(r"twice: its old text occurs \d+ times", problems[1])
    assert tool.main(["--only", "no-such-mutant"]) == 2


def test_the_zygote_forks_each_run_with_its_own_exit_code_and_the_copys_kvport(
        tmp_path: Path) -> None:
    tool = mutation_check()
    copy = tmp_path / "job0" / "src"
    (copy / "kvport").mkdir(parents=True)
    (copy / "kvport" / "__init__.py").write_text("")  # stands for the mutated copy
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_ok.py").write_text(
        "import kvport\n\ndef test_ok():\n    print('kvport from', kvport.__file__)\n")
    (tests / "test_bad.py").write_text("def test_bad():\n    assert 1 == 2\n")
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    zygote = tool.Zygote(env, copy.parent)
    try:
        flags = ["-q", "-s", "-p", "no:cacheprovider", "--rootdir", str(tests)]
        code, out = zygote.pytest([*flags, str(tests / "test_ok.py")])
        assert code == 0, out
        assert f"kvport from {copy / 'kvport' / '__init__.py'}" in out
        code, out = zygote.pytest([*flags, str(tests / "test_bad.py")])
        assert code == 1 and "assert 1 == 2" in out, out
        code, out = zygote.pytest([*flags, str(tests / "test_missing.py")])
        assert code == 4, out
        assert zygote.pytest([*flags, str(tests / "test_ok.py")])[0] == 0  # still serving
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0
