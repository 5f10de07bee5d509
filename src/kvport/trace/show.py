"""`kvport trace show TRACE --request ID`: the calls one request went through, both halves.

A call names the request if the request is in its req_ids, its finished_sending or
finished_recving, or (get_finished) in the sending or receiving set it returned.

Order. File order is only the order of calls within one process: the scheduler and a worker may
be different processes whose appends land in the file in whatever order the kernel took them,
and a recorder writes a line after its call returns. Across processes only the step numbers
order calls, and within one step an engine always (1) schedules: the scheduler half's
get_num_new_matched_tokens / update_state_after_alloc / build_connector_meta, (2) runs the step on
the workers, (3) takes the output: request_finished, update_connector_output. So calls are shown
by step, and within a step in those three parts, each part in file order. The scheduler half
announces every step twice (trace_step at schedule() and at the output), so a scheduler record
belongs to part (1) after the step's first marker in its group and to part (3) after a later
one. Calls made before any step was announced (on_new_request of the first requests) come first.
With async scheduling, step N+1 is scheduled before step N's output is taken: this order shows
N's output first, which is the order the request saw its own state change in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvport.trace.events import SCHEDULER, STEP_MARKER, TraceEvent
from kvport.trace.report import one_line

_RANK = {"before steps": 0, "schedule": 0, "worker": 1, "output": 2}
_KNOWN_SHOWN = 8  # known request ids listed when the asked one is not in the trace


class UnknownRequestError(ValueError):
    pass


@dataclass(frozen=True)
class RequestCall:
    pos: int  # index of the record in the trace
    event: TraceEvent
    part: str  # "before steps", "schedule", "worker" or "output" (see the module doc)

    @property
    def sort_key(self) -> tuple[int, int, int]:
        step = -1 if self.event.step is None else self.event.step
        return (step, _RANK[self.part], self.pos)


def named_requests(e: TraceEvent) -> list[str]:
    """The request ids a record names, in the order it names them."""
    ids = [*e.req_ids, *e.finished_sending, *e.finished_recving]
    if e.method == "get_finished" and isinstance(e.result, list):
        for part in e.result:
            if isinstance(part, list):
                ids.extend(str(rid) for rid in part)
    return list(dict.fromkeys(ids))


def known_requests(events: list[TraceEvent]) -> list[str]:
    """Every request id the trace names, in order of first appearance."""
    return list(dict.fromkeys(rid for e in events for rid in named_requests(e)))


def request_calls(events: list[TraceEvent], req_id: str) -> list[RequestCall]:
    markers: Counter[tuple[int, str, str, int]] = Counter()  # scheduler group and step -> markers
    out: list[RequestCall] = []
    for pos, e in enumerate(events):
        key = (e.pid, e.role, e.connector, -1 if e.step is None else e.step)
        if e.role == SCHEDULER and e.method == STEP_MARKER:
            markers[key] += 1
        if req_id not in named_requests(e):
            continue
        if e.step is None:
            part = "before steps"
        elif e.role != SCHEDULER:
            part = "worker"
        else:
            part = "schedule" if markers[key] <= 1 else "output"
        out.append(RequestCall(pos, e, part))
    out.sort(key=lambda call: call.sort_key)
    return out


def format_request(path: str, events: list[TraceEvent], req_id: str) -> list[str]:
    """The lines `kvport trace show` prints; UnknownRequestError if no record names `req_id`."""
    calls = request_calls(events, req_id)
    if not calls:
        known = known_requests(events)
        if not known:
            raise UnknownRequestError(f"request {req_id!r} is not in {path}: no record of it "
                                      "names any request")
        listed = ", ".join(known[:_KNOWN_SHOWN])
        more = f" and {len(known) - _KNOWN_SHOWN} more" if len(known) > _KNOWN_SHOWN else ""
        raise UnknownRequestError(f"request {req_id!r} is not in {path}; it names {listed}"
                                  f"{more}: pass one of those to --request")
    steps = sorted({c.event.step for c in calls if c.event.step is not None})
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
    lines = [f"request {req_id} in {path}: {len(calls)} call(s), {span}",
             ("  order: by step; within a step the scheduler's schedule calls, then the "
              "workers', then the scheduler's output calls; file order within each part")]
    current: object = object()
    for call in calls:
        if call.event.step != current:
            current = call.event.step
            lines.append("before any step" if current is None else f"step {current}")
        lines.append(f"  {call.part:<12} " + one_line(call.pos, call.event, who=True).strip())
    return lines
