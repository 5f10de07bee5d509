"""TraceWriter, the one writer behind both call recorders: what it writes around a call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvport.trace.checker import check_file
from kvport.trace.events import HEADER, STEP_MARKER, TraceHeader, read_events
from kvport.trace.writer import MAX_ERROR_CHARS, TraceWriter

HEAD = TraceHeader("test-engine", "1.0", "vllm-0.32")


def test_header_first_then_steps_then_records_with_their_fields(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    writer = TraceWriter(path, "worker", "W", HEAD)
    assert writer.call("register_kv_caches", lambda: None, fields={"ints": [4, 16, 2]}) is None
    writer.start_step(0)
    assert writer.call("get_finished", lambda ids: (ids, None), {"a"},
                       summary=lambda out: [sorted(out[0]), []]) == ({"a"}, None)
    events = read_events(path)
    assert [(e.method, e.step) for e in events] == [
        (HEADER, None), ("register_kv_caches", None), (STEP_MARKER, 0), ("get_finished", 0)]
    assert TraceHeader.from_event(events[0]) == HEAD
    assert events[1].ints == [4, 16, 2] and events[3].result == [["a"], []]
    assert {(e.pid, e.role, e.connector) for e in events} == {(os.getpid(), "worker", "W")}
    assert [e.seq for e in events] == sorted(e.seq for e in events)


def test_errors_are_recorded_capped_and_raised_and_bad_answers_kept_as_repr(
        tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    writer = TraceWriter(path, "scheduler", "S")

    def fail() -> None:
        raise RuntimeError("x" * 1000)

    with pytest.raises(RuntimeError):
        writer.call("build_connector_meta", fail)
    assert writer.call("get_num_new_matched_tokens", lambda: 7,
                       summary=lambda out: [out[0], bool(out[1])]) == 7
    failed, odd = read_events(path)  # no header given: none written
    assert failed.error is not None and len(failed.error) == MAX_ERROR_CHARS
    assert failed.error.startswith("RuntimeError: xxx")
    assert odd.result == "7"


def test_a_closed_writer_still_runs_the_call_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(str(path), "worker", "W", HEAD)
    fd = writer.fileno()
    writer.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    calls: list[int] = []
    writer.call("wait_for_save", calls.append, 1)
    assert calls == [1] and path.read_text() == "" and writer.fileno() == -1


def test_same_names_get_their_own_labels_and_roles_are_checked(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    labels = [TraceWriter(path, "worker", "W").label for _ in range(2)]
    assert labels == ["W", "W#2"]
    assert TraceWriter(path, "scheduler", "W").label == "W"
    with pytest.raises(ValueError, match="role must be one of"):
        TraceWriter(path, "both", "W")
    assert check_file(path) == []
