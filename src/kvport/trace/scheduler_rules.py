"""Scheduler rules S0-S7, G1-G2: one scheduler connector's calls, per step and per request.

Read in file order within one connector group. Nothing depends on positions across requests or
across steps beyond what the rules name (async scheduling interleaves them). These rules hold
under every profile: the scheduler half is called in the same order by every engine kvport knows.
Methods without a rule (vLLM's get_loaded_kv_cache_group_ids, take_events, ...) are skipped.
"""

from __future__ import annotations

from collections import defaultdict

from kvport.trace.events import TraceEvent
from kvport.trace.findings import Findings

# Scheduler calls whose req_ids name requests the scheduler still holds.
REQUEST_CALLS = frozenset({
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
    "build_connector_meta", "request_finished", "request_finished_all_groups",
})
FINISHES = frozenset({"request_finished", "request_finished_all_groups"})
# Calls whose block-table argument is recorded per KV cache group (G1).
_TABLE_CALLS = frozenset({"update_state_after_alloc", *FINISHES})
_STEP_CALLS = frozenset({"build_connector_meta", "update_state_after_alloc"})


def check_scheduler(group: list[tuple[int, TraceEvent]], out: Findings) -> None:
    stepless = [(pos, e) for pos, e in group if e.step is None and e.method in _STEP_CALLS]
    if stepless:
        pos, e = stepless[0]
        out.add(pos, "S0", None, None, f"{len(stepless)} call(s) recorded before any "
                f"trace_step, first {e.method} (does the engine call trace_step?)")
    check = _SchedulerCheck(out)
    for pos, e in group:
        check.event(pos, e)
    check.finish()


# Where a request's obligation was created: (trace position, step).
_Origin = tuple[int, int | None]


class _SchedulerCheck:
    """Walks one scheduler connector's records in file order, per step and per request."""

    def __init__(self, out: Findings) -> None:
        self.out = out
        self.builds: dict[int, int] = defaultdict(int)  # step -> build_connector_meta calls
        self.first_pos: dict[int, int] = {}  # step -> trace position of its first record
        self.finished: dict[str, tuple[_Origin, bool | None]] = {}  # req -> its request_finished
        self.reported_late: set[str] = set()  # requests already flagged under S5
        self.pending_send: dict[str, _Origin] = {}  # req -> request_finished that returned True
        self.sent: set[str] = set()
        self.asked_async: dict[str, bool] = {}  # req -> its latest match answer was an async load
        self.pending_recv: dict[str, list[_Origin]] = defaultdict(list)  # req -> loads in flight
        self.recvd: set[str] = set()
        self.num_groups: tuple[int, int] | None = None  # (groups, where first seen) for G1

    def event(self, pos: int, e: TraceEvent) -> None:
        if e.step is not None:
            self.first_pos.setdefault(e.step, pos)
        if e.method in _TABLE_CALLS:
            self._groups(pos, e)
        if e.method in REQUEST_CALLS and e.method not in FINISHES:
            for late in e.req_ids:
                if late in self.finished and late not in self.reported_late:
                    self.reported_late.add(late)
                    self.out.add(pos, "S5", e.step, late, f"{e.method} after the request's "
                                 f"request_finished in step {self.finished[late][0][1]} "
                                 "(a preemption reported as a finish?)")
        rid = e.req_ids[0] if e.req_ids else None
        if e.method == "build_connector_meta" and e.step is not None:
            self.builds[e.step] += 1
        elif e.method == "get_num_new_matched_tokens" and rid is not None:
            answer = e.result if isinstance(e.result, list) and len(e.result) == 2 else [None, None]
            if answer[0] == 0 and answer[1] is True:
                self.out.add(pos, "S3", e.step, rid,
                             "get_num_new_matched_tokens answered (0, True)")
            elif isinstance(answer[0], int) and answer[0] < 0:
                # vLLM takes the count as tokens to allocate past num_computed_tokens: a negative
                # one shrinks the request's computed prefix and indexes outside its block table.
                self.out.add(pos, "S3", e.step, rid,
                             f"get_num_new_matched_tokens answered {answer[0]} tokens (< 0)")
            self.asked_async[rid] = bool(answer[0] and answer[1])
        elif e.method == "update_state_after_alloc" and rid is not None:
            if e.step is not None and self.builds[e.step]:
                self.out.add(pos, "S2", e.step, rid, "update_state_after_alloc after the "
                             "step's build_connector_meta")
            # NOTE: only an allocation with external tokens after an async answer starts a load;
            # the call after the load completes (0 external tokens) does not.
            if self.asked_async.pop(rid, False) and e.ints and e.ints[0] > 0:
                self.pending_recv[rid].append((pos, e.step))
        elif e.method in FINISHES and rid is not None:
            self._request_finished(pos, e, rid)
        elif e.method == "update_connector_output":
            for sent in e.finished_sending:
                self._sending(pos, e.step, sent)
            for recvd in e.finished_recving:
                self._recving(pos, e.step, recvd)

    def _groups(self, pos: int, e: TraceEvent) -> None:
        """G1, G2: one number of groups per connector; several finish with all groups."""
        rid = e.req_ids[0] if e.req_ids else None
        n = len(e.group_blocks) or 1
        if self.num_groups is None:
            self.num_groups = (n, pos)
        elif n != self.num_groups[0]:
            self.out.add(pos, "G1", e.step, rid, f"{e.method} with {n} KV cache group(s); "
                         f"this connector had {self.num_groups[0]} (record {self.num_groups[1]})")
        if e.method == "request_finished" and self.num_groups[0] > 1:
            self.out.add(pos, "G2", e.step, rid, "request_finished for a request of "
                         f"{self.num_groups[0]} KV cache groups")

    def _request_finished(self, pos: int, e: TraceEvent, rid: str) -> None:
        if rid in self.finished:
            self.out.add(pos, "S4", e.step, rid, "request_finished called again (first in "
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
            self.out.add(pos, "S6", step, rid, "duplicate finished_sending")
        elif rid in self.finished and self.finished[rid][1] is False:
            self.out.add(pos, "S6", step, rid,
                         "finished_sending after request_finished returned False")
        else:
            self.out.add(pos, "S6", step, rid,
                         "finished_sending before any request_finished True")

    def _recving(self, pos: int, step: int | None, rid: str) -> None:
        if self.pending_recv.get(rid):
            self.pending_recv[rid].pop(0)
            self.recvd.add(rid)
        else:
            what = "duplicate" if rid in self.recvd else "unexpected"
            self.out.add(pos, "S7", step, rid,
                         f"{what} finished_recving: no async load of the request is pending")

    def finish(self) -> None:
        """End of trace: every step built its metadata once, nothing is left unreported."""
        for step, pos in self.first_pos.items():
            if self.builds[step] != 1:
                self.out.add(pos, "S1", step, None, f"{self.builds[step]} calls of "
                             "build_connector_meta in the step (expected exactly 1)")
        for rid, (pos, origin_step) in self.pending_send.items():
            self.out.add(pos, "S6", origin_step, rid, "request_finished returned True but "
                         "finished_sending never reported the request")
        for rid, loads in self.pending_recv.items():
            for pos, origin_step in loads:
                self.out.add(pos, "S7", origin_step, rid,
                             "async load never reported in finished_recving")
