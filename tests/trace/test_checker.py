"""The trace checker on hand-written traces: for each rule a clean trace and a broken one."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import pytest

from kvport.trace import cli
from kvport.trace.checker import RULES, Violation, check_file, check_trace
from kvport.trace.events import TraceEvent, read_events, write_events

T = TypeVar("T")

# ---- worker traces: one step as a list of "method" or "method:layer" strings ---------------------

FORWARD = [
    "trace_step", "handle_preemptions", "bind_connector_metadata", "start_load_kv",
    "wait_for_layer_load:layers.0", "save_kv_layer:layers.0",
    "wait_for_layer_load:layers.1", "save_kv_layer:layers.1",
    "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "get_kv_connector_stats", "clear_connector_metadata",
]
NO_FORWARD = [c for c in FORWARD if ":" not in c and c != "wait_for_save"]


def worker_step(calls: list[str], step: int | None = 3, pid: int = 7,
                connector: str = "Fake") -> list[TraceEvent]:
    events = []
    for call in calls:
        method, _, layer = call.partition(":")
        events.append(TraceEvent(seq=0, pid=pid, role="worker", connector=connector, step=step,
                                 method=method, layer=layer or None))
    return events


def without(calls: list[T], *drop: T) -> list[T]:
    return [c for c in calls if c not in drop]


def moved(calls: list[str], call: str, before: str) -> list[str]:
    """`call` taken out and put right before `before`."""
    out = without(calls, call)
    i = out.index(before)
    return out[:i] + [call] + out[i:]


def inserted(calls: list[str], call: str, after: str) -> list[str]:
    i = calls.index(after) + 1
    return calls[:i] + [call] + calls[i:]


def rules(events: list[TraceEvent]) -> list[str]:
    return [v.rule for v in check_trace(events)]


@pytest.mark.parametrize("calls", [
    FORWARD,
    NO_FORWARD,
    without(FORWARD, "wait_for_save"),  # wait_for_save is optional
    # wait_for_save is not ordered against get_finished: after it is fine too
    moved(FORWARD, "wait_for_save", "get_block_ids_with_load_errors"),
    moved(FORWARD, "wait_for_save", "clear_connector_metadata"),
    # get_kv_connector_stats is not part of the fixed order
    moved(FORWARD, "get_kv_connector_stats", "bind_connector_metadata"),
], ids=["forward", "no-forward", "no-wait-for-save", "save-after-finished", "save-late",
        "stats-anywhere"])
def test_worker_step_in_contract_order_is_clean(calls: list[str]) -> None:
    assert check_trace(worker_step(calls)) == []


@pytest.mark.parametrize("calls, expected", [
    (without(FORWARD, "handle_preemptions"), ["W1"]),
    (inserted(FORWARD, "handle_preemptions", "get_kv_connector_stats"), ["W1"]),  # twice
    (moved(FORWARD, "handle_preemptions", "start_load_kv"), ["W1", "W2"]),  # bind first
    (without(FORWARD, "bind_connector_metadata"), ["W2"]),
    (inserted(FORWARD, "bind_connector_metadata", "get_kv_connector_stats"), ["W2"]),
    (without(FORWARD, "start_load_kv"), ["W3"]),
    (inserted(FORWARD, "start_load_kv", "start_load_kv"), ["W3"]),
    (moved(FORWARD, "save_kv_layer:layers.1", "wait_for_layer_load:layers.1"), ["W4"]),
    (moved(FORWARD, "wait_for_layer_load:layers.0", "start_load_kv"), ["W4"]),
    (inserted(without(FORWARD, "wait_for_save", "save_kv_layer:layers.1"),
              "save_kv_layer:layers.1", "get_finished"), ["W4"]),
    (moved(FORWARD, "wait_for_save", "save_kv_layer:layers.1"), ["W5"]),
    (inserted(FORWARD, "wait_for_save", "get_kv_connector_stats"), ["W5"]),
    (without(FORWARD, "get_finished"), ["W6"]),
    (moved(NO_FORWARD, "get_finished", "start_load_kv"), ["W6"]),
    (without(FORWARD, "get_block_ids_with_load_errors"), ["W7"]),
    (moved(FORWARD, "get_block_ids_with_load_errors", "get_finished"), ["W7"]),
    (without(FORWARD, "build_connector_worker_meta"), ["W8"]),
    (moved(NO_FORWARD, "build_connector_worker_meta", "get_finished"), ["W8"]),
    (without(FORWARD, "clear_connector_metadata"), ["W9"]),
    (moved(FORWARD, "clear_connector_metadata", "build_connector_worker_meta"), ["W9"]),
])
def test_worker_step_out_of_order_is_flagged(calls: list[str], expected: list[str]) -> None:
    found = check_trace(worker_step(calls))
    assert [v.rule for v in found] == expected, found
    assert all(v.step == 3 and v.req_id is None for v in found)


def test_step_without_worker_calls_misses_every_required_hook() -> None:
    assert rules(worker_step(["trace_step"])) == ["W1", "W2", "W3", "W6", "W7", "W8", "W9"]


def test_worker_calls_outside_any_step_are_flagged_once() -> None:
    assert rules(worker_step(FORWARD[1:], step=None)) == ["W0"]


def test_workers_are_checked_per_process_and_connector() -> None:
    # two worker processes and two connectors in one process, their lines interleaved
    a, b = worker_step(FORWARD, pid=1), worker_step(NO_FORWARD, pid=2)
    c, d = worker_step(FORWARD, pid=1, connector="Other"), worker_step(FORWARD, step=4, pid=1)
    mixed = [e for quad in zip(a, b, c, d) for e in quad] + a[len(b):] + c[len(b):] + d[len(b):]
    assert check_trace(mixed) == []


# ---- scheduler traces -----------------------------------------------------------------------


def ev(method: str, step: int | None, rid: str | None = None, ints: tuple[int, ...] = (),
       result: object = None, sending: tuple[str, ...] = (), recving: tuple[str, ...] = (),
       connector: str = "Fake") -> TraceEvent:
    req_ids = [rid] if rid else sorted({*sending, *recving})
    return TraceEvent(seq=0, pid=5, role="scheduler", connector=connector, step=step,
                      method=method, req_ids=req_ids, ints=list(ints), result=result,
                      finished_sending=list(sending), finished_recving=list(recving))


def mark(step: int) -> TraceEvent:
    return ev("trace_step", step)


def admit(step: int, rid: str, answer: list[object], num_external: int) -> list[TraceEvent]:
    return [ev("get_num_new_matched_tokens", step, rid, (0,), answer),
            ev("update_state_after_alloc", step, rid, (num_external,))]


def build(step: int) -> TraceEvent:
    return ev("build_connector_meta", step)


def output(step: int, sending: tuple[str, ...] = (), recving: tuple[str, ...] = ()) -> TraceEvent:
    return ev("update_connector_output", step, sending=sending, recving=recving)


# "a" loads nothing and its finish keeps the blocks until sent; "b" loads asynchronously.
GOOD = [
    ev("on_new_request", None, "a"), ev("on_new_request", None, "b"),
    mark(0), *admit(0, "a", [0, False], 0), *admit(0, "b", [32, True], 32), build(0),
    mark(0), output(0, recving=("b",)),
    mark(1), ev("update_state_after_alloc", 1, "b", (0,)), build(1),
    mark(1), ev("request_finished", 1, "a", result=True), output(1),
    mark(2), build(2),
    mark(2), ev("request_finished", 2, "b", result=False), output(2, sending=("a",)),
    mark(3), build(3), mark(3), output(3),
]


def test_scheduler_trace_in_contract_order_is_clean() -> None:
    assert check_trace(GOOD) == []


def test_async_scheduling_interleaving_is_clean() -> None:
    # step N+1 is scheduled before step N's output is processed
    trace = [
        mark(0), *admit(0, "a", [0, False], 0), build(0),
        mark(1), build(1),
        mark(0), output(0),
        mark(2), build(2),
        mark(1), ev("request_finished", 1, "a", result=True), output(1),
        mark(3), build(3),  # the idle step's build lands between a's last events
        mark(2), output(2, sending=("a",)),
        mark(3), output(3),
    ]
    assert check_trace(trace) == []


def test_abort_during_async_load_then_recving_is_clean() -> None:
    trace = [mark(0), *admit(0, "b", [16, True], 16), build(0),
             mark(0), ev("request_finished", 0, "b", result=False), output(0),
             mark(1), build(1), mark(1), output(1, recving=("b",))]
    assert check_trace(trace) == []


def test_async_answer_without_allocation_is_not_a_load() -> None:
    # allocation failed after an async answer; next step the connector answers synchronously
    trace = [mark(0), ev("get_num_new_matched_tokens", 0, "b", (0,), [16, True]), build(0),
             mark(1), *admit(1, "b", [16, False], 16), build(1)]
    assert check_trace(trace) == []


def test_preempted_request_loading_twice_gets_two_recvings() -> None:
    trace = [mark(0), *admit(0, "b", [16, True], 16), build(0), mark(0), output(0, recving=("b",)),
             mark(1), ev("update_state_after_alloc", 1, "b", (0,)), build(1),
             mark(2), *admit(2, "b", [16, True], 16), build(2), mark(2), output(2, recving=("b",))]
    assert check_trace(trace) == []


def test_scheduler_connectors_are_checked_separately() -> None:
    # two children of a MultiConnector both see every request
    other = [TraceEvent(**{**e.to_dict(), "connector": "Other"}) for e in GOOD]
    assert check_trace([e for pair in zip(GOOD, other) for e in pair]) == []


def replaced(trace: list[TraceEvent], i: int, *new: TraceEvent) -> list[TraceEvent]:
    return trace[:i] + list(new) + trace[i + 1:]


B0 = GOOD.index(build(0))  # position of build_connector_meta of step 0
FIN_A = GOOD.index(ev("request_finished", 1, "a", result=True))
OUT2 = GOOD.index(output(2, sending=("a",)))


@pytest.mark.parametrize("trace, expected", [
    (replaced(GOOD, B0, ev("build_connector_meta", None)), [("S1", 0, None), ("S0", None, None)]),
    (replaced(GOOD, B0, build(0), build(0)), [("S1", 0, None)]),
    (without(GOOD, build(2)), [("S1", 2, None)]),
    (replaced(GOOD, B0, build(0), ev("update_state_after_alloc", 0, "c", (0,))),
     [("S2", 0, "c")]),
    (GOOD[:B0] + admit(0, "c", [0, True], 0) + GOOD[B0:], [("S3", 0, "c")]),
    # vLLM's ExampleConnector after a prompt shorter than a block was saved (docs/vllm.md)
    (GOOD[:B0] + admit(0, "c", [-128, False], 0) + GOOD[B0:], [("S3", 0, "c")]),
    (GOOD + [ev("request_finished", 3, "a", result=False)], [("S4", 3, "a")]),
    # a preemption reported as a finish: the request comes back
    (GOOD + [mark(4), *admit(4, "b", [0, False], 0), build(4)], [("S5", 4, "b")]),
    (replaced(GOOD, OUT2, output(2)), [("S6", 1, "a")]),
    (GOOD + [output(3, sending=("a",))], [("S6", 3, "a")]),
    (GOOD + [output(3, sending=("b",))], [("S6", 3, "b")]),
    (replaced(GOOD, FIN_A, ev("request_finished", 1, "a", result=False)), [("S6", 2, "a")]),
    (replaced(GOOD, GOOD.index(output(0, recving=("b",))), output(0)), [("S7", 0, "b")]),
    (GOOD + [output(3, recving=("b",))], [("S7", 3, "b")]),
    (GOOD + [output(3, recving=("c",))], [("S7", 3, "c")]),
], ids=["S0-no-step", "S1-two-builds", "S1-no-build", "S2-alloc-after-build", "S3-zero-async", "S3-negative",
        "S4-finished-twice", "S5-preemption-as-finish", "S6-never-sent", "S6-duplicate-send",
        "S6-send-after-false", "S6-send-without-finish", "S7-never-received",
        "S7-duplicate-recv", "S7-recv-without-load"])
def test_scheduler_contract_breaks_are_flagged(
    trace: list[TraceEvent], expected: list[tuple[str, int | None, str | None]]
) -> None:
    found = check_trace(trace)
    assert [(v.rule, v.step, v.req_id) for v in found] == expected, found


def test_every_rule_has_a_description() -> None:
    assert set(RULES) == ({f"W{i}" for i in range(11)} | {f"S{i}" for i in range(8)}
                          | {"G1", "G2", "C1", "C2", "C3"})


def grouped(e: TraceEvent, groups: list[int] | None = None) -> TraceEvent:
    """The event as a connector of two KV cache groups records it (a table per group; the
    finish through request_finished_all_groups)."""
    if e.method not in ("update_state_after_alloc", "request_finished"):
        return e
    method = "request_finished_all_groups" if e.method == "request_finished" else e.method
    return TraceEvent(**{**e.to_dict(), "method": method, "group_blocks": groups or [3, 3]})


GROUPED = [grouped(e) for e in GOOD]


def test_a_trace_of_two_groups_in_contract_order_is_clean() -> None:
    assert check_trace(GROUPED) == []


@pytest.mark.parametrize("trace, expected", [
    (replaced(GROUPED, GOOD.index(ev("update_state_after_alloc", 1, "b", (0,))),
              ev("update_state_after_alloc", 1, "b", (0,))), [("G1", 1, "b")]),
    (replaced(GROUPED, FIN_A, grouped(ev("request_finished", 1, "a", result=True), [3, 3, 3])),
     [("G1", 1, "a")]),
    (replaced(GROUPED, FIN_A, TraceEvent(**{**ev("request_finished", 1, "a", result=True)
                                            .to_dict(), "group_blocks": [3, 3]})),
     [("G2", 1, "a")]),
], ids=["G1-one-table", "G1-three-tables", "G2-request-finished"])
def test_group_contract_breaks_are_flagged(
    trace: list[TraceEvent], expected: list[tuple[str, int | None, str | None]]
) -> None:
    found = check_trace(trace)
    assert [(v.rule, v.step, v.req_id) for v in found] == expected, found


# ---- files and the command line ---------------------------------------------------------------


def test_file_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    write_events(path, GOOD)
    assert read_events(path) == GOOD
    assert check_file(path) == []


@pytest.mark.parametrize("line, problem", [
    ("not json", "Expecting value"), ("[1, 2]", "JSON object"),
    ('{"seq": 0, "pid": 1, "role": "worker", "connector": "C", "step": 0}', "method"),
    ('{"seq": 0, "pid": 1, "role": "gpu", "connector": "C", "step": 0, "method": "x"}', "'gpu'"),
    ('{"seq": 0, "pid": 1, "role": "worker", "connector": "C", "step": "1", "method": "x"}',
     "'1'"),
    (('{"seq": 0, "pid": 1, "role": "worker", "connector": "C", "step": 0, "method": "x", '
      '"colour": 1}'), "colour"),
])
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"seq": 0, "pid": 1, "role": "worker", "connector": "C", "step": 0, '
                    '"method": "x"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"t\.jsonl:3: bad trace record: .*{problem}"):
        read_events(str(path))


def test_violation_prints_step_and_request() -> None:
    assert str(Violation("S6", 4, "r1", "S6 [x] boom")) == "step 4 request r1: S6 [x] boom"
    assert str(Violation("W0", None, None, "W0 [x] boom")) == "step - request -: W0 [x] boom"


def test_cli_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = str(tmp_path / "good.jsonl"), str(tmp_path / "bad.jsonl")
    write_events(good, GOOD)
    write_events(bad, GOOD + [output(3, recving=("b",))])
    assert cli.main(["check", good]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{good}: {len(GOOD)} records, 1 connector group(s)",
                   "  profile legacy (no header: legacy): scheduler Fake pid 5",
                   f"{good}: ok, {len(GOOD)} records, no violations"]
    assert cli.main(["check", bad]) == 1
    out = capsys.readouterr().out.splitlines()
    assert ("  step 3 request b: S7 [scheduler Fake pid 5] duplicate finished_recving: "
            "no async load of the request is pending") in out
    assert out[-1] == f"{bad}: 1 violation(s) in {len(GOOD) + 1} records (S7 1)"
    assert cli.main(["check", good, bad]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [f"{good}: ok, {len(GOOD)} records, no violations",
                        f"{bad}: 1 violation(s) in {len(GOOD) + 1} records (S7 1)"]
    assert cli.main(["check", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    # an unreadable file stops the run before any report: no half-printed output
    assert cli.main(["check", good, str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().out == ""


def test_add_trace_parser_hooks_into_the_kvport_command(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="kvport")
    cli.add_trace_parser(parser.add_subparsers(dest="command", required=True))
    good = str(tmp_path / "good.jsonl")
    write_events(good, GOOD)
    args = parser.parse_args(["trace", "check", good])
    assert args.func(args) == 0


def test_cli_as_module(tmp_path: Path) -> None:
    bad = str(tmp_path / "bad.jsonl")
    write_events(bad, worker_step(without(FORWARD, "handle_preemptions")))
    proc = subprocess.run([sys.executable, "-m", "kvport.trace.cli", "check", bad],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "  step 3 request -: W1 [worker Fake pid 7] no handle_preemptions in the step\n" \
        in proc.stdout
