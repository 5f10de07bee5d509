"""Check a recorded connector trace against the connector contract.

Records are grouped per connector instance (pid, role, connector label), because the scheduler
half, the worker half and each child of a MultiConnector have their own contract. Nothing depends
on positions across requests or across steps (async scheduling interleaves them): worker rules are
checked per step, scheduler rules per step and per request, in file order within one group.

Each violation names a rule id from RULES, the step, the request (or None) and what went wrong.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from kvport.trace.events import SCHEDULER, STEP_MARKER, TraceEvent, read_events

RULES: dict[str, str] = {
    "W0": "worker per-step hooks are called inside an announced step (trace_step)",
    "W1": "handle_preemptions is called exactly once per step, first",
    "W2": "bind_connector_metadata is called exactly once per step, right after handle_preemptions",
    "W3": "start_load_kv is called exactly once per step, after bind_connector_metadata",
    "W4": "layer hooks run after start_load_kv and before get_finished; per layer, "
          "wait_for_layer_load before save_kv_layer",
    "W5": "wait_for_save is optional, at most once per step, after start_load_kv and the layer hooks",
    "W6": "get_finished is called exactly once per step, after start_load_kv",
    "W7": "get_block_ids_with_load_errors is called exactly once per step, after get_finished",
    "W8": "build_connector_worker_meta is called exactly once per step, after get_finished",
    "W9": "clear_connector_metadata is called exactly once per step, last",
    "S0": "build_connector_meta and update_state_after_alloc run inside an announced step",
    "S1": "build_connector_meta is called exactly once per scheduler step",
    "S2": "update_state_after_alloc of step N comes before build_connector_meta of step N",
    "S3": "get_num_new_matched_tokens never answers (0, True)",
    "S4": "request_finished is called at most once per request",
    "S5": "no scheduler call names a request after its request_finished (except finished_* sets)",
    "S6": "request_finished True is followed by exactly one finished_sending; False by none; "
          "no finished_sending without a True",
    "S7": "an async load (is_async answer, then update_state_after_alloc with tokens > 0) is "
          "followed by exactly one finished_recving; none without a pending load",
}

# The worker hooks whose order within one step the contract fixes.
WORKER_STEP_METHODS = frozenset({
    "handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "clear_connector_metadata",
})
_LAYER_HOOKS = ("wait_for_layer_load", "save_kv_layer")
# Scheduler calls whose req_ids name requests the scheduler still holds.
_REQUEST_CALLS = frozenset({
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
    "build_connector_meta", "request_finished",
})

_STEP_CALLS = frozenset({"build_connector_meta", "update_state_after_alloc"})


@dataclass(frozen=True)
class Violation:
    rule: str  # a key of RULES
    step: int | None
    req_id: str | None
    message: str

    def __str__(self) -> str:
        step = "-" if self.step is None else self.step
        req = "-" if self.req_id is None else self.req_id
        return f"step {step} request {req}: {self.message}"


class _Report:
    """Violations of one connector group, kept with the trace position that caused them."""

    def __init__(self, where: str) -> None:
        self.where = where  # "worker ExampleConnector pid 42", prefixed to every message
        self.items: list[tuple[int, Violation]] = []

    def add(self, pos: int, rule: str, step: int | None, req_id: str | None, text: str) -> None:
        self.items.append((pos, Violation(rule, step, req_id, f"{rule} [{self.where}] {text}")))


def check_file(path: str) -> list[Violation]:
    return check_trace(read_events(path))


def check_trace(events: Iterable[TraceEvent]) -> list[Violation]:
    """All violations, in the order of the trace records that caused them."""
    groups: dict[tuple[int, str, str], list[tuple[int, TraceEvent]]] = defaultdict(list)
    for pos, event in enumerate(events):
        groups[(event.pid, event.role, event.connector)].append((pos, event))
    found: list[tuple[int, Violation]] = []
    for (pid, role, connector), group in groups.items():
        report = _Report(f"{role} {connector} pid {pid}")
        if role == SCHEDULER:
            _check_scheduler(group, report)
        else:
            _check_worker(group, report)
        found.extend(report.items)
    found.sort(key=lambda item: item[0])
    return [violation for _, violation in found]


# ---- worker -------------------------------------------------------------------------------------


def _check_worker(group: list[tuple[int, TraceEvent]], report: _Report) -> None:
    steps: dict[int, list[tuple[int, TraceEvent]]] = defaultdict(list)
    stepless = [(pos, e) for pos, e in group if e.step is None and e.method in WORKER_STEP_METHODS]
    if stepless:
        pos, e = stepless[0]
        report.add(pos, "W0", None, None, f"{len(stepless)} per-step call(s) recorded before any "
                   f"trace_step, first {e.method} (does the engine call trace_step?)")
    for pos, e in group:
        if e.step is not None and (e.method in WORKER_STEP_METHODS or e.method == STEP_MARKER):
            steps[e.step].append((pos, e))
    for step, items in steps.items():
        _check_worker_step(step, items, report)


def _check_worker_step(step: int, items: list[tuple[int, TraceEvent]], report: _Report) -> None:
    calls = [(pos, e) for pos, e in items if e.method != STEP_MARKER]
    names = [e.method for _, e in calls]
    end = calls[-1][0] if calls else items[0][0]

    def at(i: int) -> int:  # trace position of the i-th call, for sorting the report
        return calls[i][0] if 0 <= i < len(calls) else end

    def once(method: str, rule: str) -> int | None:
        """Index of the single call of `method`; a violation (and the first index) otherwise."""
        idx = [i for i, name in enumerate(names) if name == method]
        if len(idx) != 1:
            got = "no" if not idx else f"{len(idx)} calls of"
            report.add(at(idx[1] if idx else -1), rule, step, None, f"{got} {method} in the step")
        return idx[0] if idx else None

    def after(i: int | None, j: int | None, rule: str, text: str) -> None:
        if i is not None and j is not None and i <= j:
            report.add(at(i), rule, step, None, text)

    hp = once("handle_preemptions", "W1")
    if hp is not None and hp != 0:
        report.add(at(0), "W1", step, None, f"{names[0]} before handle_preemptions")
    bind = once("bind_connector_metadata", "W2")
    if hp is not None and bind is not None and bind != hp + 1:
        report.add(at(bind), "W2", step, None, "bind_connector_metadata is not right after "
                   f"handle_preemptions (after {names[bind - 1] if bind else 'nothing'})")
    load = once("start_load_kv", "W3")
    after(load, bind, "W3", "start_load_kv before bind_connector_metadata")
    finished = once("get_finished", "W6")
    after(finished, load, "W6", "get_finished before start_load_kv")
    after(once("get_block_ids_with_load_errors", "W7"), finished, "W7",
          "get_block_ids_with_load_errors before get_finished")
    after(once("build_connector_worker_meta", "W8"), finished, "W8",
          "build_connector_worker_meta before get_finished")
    clear = once("clear_connector_metadata", "W9")
    if clear is not None and clear != len(names) - 1:
        report.add(at(len(names) - 1), "W9", step, None,
                   f"{names[-1]} after clear_connector_metadata")

    layer_idx = [i for i, name in enumerate(names) if name in _LAYER_HOOKS]
    loaded: set[str | None] = set()
    for i in layer_idx:
        _, e = calls[i]
        after(i, load, "W4", f"{e.method}({e.layer}) before start_load_kv")
        after(finished, i, "W4", f"{e.method}({e.layer}) after get_finished")
        if e.method == "wait_for_layer_load":
            loaded.add(e.layer)
        elif e.layer not in loaded:
            report.add(at(i), "W4", step, None,
                       f"save_kv_layer({e.layer}) without an earlier wait_for_layer_load({e.layer})")
    saves = [i for i, name in enumerate(names) if name == "wait_for_save"]
    if len(saves) > 1:
        report.add(at(saves[1]), "W5", step, None, f"{len(saves)} calls of wait_for_save")
    if saves:
        after(saves[0], load, "W5", "wait_for_save before start_load_kv")
        if layer_idx and saves[0] < layer_idx[-1]:
            report.add(at(saves[0]), "W5", step, None,
                       f"wait_for_save before {names[layer_idx[-1]]}({calls[layer_idx[-1]][1].layer})")
    # NOTE: wait_for_save against get_finished is not ordered by design: no rule either way.


# ---- scheduler ----------------------------------------------------------------------------------


def _check_scheduler(group: list[tuple[int, TraceEvent]], report: _Report) -> None:
    stepless = [(pos, e) for pos, e in group if e.step is None and e.method in _STEP_CALLS]
    if stepless:
        pos, e = stepless[0]
        report.add(pos, "S0", None, None, f"{len(stepless)} call(s) recorded before any "
                   f"trace_step, first {e.method} (does the engine call trace_step?)")
    check = _SchedulerCheck(report)
    for pos, e in group:
        check.event(pos, e)
    check.finish()


# Where a request's obligation was created: (trace position, step).
_Origin = tuple[int, "int | None"]


class _SchedulerCheck:
    """Walks one scheduler connector's records in file order, per step and per request."""

    def __init__(self, report: _Report) -> None:
        self.report = report
        self.builds: dict[int, int] = defaultdict(int)  # step -> build_connector_meta calls
        self.first_pos: dict[int, int] = {}  # step -> trace position of its first record
        self.finished: dict[str, tuple[_Origin, bool | None]] = {}  # req -> its request_finished
        self.reported_late: set[str] = set()  # requests already flagged under S5
        self.pending_send: dict[str, _Origin] = {}  # req -> request_finished that returned True
        self.sent: set[str] = set()
        self.asked_async: dict[str, bool] = {}  # req -> its latest match answer was an async load
        self.pending_recv: dict[str, list[_Origin]] = defaultdict(list)  # req -> loads in flight
        self.recvd: set[str] = set()

    def event(self, pos: int, e: TraceEvent) -> None:
        if e.step is not None:
            self.first_pos.setdefault(e.step, pos)
        if e.method in _REQUEST_CALLS and e.method != "request_finished":
            for late in e.req_ids:
                if late in self.finished and late not in self.reported_late:
                    self.reported_late.add(late)
                    self.report.add(pos, "S5", e.step, late, f"{e.method} after the request's "
                                    f"request_finished in step {self.finished[late][0][1]} "
                                    "(a preemption reported as a finish?)")
        rid = e.req_ids[0] if e.req_ids else None
        if e.method == "build_connector_meta" and e.step is not None:
            self.builds[e.step] += 1
        elif e.method == "get_num_new_matched_tokens" and rid is not None:
            answer = e.result if isinstance(e.result, list) and len(e.result) == 2 else [None, None]
            if answer[0] == 0 and answer[1] is True:
                self.report.add(pos, "S3", e.step, rid,
                                "get_num_new_matched_tokens answered (0, True)")
            self.asked_async[rid] = bool(answer[0] and answer[1])
        elif e.method == "update_state_after_alloc" and rid is not None:
            if e.step is not None and self.builds[e.step]:
                self.report.add(pos, "S2", e.step, rid, "update_state_after_alloc after the "
                                "step's build_connector_meta")
            # NOTE: only an allocation with external tokens after an async answer starts a load;
            # the call after the load completes (0 external tokens) does not.
            if self.asked_async.pop(rid, False) and e.ints and e.ints[0] > 0:
                self.pending_recv[rid].append((pos, e.step))
        elif e.method == "request_finished" and rid is not None:
            self._request_finished(pos, e, rid)
        elif e.method == "update_connector_output":
            for sent in e.finished_sending:
                self._sending(pos, e.step, sent)
            for recvd in e.finished_recving:
                self._recving(pos, e.step, recvd)

    def _request_finished(self, pos: int, e: TraceEvent, rid: str) -> None:
        if rid in self.finished:
            self.report.add(pos, "S4", e.step, rid, "request_finished called again (first in "
                            f"step {self.finished[rid][0][1]})")
            return
        result = e.result if isinstance(e.result, bool) else None
        self.finished[rid] = ((pos, e.step), result)
        if result:
            self.pending_send[rid] = (pos, e.step)

    def _sending(self, pos: int, step: int | None, rid: str) -> None:
        if self.pending_send.pop(rid, None) is not None:
            self.sent.add(rid)
        elif rid in self.sent:
            self.report.add(pos, "S6", step, rid, "duplicate finished_sending")
        elif rid in self.finished and self.finished[rid][1] is False:
            self.report.add(pos, "S6", step, rid,
                            "finished_sending after request_finished returned False")
        else:
            self.report.add(pos, "S6", step, rid,
                            "finished_sending before any request_finished True")

    def _recving(self, pos: int, step: int | None, rid: str) -> None:
        if self.pending_recv.get(rid):
            self.pending_recv[rid].pop(0)
            self.recvd.add(rid)
        else:
            what = "duplicate" if rid in self.recvd else "unexpected"
            self.report.add(pos, "S7", step, rid,
                            f"{what} finished_recving: no async load of the request is pending")

    def finish(self) -> None:
        """End of trace: every step built its metadata once, nothing is left unreported."""
        for step, pos in self.first_pos.items():
            if self.builds[step] != 1:
                self.report.add(pos, "S1", step, None, f"{self.builds[step]} calls of "
                                "build_connector_meta in the step (expected exactly 1)")
        for rid, (pos, origin_step) in self.pending_send.items():
            self.report.add(pos, "S6", origin_step, rid, "request_finished returned True but "
                            "finished_sending never reported the request")
        for rid, loads in self.pending_recv.items():
            for pos, origin_step in loads:
                self.report.add(pos, "S7", origin_step, rid,
                                "async load never reported in finished_recving")
