"""The mutants (tests/**/mutants*.py, run by tools/mutation_check.py) still fit the code: every
mutant's text occurs exactly once, its tests exist and its name is its own, so a refactor that moves
a guard fails here, in the normal suite, instead of silently checking nothing (running the mutants
themselves is the tool's job)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # tools/ sits beside tests/, not on the tests' path

from tools.mutation import Mutant, collect
from tools.mutation.__main__ import changed_since, main
from tools.mutation.runner import check_applicable
from tools.mutation.zygote import Zygote


def test_every_mutant_applies_exactly_once_and_names_existing_tests() -> None:
    mutants = collect()
    assert mutants
    assert check_applicable(mutants) == []
    for mutant in mutants:
        for node in mutant.tests:
            path, _, name = node.partition("::")
            test = re.sub(r"\[.*\]$", "", name)
            assert re.search(rf"^def {test}\(", (REPO / path).read_text(), re.MULTILINE), node


def test_the_mutants_modules_are_collected_and_a_name_used_twice_is_refused(
        tmp_path: Path) -> None:
    assert len({m.name for m in collect()}) == len(collect())
    # Collecting imports the standard library only: no kvport, nothing heavy.
    probe = ("import sys; from tools.mutation import collect; collect(); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'kvport', 'torch', 'numpy', 'pytest', 'vllm'}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    one = ('from tools.mutation import Mutant\n'
           'MUTANTS = [Mutant("{}", "src/a.py", "x", "y", ("tests/a/test_a.py::test_a",), "z")]\n')
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "mutants.py").write_text(one.format("first"))
    (tmp_path / "a" / "mutants_more.py").write_text(one.format("second"))
    (tmp_path / "b" / "mutants.py").write_text(one.format("third"))
    (tmp_path / "b" / "test_mutants.py").write_text("MUTANTS = 1\n")  # not a mutants module
    assert [m.name for m in collect(tmp_path)] == ["first", "second", "third"]
    (tmp_path / "b" / "mutants.py").write_text(one.format("first"))
    with pytest.raises(SystemExit, match=r"first is used twice, in \S+/a/mutants.py and "
                                         r"\S+/b/mutants.py"):
        collect(tmp_path)


def test_changed_selects_the_mutants_of_changed_files_tests_and_entries(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    entry = 'Mutant("{0}", "src/{0}.py", "x", "y", ("tests/a/test_{0}.py::test_x",), "{1}"),\n'
    module = "from tools.mutation import Mutant\nMUTANTS = [\n{}]\n"
    for name in ("src", "tests/a"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("one", "two", "three", "four"):
        (tmp_path / "src" / f"{name}.py").write_text("x\n")
        (tmp_path / "tests" / "a" / f"test_{name}.py").write_text("def test_x(): pass\n")
    mutants_py = tmp_path / "tests" / "a" / "mutants.py"
    mutants_py.write_text(module.format(entry.format("one", "why") +
                                        entry.format("two", "why") +
                                        entry.format("three", "why")))
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "base")
    (tmp_path / "tests" / "a" / "test_two.py").write_text("def test_x(): assert 1\n")  # its test
    git("commit", "-qam", "later")
    (tmp_path / "src" / "one.py").write_text("x = 1\n")  # its file, not committed
    mutants_py.write_text(module.format(entry.format("one", "why") +
                                        entry.format("two", "why") +
                                        entry.format("three", "why not")))  # edited
    (tmp_path / "tests" / "a" / "mutants_new.py").write_text(  # a new module, untracked
        module.format(entry.format("four", "why")))
    mutants = collect(tmp_path / "tests")
    chosen, files = changed_since("HEAD", mutants, repo=tmp_path)
    assert [m.name for m in chosen] == ["one", "three", "four"]
    assert files == {"src/one.py", "tests/a/mutants.py", "tests/a/mutants_new.py"}
    chosen, files = changed_since("HEAD~1", mutants, repo=tmp_path)
    assert [m.name for m in chosen] == ["one", "two", "three", "four"]
    assert "tests/a/test_two.py" in files


def test_a_mutant_whose_text_moved_is_reported() -> None:
    gone = Mutant("gone", "src/kvport/connectors/offloading/worker/half.py", "no such text\n",
                  "", ("tests/x.py::test_x",), "a guard that was rewritten")
    twice = Mutant("twice", "src/kvport/connectors/offloading/worker/half.py", "self", "",
                   ("tests/x.py::test_x",), "text that is not unique")
    problems = check_applicable([gone, twice])
    assert problems[0].startswith("gone: its old text occurs 0 times")
    assert re.match(r"twice: its old text occurs \d+ times", problems[1])
    assert main(["--only", "no-such-mutant"]) == 2


def test_the_zygote_forks_each_run_with_its_own_exit_code_and_the_copys_kvport(
        tmp_path: Path) -> None:
    copy = tmp_path / "job0" / "src"
    (copy / "kvport").mkdir(parents=True)
    (copy / "kvport" / "__init__.py").write_text("")  # stands for the mutated copy
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_ok.py").write_text(
        "import kvport\n\ndef test_ok():\n    print('kvport from', kvport.__file__)\n")
    (tests / "test_bad.py").write_text("def test_bad():\n    assert 1 == 2\n")
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    zygote = Zygote(env, copy.parent, cwd=REPO)
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
