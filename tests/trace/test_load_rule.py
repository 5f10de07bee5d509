"""Load rule C3 on hand-made worker traces: a loaded block whose fingerprint is far from the one
its tokens had when the engine computed them is reported once per load, at the load's record,
with its step, request and block; rounding is not; a block that was never seen computed (or
whose load failed) is not judged, and a note counts it."""

from __future__ import annotations

from typing import Any

from kvport.trace.checker import analyze
from kvport.trace.events import HEADER, STEP_MARKER, WORKER, TraceEvent, TraceHeader
from kvport.trace.loaded import LOADED_MARKER, MAX_DISTANCE
from kvport.trace.profiles import COMMON_WHY, PROFILES
from kvport.trace.report import text_report


def trace(*loads: dict[str, Any]) -> list[TraceEvent]:
    events = [TraceEvent(0, 1, WORKER, "W", None, HEADER,
                         result=TraceHeader("vllm", "0.32.0", "vllm-0.32").to_result())]
    for step, load in enumerate(loads):
        events.append(TraceEvent(len(events), 1, WORKER, "W", step, STEP_MARKER))
        events.append(TraceEvent(len(events), 1, WORKER, "W", step, LOADED_MARKER, **load))
    return events


def load(rid: str, first: int, distances: list[float | None]) -> dict[str, Any]:
    return {"req_ids": [rid], "ints": [first],
            "result": {"block_ids": [10 + k for k in range(len(distances))],
                       "distances": distances}}


def c3(events: list[TraceEvent]) -> tuple[list[Any], list[str]]:
    result = analyze(events)
    return [v for v in result.violations if v.rule == "C3"], result.notes


def test_a_load_of_another_blocks_kv_is_c3_at_the_load_with_its_block() -> None:
    events = trace(load("r1", 2, [0.0, 0.86, 0.84]))
    found, _ = c3(events)
    assert len(found) == 1  # one finding per load
    v = found[0]
    assert (v.step, v.req_id, v.pos) == (0, "r1", 2)
    assert "block 3 (engine block 11)" in v.message and "0.86" in v.message


def test_rounding_is_not_c3_and_a_later_bad_load_is() -> None:
    events = trace(load("r1", 0, [0.0, MAX_DISTANCE]), load("r2", 0, [0.0004, 0.5]))
    found, notes = c3(events)
    assert [(v.step, v.req_id) for v in found] == [(1, "r2")]
    assert notes == []


def test_blocks_never_seen_computed_are_not_judged_and_a_note_counts_them() -> None:
    found, notes = c3(trace(load("r1", 0, [None, None, 0.0])))
    assert found == []
    assert len(notes) == 1 and "2 loaded block(s) not judged (C3)" in notes[0]


def test_a_malformed_load_record_is_a_note_not_a_crash() -> None:
    bad = {"req_ids": ["r1"], "ints": [0], "result": {"block_ids": [1], "distances": []}}
    found, notes = c3(trace(bad))
    assert found == [] and "malformed trace_loaded" in notes[0]


def test_the_report_says_what_c3_asks_and_why() -> None:
    events = trace(load("r1", 0, [0.9]))
    report = "\n".join(text_report("t.jsonl", events, analyze(events)))
    assert "C3" in PROFILES["vllm-0.32"].rules and "46951" in COMMON_WHY["C3"]
    assert "C3: 1 violation(s)" in report and PROFILES["vllm-0.32"].rules["C3"] in report
    assert "another request's attention state" in report  # why it matters
    assert "trace_loaded" in report  # the record around it
