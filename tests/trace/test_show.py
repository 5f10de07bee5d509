"""`kvport trace show TRACE --request ID`: one request's calls across both halves, by step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvport.trace import cli
from kvport.trace.events import TraceEvent, write_events
from kvport.trace.show import known_requests, request_calls


def sched(method: str, step: int | None, req_ids: tuple[str, ...] = (), **kw: object) -> TraceEvent:
    return TraceEvent(seq=0, pid=5, role="scheduler", connector="Fake", step=step, method=method,
                      req_ids=list(req_ids), **kw)  # type: ignore[arg-type]


def work(method: str, step: int, req_ids: tuple[str, ...] = (), **kw: object) -> TraceEvent:
    return TraceEvent(seq=0, pid=7, role="worker", connector="Fake", step=step, method=method,
                      req_ids=list(req_ids), **kw)  # type: ignore[arg-type]


def worker_step(step: int, scheduled: tuple[str, ...], recving: tuple[str, ...] = ()
                ) -> list[TraceEvent]:
    return [work("trace_step", step), work("handle_preemptions", step),
            work("bind_connector_metadata", step),
            work("start_load_kv", step, scheduled, ints=[0]), work("wait_for_save", step),
            work("get_finished", step, result=[[], list(recving)]),
            work("clear_connector_metadata", step)]


# The scheduler (pid 5) and the worker (pid 7) append to one file. The worker's step-0 lines
# landed before the scheduler's (another process: file order says nothing across them), and
# with async scheduling step 1 is scheduled before step 0's output is taken.
SCHEDULER = [
    sched("on_new_request", None, ("a",)), sched("on_new_request", None, ("b",)),
    sched("trace_step", 0),
    sched("get_num_new_matched_tokens", 0, ("b",), ints=[0], result=[32, True]),
    sched("update_state_after_alloc", 0, ("b",), ints=[32], num_blocks=2),
    sched("build_connector_meta", 0, ("a",), ints=[16]),
    sched("trace_step", 1), sched("build_connector_meta", 1, ("a",), ints=[1]),
    sched("trace_step", 0),
    sched("update_connector_output", 0, ("b",), finished_recving=["b"]),
    sched("trace_step", 1), sched("request_finished", 1, ("a",), result=False),
]
TRACE = worker_step(0, ("a",), recving=("b",)) + SCHEDULER + worker_step(1, ("a",))


def test_calls_of_one_request_are_ordered_by_step_then_part() -> None:
    calls = request_calls(TRACE, "b")
    assert [(c.event.step, c.part, c.event.method) for c in calls] == [
        (None, "before steps", "on_new_request"),
        (0, "schedule", "get_num_new_matched_tokens"),
        (0, "schedule", "update_state_after_alloc"),
        (0, "worker", "get_finished"),  # named in the result: the load it finished
        (0, "output", "update_connector_output"),
    ]
    a = [(c.event.step, c.part, c.event.method) for c in request_calls(TRACE, "a")]
    assert a == [(None, "before steps", "on_new_request"), (0, "schedule", "build_connector_meta"),
                 (0, "worker", "start_load_kv"), (1, "schedule", "build_connector_meta"),
                 (1, "worker", "start_load_kv"), (1, "output", "request_finished")]
    assert known_requests(TRACE) == ["a", "b"]  # in file order


def test_show_prints_steps_and_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "t.jsonl")
    write_events(path, TRACE)
    assert cli.main(["show", path, "--request", "b"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"request b in {path}: 5 call(s), steps 0-0"
    assert out[1].startswith("  order: by step; within a step the scheduler's schedule calls")
    assert out[2] == "before any step"
    assert out[3].startswith("  before steps #8 ") and "on_new_request req b" in out[3]
    assert out[4] == "step 0"
    parts = [line.split()[0] for line in out[5:]]
    assert parts == ["schedule", "schedule", "worker", "output"]
    assert "worker Fake pid 7 get_finished -> [[],[\"b\"]]" in out[7]
    assert "scheduler Fake pid 5 update_connector_output req b recving b" in out[8]


def test_unknown_request_lists_known_ones(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "t.jsonl")
    many = TRACE + [sched("on_new_request", 2, (f"r{i}",)) for i in range(10)]
    write_events(path, many)
    assert cli.main(["show", path, "--request", "zz"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"kvport trace show: request 'zz' is not in {path}; it names a, b, "
                           "r0, r1, r2, r3, r4, r5 and 4 more: pass one of those to --request")
    write_events(path, worker_step(0, ()))
    assert cli.main(["show", path, "--request", "zz"]) == 2
    assert "no record of it names any request" in capsys.readouterr().err
    assert cli.main(["show", str(tmp_path / "missing.jsonl"), "--request", "a"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_show_through_the_kvport_command(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    write_events(path, TRACE)
    argv = ["trace", "show", path, "--request", "a"]
    code = f"import sys; from kvport.cli import main; sys.exit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"request a in {path}: 6 call(s), steps 0-1")
