"""One connector's conformance run: search (search.py), write each finding out (repro.py), and
say what was found in words a connector author acts on."""

from __future__ import annotations

import datetime
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvport.conformance.connectors import ConnectorUnderTest
from kvport.conformance.driver import CRASH, HANG, EngineSession, Outcome
from kvport.conformance.repro import STORE, write_finding
from kvport.conformance.search import Finding, Search, SearchResult
from kvport.conformance.workload import EngineShape, Workload
from kvport.trace.checker import analyze
from kvport.trace.events import VLLM_0_32
from kvport.trace.findings import Violation
from kvport.trace.profiles import COMMON_WHY, PROFILES
from kvport.trace.report import text_report

_WHAT = {CRASH: "the engine stopped with an error, no rule broken before it",
         HANG: "requests never finished"}


@dataclass(frozen=True)
class WrittenFinding:
    key: str
    what: str  # the rule's text, or what CRASH / HANG mean
    summary: str  # the shrunk workload in one line
    first: str  # the first violation (or the engine's error), steps counted in the workload
    script: str  # the reproduction script's path
    flaky: bool


@dataclass(frozen=True)
class ConnectorRun:
    name: str
    result: SearchResult
    findings: tuple[WrittenFinding, ...]
    report: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        r = self.result
        return {"connector": self.name, "examples": r.examples, "clean": r.clean,
                "seconds": round(r.seconds, 1),
                "examples_per_minute": round(r.examples_per_minute, 1), "engines": r.engines,
                "preempted": r.preempted, "hit": r.hit, "salted": r.salted, "lora": r.lora,
                "findings": [vars(f) for f in self.findings],
                "after_others": [{"key": f.key, "workload": f.workload.summary(),
                                  "first": _first(f)} for f in r.after_others]}


def _rule_text(key: str) -> str:
    return _WHAT.get(key) or PROFILES[VLLM_0_32].rules.get(key, key)


def _violation(f: Finding) -> Violation | None:
    """The finding's first violation of its own rule (a workload may break others first)."""
    return next((v for v in f.outcome.violations if v.rule == f.key), None)


def _first(f: Finding) -> str:
    """The first violation, its step counted from the workload's first and the request by the
    id the workload gave it (vLLM adds a suffix); else the engine's error."""
    v = _violation(f)
    if v is None:
        return f.outcome.error or ""
    step = "-" if v.step is None else v.step - f.outcome.first_step
    req = "-" if v.req_id is None else v.req_id.rsplit("-", 1)[0]
    return f"workload step {step}, request {req}: {v.message}"


class _Progress:
    """A line on stderr every 25 workloads: a run of hundreds takes minutes."""

    def __init__(self, name: str, total: int) -> None:
        self._name, self._total, self._played, self._broken = name, total, 0, 0
        self._start = time.monotonic()

    def __call__(self, workload: Workload, outcome: Outcome) -> None:
        self._played += 1
        self._broken += outcome.key is not None
        if self._played % 25 == 0:
            print(f"{self._name}: {self._played}/{self._total} workloads, {self._broken} broke "
                  f"something, {time.monotonic() - self._start:.0f} s", file=sys.stderr,
                  flush=True)


def run_connector(connector: ConnectorUnderTest, shape: EngineShape, model_dir: Path,
                  out: Path, *, examples: int, seed: int, max_shrink: int) -> ConnectorRun:
    """Search `examples` workloads against `connector`; findings go under `out`. Raises
    driver.EngineStartError when vLLM does not start with the connector."""
    with tempfile.TemporaryDirectory(prefix="kvport-conformance-") as work:
        session = EngineSession(connector.config_for, shape, Path(work), model_dir,
                                sees_all_stores=connector.store_starts_empty)
        try:
            result = Search(session, seed=seed, max_shrink_plays=max_shrink,
                            loras=shape.max_loras,
                            on_example=_Progress(connector.name, examples)).run(examples)
        finally:
            session.close()
    r = result
    report = [f"{connector.name}: {r.examples} workloads in {r.seconds:.0f} s "
              f"({r.examples_per_minute:.0f}/min, {r.engines} engine(s)); {r.preempted} with "
              f"preemptions, {r.hit} with hits, {r.salted} with cache_salts"
              + (f", {r.lora} with LoRAs" if shape.max_loras else "") + "; "
              + (f"{len(r.findings)} rule(s) broken" if r.findings else "no rule broken")]
    written = []
    for f in r.findings:
        script = write_finding(
            out / f.key, key=f.key, title=f"{connector.name} breaks {f.key}: "
            f"{_rule_text(f.key)}", found=f"seed {seed}, {datetime.date.today().isoformat()}",
            connector=connector.config_for(Path(STORE)), sees_all_stores=connector.
            store_starts_empty, shape=shape, workload=f.workload,
            events=[e.to_dict() for e in f.outcome.events])
        wf = WrittenFinding(f.key, _rule_text(f.key), f.workload.summary(), _first(f),
                            str(script), f.flaky)
        written.append(wf)
        report += [f"  {f.key}: {wf.what}", f"    workload: {wf.summary}",
                   f"    first: {wf.first}"]
        if f.key in COMMON_WHY:
            report.append(f"    why: {COMMON_WHY[f.key]}")
        if f.outcome.error and f.outcome.violations:
            report.append(f"    then the engine stopped: {f.outcome.error}")
        if f.outcome.error_traceback:  # where the engine stopped, beside the script
            where = script.parent / "traceback.txt"
            where.write_text(f.outcome.error_traceback)
            report.append(f"    traceback: {where}")
        if f.flaky:
            report.append("    (the shrunk workload did not do it again on replay)")
        report += ["    " + line for line in _calls_around(f)]
        report.append(f"    reproduce: python {script}")
    for f in r.after_others:
        report += [(f"  {f.key} only after earlier workloads on the same engine: "
                    f"{_rule_text(f.key)}"), f"    workload: {f.workload.summary()}",
                   f"    first: {_first(f)}"]
    return ConnectorRun(connector.name, result, tuple(written), tuple(report))


def _calls_around(f: Finding) -> list[str]:
    """The first violation with the records around it, as `kvport trace check` shows them."""
    v = _violation(f)
    if v is None:
        return []
    events = list(f.outcome.events)
    check = replace(analyze(events), violations=[v])
    lines = text_report("trace", events, check, show=1, context=3)
    start = next((i for i, line in enumerate(lines) if line.startswith("  step ")), len(lines))
    return lines[start:]
