"""`kvport trace check`'s report: violations grouped by rule, the first few with the records
around them in their connector group, a summary, and the same as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_profiles import ASYNC_FORWARD, LEGACY_NO_FORWARD, NO_FORWARD, VLLM_HEADER, header, steps

from kvport.trace import cli
from kvport.trace.checker import analyze
from kvport.trace.events import TraceEvent, read_events, write_events
from kvport.trace.profiles import PROFILES
from kvport.trace.report import one_line


def interleaved(a: list[TraceEvent], b: list[TraceEvent]) -> list[TraceEvent]:
    out = [e for pair in zip(a, b, strict=False) for e in pair]
    return out + a[len(b):] + b[len(a):]


@pytest.fixture
def trace(tmp_path: Path) -> str:
    """Worker pid 7 (no header: legacy) runs five vLLM-0.32-style async forward steps: five W4.
    Worker pid 8 (vllm-0.32 header) skips wait_for_save in a no-forward step: one W5.
    Their lines are interleaved, as two processes appending to one file make them."""
    path = str(tmp_path / "trace.jsonl")
    legacy = steps(*[ASYNC_FORWARD] * 5)
    vllm = [header(VLLM_HEADER, pid=8)] + steps(NO_FORWARD, LEGACY_NO_FORWARD, pid=8)
    write_events(path, interleaved(legacy, vllm))
    return path


def test_report_groups_by_rule_and_shows_the_first_few_in_context(
        trace: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", trace, "--show", "2"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [f"{trace}: {len(read_events(trace))} records, 2 connector group(s)",
                       "  profile legacy (no header: legacy): worker Fake pid 7",
                       "  profile vllm-0.32 (header: vllm 0.32.0): worker Fake pid 8"]
    w4 = out.index("W4: 5 violation(s)")
    assert out[w4 + 1] == f"  rule (legacy): {PROFILES['legacy'].rules['W4']}"
    assert out[w4 + 2] == f"  why (legacy): {PROFILES['legacy'].why['W4']}"
    shown = [line for line in out[w4:] if line.startswith("  step ")]
    assert [line.split(":")[0] for line in shown] == ["  step 0 request -", "  step 1 request -",
                                                      "  step 1 request -"]  # last one is W5's
    assert "  ... 3 more W4 violation(s) (--show N shows more)" in out
    w5 = out.index("W5: 1 violation(s)")
    assert out[w5 + 1] == f"  rule (vllm-0.32): {PROFILES['vllm-0.32'].rules['W5']}"
    assert out[-1] == f"{trace}: 6 violation(s) in {len(read_events(trace))} records (W4 5, W5 1)"


def test_context_is_the_violation_s_own_group_without_unchecked_calls(
        trace: str, capsys: pytest.CaptureFixture[str]) -> None:
    events = read_events(trace)
    first = analyze(events).violations[0]
    assert cli.main(["check", trace, "--show", "1", "--context", "2"]) == 1
    out = capsys.readouterr().out.splitlines()
    i = out.index(f"  {first}")
    context = out[i + 1:i + 6]
    assert [line[4:6] for line in context] == ["  ", "  ", "> ", "  ", "  "]
    positions = [int(line.split("#")[1].split()[0]) for line in context]
    assert positions[2] == first.pos
    assert events[first.pos].method == "wait_for_layer_load"
    # neighbours from worker pid 7 only, and no has_connector_metadata between them
    assert all(events[p].pid == 7 for p in positions)
    assert [events[p].method for p in positions] == [
        "handle_preemptions", "bind_connector_metadata", "wait_for_layer_load", "save_kv_layer",
        "wait_for_layer_load"]
    assert out[i + 6] == "  ... 4 more W4 violation(s) (--show N shows more)"


def test_show_zero_prints_counts_and_rules_only(trace: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", trace, "--show", "0"]) == 1
    out = capsys.readouterr().out
    assert "W4: 5 violation(s)" in out and "  ... 5 more W4 violation(s)" in out
    assert "  step " not in out and "> #" not in out


def test_a_rule_broken_under_two_profiles_shows_both_texts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "t.jsonl")
    twice = NO_FORWARD[:-1] + ["wait_for_save", "clear_connector_metadata"]
    write_events(path, steps(twice) + [header(VLLM_HEADER, pid=8)] + steps(twice, pid=8))
    assert cli.main(["check", path]) == 1
    out = capsys.readouterr().out.splitlines()
    i = out.index("W5: 2 violation(s)")
    assert out[i + 1:i + 5] == [
        f"  rule (legacy): {PROFILES['legacy'].rules['W5']}",
        f"  why (legacy): {PROFILES['legacy'].why['W5']}",
        f"  rule (vllm-0.32): {PROFILES['vllm-0.32'].rules['W5']}",
        f"  why (vllm-0.32): {PROFILES['vllm-0.32'].why['W5']}"]


def test_json_report(trace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "report.json"
    assert cli.main(["check", trace, "--json", str(out_path)]) == 1
    assert "W4: 5 violation(s)" in capsys.readouterr().out  # the text report as well
    doc = json.loads(out_path.read_text())
    assert doc["num_violations"] == 6
    [entry] = doc["files"]
    assert entry["path"] == trace
    assert entry["groups"] == [
        {"pid": 7, "role": "worker", "connector": "Fake", "profile": "legacy",
         "profile_source": "no header: legacy"},
        {"pid": 8, "role": "worker", "connector": "Fake", "profile": "vllm-0.32",
         "profile_source": "header: vllm 0.32.0"}]
    assert entry["counts_by_rule"] == {"W4": 5, "W5": 1}
    events = read_events(trace)
    first = entry["violations"][0]
    assert set(first) == {"rule", "step", "req_id", "message", "pos"}
    assert (first["rule"], first["step"], first["req_id"]) == ("W4", 0, None)
    assert events[first["pos"]].method == "wait_for_layer_load"
    assert first["message"].startswith("W4 [worker Fake pid 7] wait_for_layer_load(layers.0)")


def test_json_to_stdout_moves_the_text_report_to_stderr(
        trace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = str(tmp_path / "good.jsonl")
    write_events(good, steps(NO_FORWARD))
    assert cli.main(["check", good, trace, "--json", "-"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [f["path"] for f in doc["files"]] == [good, trace]
    assert doc["files"][0]["violations"] == [] and doc["files"][0]["counts_by_rule"] == {}
    assert f"{good}: ok, {len(NO_FORWARD)} records, no violations" in captured.err


def test_unwritable_json_path_fails_before_the_report(
        trace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = str(tmp_path / "no-such-dir" / "r.json")
    assert cli.main(["check", trace, "--json", bad]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"cannot write --json {bad!r}" in captured.err and "'-' for stdout" in captured.err


def test_one_line_shows_only_what_a_record_carries() -> None:
    e = TraceEvent(seq=3, pid=5, role="scheduler", connector="Fake", step=2,
                   method="update_state_after_alloc", req_ids=["r1"], ints=[32], num_blocks=4)
    assert one_line(9, e) == "  #9     step 2    scheduler update_state_after_alloc req r1 " \
                             "ints [32] blocks 4"
    out = TraceEvent(seq=4, pid=5, role="scheduler", connector="Fake", step=None,
                     method="update_connector_output", req_ids=list("abcdef"),
                     finished_recving=list("abcdef"), error="RuntimeError: boom")
    assert one_line(10, out, marked=True, who=True) == (
        "> #10    step -    scheduler Fake pid 5 update_connector_output req a,b,c,d +2 "
        "recving a,b,c,d +2 !! RuntimeError: boom")
    long = TraceEvent(seq=0, pid=1, role="worker", connector="C", step=0, method="get_finished",
                      result=[[f"request-{i}" for i in range(20)], []])
    assert one_line(0, long).endswith("...") and len(one_line(0, long)) < 120
