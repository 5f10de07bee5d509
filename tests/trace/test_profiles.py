"""Contract profiles: the worker call order of vLLM 0.32 against the legacy one, chosen per
connector group by its trace_header record or forced with --profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvport.trace import cli
from kvport.trace.checker import RULES, analyze, check_trace
from kvport.trace.events import HEADER, TraceEvent, write_events
from kvport.trace.profiles import PROFILE_RULES, PROFILES, TraceHeaderError, get_profile

# One worker step as "method", "method:layer" or "start_load_kv=SYNC" (its ints, 0 or 1) strings.
# vLLM-only hooks (has_connector_metadata, stats, events) are in, as vLLM 0.32 makes them.
LAYERS = ["has_connector_metadata", "wait_for_layer_load:layers.0", "save_kv_layer:layers.0",
          "has_connector_metadata", "wait_for_layer_load:layers.1", "save_kv_layer:layers.1"]
HEAD = ["trace_step", "handle_preemptions", "bind_connector_metadata"]
TAIL = ["wait_for_save", "get_finished", "get_block_ids_with_load_errors",
        "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
        "build_connector_worker_meta", "clear_connector_metadata"]
ASYNC_FORWARD = HEAD + LAYERS + ["start_load_kv=0"] + TAIL  # vLLM 0.32, no sync loads
SYNC_FORWARD = HEAD + ["start_load_kv=1"] + LAYERS + TAIL  # vLLM 0.32 with sync loads
NO_FORWARD = HEAD + ["start_load_kv=0"] + TAIL  # vLLM 0.32 calls wait_for_save here too
LEGACY_NO_FORWARD = [c for c in NO_FORWARD if c != "wait_for_save"]

VLLM_HEADER = {"engine": "vllm", "version": "0.32.0", "call_order": "vllm-0.32"}


def header(result: object, role: str = "worker", pid: int = 7) -> TraceEvent:
    return TraceEvent(seq=0, pid=pid, role=role, connector="Fake", step=None, method=HEADER,
                      result=result)


def steps(*calls_per_step: list[str], pid: int = 7) -> list[TraceEvent]:
    events = []
    for step, calls in enumerate(calls_per_step):
        for call in calls:
            method, _, layer = call.partition(":")
            method, _, sync = method.partition("=")
            events.append(TraceEvent(seq=0, pid=pid, role="worker", connector="Fake", step=step,
                                     method=method, layer=layer or None,
                                     ints=[int(sync)] if sync else []))
    return events


def rules(events: list[TraceEvent], profile: str | None = None) -> list[str]:
    return [v.rule for v in check_trace(events, profile)]


def swap(calls: list[str], a: str, b: str) -> list[str]:
    out = list(calls)
    i, j = out.index(a), out.index(b)
    out[i], out[j] = out[j], out[i]
    return out


def unflagged(calls: list[str]) -> list[str]:
    """The step as an old recorder wrote it: start_load_kv without its sync flag."""
    return ["start_load_kv" if c.startswith("start_load_kv") else c for c in calls]


def moved_before(calls: list[str], call: str, before: str) -> list[str]:
    out = [c for c in calls if c != call]
    i = out.index(before)
    return out[:i] + [call] + out[i:]


# ---- the two orders ---------------------------------------------------------------------------


def test_vllm_trace_with_async_only_forward_steps_passes_under_its_header() -> None:
    trace = [header(VLLM_HEADER)] + steps(ASYNC_FORWARD, NO_FORWARD, SYNC_FORWARD, ASYNC_FORWARD)
    assert check_trace(trace) == []
    assert check_trace(trace, "vllm-0.32") == []


def test_vllm_async_forward_steps_fire_w4_under_legacy() -> None:
    trace = steps(ASYNC_FORWARD, NO_FORWARD, SYNC_FORWARD, ASYNC_FORWARD)
    found = check_trace(trace)  # no header: legacy
    assert [(v.rule, v.step) for v in found] == [("W4", 0), ("W4", 3)]
    # one violation per step, naming the first hook and how many more
    assert found[0].message.endswith("wait_for_layer_load(layers.0) and 3 more layer hook(s) "
                                     "before start_load_kv")
    assert rules([header(VLLM_HEADER)] + trace, "legacy") == ["W4", "W4"]  # --profile wins


def test_legacy_trace_passes_under_both_profiles_except_the_missing_wait_for_save() -> None:
    legacy = steps(HEAD + ["start_load_kv"] + LAYERS + TAIL, LEGACY_NO_FORWARD)
    assert rules(legacy) == []
    assert [(v.rule, v.step) for v in check_trace(legacy, "vllm-0.32")] == [("W5", 1)]


@pytest.mark.parametrize("calls, vllm, legacy", [
    # sync loads: the forward reads them, so start_load_kv must come before the layer hooks
    (moved_before(SYNC_FORWARD, "start_load_kv=1", "wait_for_save"), ["W4"], ["W4"]),
    # no sync loads, but start_load_kv before the forward: not vLLM 0.32's order
    (moved_before(ASYNC_FORWARD, "start_load_kv=0", "has_connector_metadata"), ["W4"], []),
    # no sync flag recorded: either side is accepted, but not between the hooks
    (unflagged(SYNC_FORWARD), [], []),
    (unflagged(ASYNC_FORWARD), [], ["W4"]),
    (moved_before(unflagged(ASYNC_FORWARD), "start_load_kv", "save_kv_layer:layers.1"),
     ["W4"], ["W4"]),
    # wait_for_save: every step, once, before get_finished under vLLM 0.32
    ([c for c in NO_FORWARD if c != "wait_for_save"], ["W5"], []),
    ([c for c in ASYNC_FORWARD if c != "wait_for_save"], ["W5"], ["W4"]),
    (swap(NO_FORWARD, "wait_for_save", "get_finished"), ["W5"], []),
    (NO_FORWARD[:-1] + ["wait_for_save", "clear_connector_metadata"], ["W5"], ["W5"]),
    (moved_before(ASYNC_FORWARD, "wait_for_save", "start_load_kv=0"), ["W5"], ["W4", "W5"]),
    # the load errors are collected before the worker metadata is built under vLLM 0.32
    (swap(NO_FORWARD, "get_block_ids_with_load_errors", "build_connector_worker_meta"),
     ["W8"], []),
    # rules that hold under both orders
    ([c for c in NO_FORWARD if c != "start_load_kv=0"], ["W3"], ["W3"]),
    (swap(SYNC_FORWARD, "save_kv_layer:layers.0", "wait_for_layer_load:layers.0"),
     ["W4"], ["W4"]),
    (moved_before(SYNC_FORWARD, "save_kv_layer:layers.1", "get_block_ids_with_load_errors"),
     ["W5", "W4"], ["W5", "W4"]),
], ids=["sync-load-after-layers", "async-load-before-layers", "no-flag-before", "no-flag-after",
        "no-flag-between", "no-forward-without-save", "forward-without-save",
        "save-after-finished", "two-saves", "save-before-load", "meta-before-errors",
        "no-load", "save-layer-before-wait", "layer-after-finished"])
def test_profile_aware_rules(calls: list[str], vllm: list[str], legacy: list[str]) -> None:
    trace = steps(calls)
    assert rules(trace, "vllm-0.32") == vllm, check_trace(trace, "vllm-0.32")
    assert rules(trace, "legacy") == legacy, check_trace(trace, "legacy")


def test_messages_say_why_the_order_is_wrong() -> None:
    sync_late = steps(moved_before(SYNC_FORWARD, "start_load_kv=1", "wait_for_save"))
    assert "before start_load_kv in a step with sync loads (start_load_kv ints [1])" in \
        check_trace(sync_late, "vllm-0.32")[0].message
    no_save = steps(LEGACY_NO_FORWARD)
    assert check_trace(no_save, "vllm-0.32")[0].message.endswith(
        "no wait_for_save in the step (a no-forward step; vllm-0.32 calls it on every step)")


def test_w0_holds_under_both_profiles() -> None:
    stepless = [TraceEvent(**{**e.to_dict(), "step": None}) for e in steps(NO_FORWARD)[1:]]
    assert rules(stepless, "vllm-0.32") == rules(stepless, "legacy") == ["W0"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from([0, 1, None])), min_size=1,
                max_size=6))
def test_any_vllm_step_sequence_in_its_order_is_clean(shape: list[tuple[bool, int | None]]) -> None:
    calls = []
    for forward, sync in shape:
        load = "start_load_kv" if sync is None else f"start_load_kv={sync}"
        if not forward:
            calls.append(HEAD + [load] + TAIL)
        elif sync == 1:
            calls.append(HEAD + [load] + LAYERS + TAIL)
        else:  # no sync loads (or no flag): vLLM 0.32 starts the loads after the forward
            calls.append(HEAD + LAYERS + [load] + TAIL)
    assert check_trace([header(VLLM_HEADER)] + steps(*calls)) == []


# ---- rules per profile ------------------------------------------------------------------------


def test_every_profile_states_every_rule_and_why_the_differing_ones_differ() -> None:
    ids = {f"W{i}" for i in range(11)} | {f"S{i}" for i in range(8)} | {"G1", "G2", "C1", "C2", "C3"}
    for profile in PROFILES.values():
        assert set(profile.rules) == ids
        assert set(profile.why) == PROFILE_RULES
    differ = {r for r in ids if PROFILES["legacy"].rules[r] != PROFILES["vllm-0.32"].rules[r]}
    assert differ == {"W3", "W4", "W5", "W8"}
    # Model Runner V2 adds finish_forward (W10) and the drafter's deferred save (W4, W5)
    mrv2 = {r for r in ids if PROFILES["vllm-0.32"].rules[r] != PROFILES["vllm-mrv2"].rules[r]}
    assert mrv2 == {"W4", "W5", "W10"}
    assert differ | mrv2 == PROFILE_RULES
    assert RULES == PROFILES["legacy"].rules
    with pytest.raises(ValueError, match="unknown contract profile 'v2'; choose one of legacy, "
                                         "vllm-0.32, vllm-mrv2"):
        get_profile("v2")
    with pytest.raises(ValueError, match="'v2'"):
        check_trace([], "v2")


# ---- headers ----------------------------------------------------------------------------------


def test_header_chooses_the_profile_per_group() -> None:
    vllm_worker = [header(VLLM_HEADER)] + steps(ASYNC_FORWARD)
    kvport_worker = [header({"engine": "kvport", "version": "0.1.0", "call_order": "legacy"},
                            pid=8)] + steps(ASYNC_FORWARD, pid=8)
    bare_worker = steps(ASYNC_FORWARD, pid=9)
    result = analyze(vllm_worker + kvport_worker + bare_worker)
    assert [(g.pid, g.profile, g.profile_source) for g in result.groups] == [
        (7, "vllm-0.32", "header: vllm 0.32.0"), (8, "legacy", "header: kvport 0.1.0"),
        (9, "legacy", "no header: legacy")]
    assert [(v.rule, v.message.split("]")[0]) for v in result.violations] == [
        ("W4", "W4 [worker Fake pid 8"), ("W4", "W4 [worker Fake pid 9")]
    forced = analyze(vllm_worker + kvport_worker + bare_worker, "vllm-0.32")
    assert {(g.profile, g.profile_source) for g in forced.groups} == {("vllm-0.32", "--profile")}
    assert forced.violations == []


@pytest.mark.parametrize("result, problem", [
    ({"engine": "vllm", "version": "0.32.0", "call_order": "v2"}, "call_order must be one of"),
    ({"engine": "vllm", "version": "0.32.0"}, "lacks 'call_order'"),
    ("vllm-0.32", "not a trace header record"),
])
def test_malformed_header_is_a_clear_error(result: object, problem: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    trace = [header(result)] + steps(ASYNC_FORWARD)
    with pytest.raises(TraceHeaderError, match=rf"record #0: bad trace header of worker Fake "
                                               rf"pid 7: .*{problem}.*pass --profile"):
        check_trace(trace)
    path = str(tmp_path / "t.jsonl")
    write_events(path, trace)
    assert cli.main(["check", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}: record #0: bad trace header" in err and "--profile" in err
    # --profile does not read headers: the trace can still be checked
    assert cli.main(["check", path, "--profile", "vllm-0.32"]) == 0


def test_headers_that_disagree_are_an_error() -> None:
    legacy = {**VLLM_HEADER, "call_order": "legacy"}
    trace = [header(VLLM_HEADER)] + steps(NO_FORWARD) + [header(legacy)]
    with pytest.raises(TraceHeaderError, match="call_order 'legacy', record #0 said 'vllm-0.32'"):
        check_trace(trace)
    assert check_trace([header(VLLM_HEADER)] + steps(NO_FORWARD) + [header(VLLM_HEADER)]) == []


def test_scheduler_groups_take_their_header_and_ignore_vllm_only_hooks() -> None:
    sched = [header(VLLM_HEADER, role="scheduler", pid=5)] + [
        TraceEvent(seq=0, pid=5, role="scheduler", connector="Fake", step=s, method=m)
        for s in (0, 1) for m in ("trace_step", "get_finished_count", "build_connector_meta",
                                  "trace_step", "get_kv_connector_stats", "take_events")]
    result = analyze(sched)
    assert result.violations == []
    assert [(g.role, g.profile) for g in result.groups] == [("scheduler", "vllm-0.32")]


def test_profile_argument_errors_name_the_value(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "t.jsonl")
    write_events(path, steps(NO_FORWARD))
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", path, "--profile", "vllm-0.31"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'vllm-0.31'" in err and "legacy" in err and "vllm-0.32" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", path, "--show", "-1"])
    assert exc.value.code == 2
    assert "expected a whole number >= 0, got '-1'" in capsys.readouterr().err
