"""The conformance search (kvport.conformance.search) and what the driver makes of a workload's
records (driver.py), on a scripted session: a stand-in for the engine whose outcome is a
function of the workload and of what earlier workloads left in its "store", so each property of
the search (shrinking per rule, fresh engines while shrinking, rules found only after other
workloads, the crash after a broken rule, the budget) is shown deterministically. The real
engine runs in tests/vllm/test_vllm_conformance.py."""

from __future__ import annotations

from pathlib import Path

from kvport.conformance.driver import (
    CRASH,
    Outcome,
    _before_crash,
    _before_first_step,
    _read_from,
)
from kvport.conformance.search import Search, finding_key
from kvport.conformance.workload import Workload
from kvport.trace.events import STEP_MARKER, TraceEvent, encode_line
from kvport.trace.findings import Violation


def _outcome(rules: list[str], error: str | None = None) -> Outcome:
    return Outcome(tuple(Violation(r, 0, "r0-x", f"{r} [..] text", 0) for r in rules), (),
                   error, (), 0, 1, 0, 0)


class ScriptedSession:
    """Breaks C2 when two requests of a workload share a prompt under different salts (a
    connector keyed by tokens alone); then "crashes". Breaks S3 on a request of one output token, but
    only on an engine that ran a workload before (as ExampleConnector's empty-prefix key needs
    an earlier sub-block prompt saved).
    With `length_rule`, breaks C1 on a prompt as long as one this engine saw before: alone
    with two such prompts, or with one after an earlier workload."""

    def __init__(self, history_rule: bool = True, length_rule: bool = False) -> None:
        self.history_rule = history_rule
        self.length_rule = length_rule  # C1 on a prompt length this engine saw before
        self.lengths: set[int] = set()
        self.engines_started = 1
        self.runs_since_fresh = 0
        self.fresh_runs = 0

    def run(self, workload: Workload, *, fresh: bool = False) -> Outcome:
        if fresh:
            self.engines_started += 1
            self.fresh_runs += 1
            self.runs_since_fresh = 0
            self.lengths = set()
        rules: list[str] = []
        seen: dict[tuple[int, ...], str | None] = {}
        for a in workload.arrivals:
            if a.prompt in seen and seen[a.prompt] != a.cache_salt:
                rules.append("C2")
            seen.setdefault(a.prompt, a.cache_salt)
        if self.runs_since_fresh and self.history_rule and any(
                a.max_tokens == 1 for a in workload.arrivals):
            rules.append("S3")
        self.runs_since_fresh += 1
        for a in workload.arrivals:
            if self.length_rule and len(a.prompt) in self.lengths:
                rules.append("C1")
            self.lengths.add(len(a.prompt))
        return _outcome(rules[:1], "RuntimeError: shape mismatch" if rules else None)


def test_each_rule_is_shrunk_to_its_shortest_workload_on_fresh_engines() -> None:
    session = ScriptedSession()
    result = Search(session, seed=3, max_shrink_plays=200).run(300)  # type: ignore[arg-type]
    c2 = [f for f in result.findings if f.key == "C2"]
    assert len(c2) == 1 and not c2[0].flaky
    arrivals = c2[0].workload.arrivals
    assert len(arrivals) == 2 and {a.cache_salt for a in arrivals} == {None, "tenant-1"}
    assert len(arrivals[0].prompt) == 128  # shrunk: one segment of the simplest length, a block
    assert session.fresh_runs > 0 and result.engines == session.engines_started
    assert result.examples == 300 and result.clean + len(result.findings) <= result.examples


def test_a_shrunk_workload_breaks_its_rule_alone() -> None:
    # Shrunk on the engine that ran earlier workloads, one prompt would do (its length was
    # seen before); alone it takes two.
    session = ScriptedSession(history_rule=False, length_rule=True)
    result = Search(session, seed=3, max_shrink_plays=200).run(300)  # type: ignore[arg-type]
    c1 = next(f for f in result.findings if f.key == "C1")
    lengths = [len(a.prompt) for a in c1.workload.arrivals]
    assert len(lengths) == 2 and lengths[0] == lengths[1], lengths


def test_a_rule_broken_only_after_other_workloads_is_told_apart() -> None:
    result = Search(ScriptedSession(), seed=3).run(300)  # type: ignore[arg-type]
    assert "S3" not in {f.key for f in result.findings}  # never alone: nothing to shrink
    s3 = [f for f in result.after_others if f.key == "S3"]
    assert s3 and any(a.max_tokens == 1 for a in s3[0].workload.arrivals)


def test_the_shrink_budget_bounds_the_plays_and_the_best_workload_still_fails() -> None:
    session = ScriptedSession(history_rule=False)
    result = Search(session, seed=3, max_shrink_plays=2).run(300)  # type: ignore[arg-type]
    (c2,) = result.findings
    assert c2.key == "C2" and not c2.flaky and c2.outcome.violations[0].rule == "C2"
    # fresh engines: the check that it breaks C2 alone, then two shrinking plays
    assert session.fresh_runs <= 3, session.fresh_runs


def test_a_crash_after_a_broken_rule_is_that_rules_and_alone_is_a_finding() -> None:
    assert finding_key(_outcome(["C1"], "RuntimeError: x"), set()) == "C1"
    assert finding_key(_outcome(["C1"], "RuntimeError: x"), {"C1"}) is None
    assert finding_key(_outcome(["C1", "C2"]), {"C1"}) == "C2"
    assert finding_key(_outcome([], "IndexError: y"), set()) == CRASH
    assert finding_key(_outcome([], "IndexError: y"), {CRASH}) is None
    assert finding_key(_outcome([]), set()) is None


def _ev(step: int | None, method: str, role: str = "scheduler") -> TraceEvent:
    return TraceEvent(0, 1, role, "C", step, method)


def test_a_workloads_records_before_its_first_step_are_outside_any_step() -> None:
    # on_new_request comes before the engine announces the step: it carries the last one's.
    records = [_ev(7, "on_new_request"), _ev(8, STEP_MARKER), _ev(8, "build_connector_meta"),
               _ev(7, "get_finished", "worker"), _ev(8, STEP_MARKER, "worker")]
    out = _before_first_step(records)
    assert [e.step for e in out] == [None, 8, 8, None, 8]


def test_a_crash_drops_only_what_the_stop_made() -> None:
    events = [_ev(2, "update_connector_output"), _ev(3, "get_num_new_matched_tokens"),
              _ev(3, "bind_connector_metadata", "worker"), _ev(3, "build_connector_meta"),
              _ev(2, "update_state_after_alloc")]
    found = [Violation("C1", 3, "a", "C1", 1), Violation("W2", 3, None, "W2", 2),
             Violation("S6", 2, "b", "S6 duplicate", 0), Violation("S1", 3, None, "S1", 3),
             Violation("W9", 2, None, "W9", 2), Violation("S7", 2, "c", "S7 never", 4)]
    # kept: the claim, the duplicate send named by an output, a step before the crash's;
    # dropped: the crashed step's missing calls, the load the crash left open
    assert [v.rule for v in _before_crash(found, 3, events)] == ["C1", "S6", "W9"]


def test_records_are_read_whole_lines_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    line = encode_line(_ev(0, STEP_MARKER).to_dict())
    path.write_bytes(line + line[:10])  # a second record half written
    events, offset = _read_from(path, 0)
    assert len(events) == 1 and offset == len(line)
    path.write_bytes(line + line)
    events, offset = _read_from(path, offset)
    assert len(events) == 1 and offset == 2 * len(line)
    assert _read_from(tmp_path / "missing", 5) == ([], 5)


def test_a_finding_is_reported_at_its_own_rule_in_workload_steps_and_ids() -> None:
    from kvport.conformance.run import _first
    from kvport.conformance.search import Finding

    outcome = Outcome((Violation("S3", 12, "r1-ab12cd34", "S3 [..] answered -128", 0),
                       Violation("C1", 13, "r3-00ff00ff", "C1 [..] claims [0, 640)", 1)),
                      (), None, (), 10, 4, 1, 1)
    text = _first(Finding("C1", Workload(()), outcome))
    assert text == "workload step 3, request r3: C1 [..] claims [0, 640)"
