"""One connector call as a trace record, and the JSON-lines file that holds them.

A trace file is shared by every recorder of one engine run: the scheduler half, the worker half
(possibly in another process) and the children of a MultiConnector. Each line is one call, written
with a single append, so lines never interleave. File order is the order of the calls within one
process; `seq` numbers the lines of one process (pid).

The first six fields are always present; the others may be left out when empty (readers fill in
the defaults), which keeps the per-layer records short:

    {"seq": 12, "pid": 4242, "role": "worker", "connector": "ExampleConnector", "step": 3,
     "method": "save_kv_layer", "layer": "layers.0"}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

SCHEDULER = "scheduler"
WORKER = "worker"
ROLES = (SCHEDULER, WORKER)

# The recorder writes a marker line when the engine announces a step (see RecordingConnector).
STEP_MARKER = "trace_step"

# The first record a recorder writes (per process, per connector label): which engine made the
# calls, so the checker applies that engine's contract. `result` holds a TraceHeader as a dict.
HEADER = "trace_header"

# The worker-side call orders an engine may follow (kvport's engine can run each):
# - "legacy": start_load_kv before the forward on every step; wait_for_save only after a forward.
# - "vllm-0.32": start_load_kv before the forward only when the step has synchronous loads, after
#   the forward (after the layer hooks) otherwise; wait_for_save on every step, no-forward
#   steps included. A recorder puts the step's has_sync_kv_loads in start_load_kv's `ints` ([1] or
#   [0]) so the checker can tell which order applies.
# - "vllm-mrv2": vLLM's Model Runner V2 (vllm/v1/worker/gpu/, the GPU runner by default in vLLM
#   0.33, the only one in 0.34): vllm-0.32's order plus finish_forward once per step, after the
#   forward (no-forward steps included), before the deferred start_load_kv and wait_for_save; with
#   a drafter, wait_for_save and clear_connector_metadata wait until the draft model's forward,
#   after build_connector_worker_meta. See trace/profiles.py for the sources.
# These are the only spellings of the names: the engine's config, its worker driver, the checker's
# profiles and both recorders import them from here.
LEGACY = "legacy"
VLLM_0_32 = "vllm-0.32"
VLLM_MRV2 = "vllm-mrv2"
CALL_ORDERS = (LEGACY, VLLM_0_32, VLLM_MRV2)


@dataclass(frozen=True)
class TraceHeader:
    engine: str  # "kvport" or "vllm"
    version: str  # the engine's version, e.g. "0.1.0" or "0.32.0"
    call_order: str  # one of CALL_ORDERS
    # The recorded connector's store started empty and only this engine writes it: whatever it
    # holds, the trace shows being handed to it, so its claims can be judged (claim_rules.py).
    sees_all_stores: bool = False

    def __post_init__(self) -> None:
        if self.call_order not in CALL_ORDERS:
            raise ValueError(f"trace header call_order must be one of {CALL_ORDERS}, "
                             f"got {self.call_order!r}")

    def to_result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.engine, "version": self.version,
                               "call_order": self.call_order}
        if self.sees_all_stores:
            out["sees_all_stores"] = True
        return out

    @classmethod
    def from_event(cls, event: TraceEvent) -> TraceHeader:
        data = event.result
        if event.method != HEADER or not isinstance(data, dict):
            raise ValueError(f"not a trace header record: {event!r}")
        try:
            return cls(str(data["engine"]), str(data["version"]), str(data["call_order"]),
                       data.get("sees_all_stores") is True)
        except KeyError as exc:
            raise ValueError(f"trace header lacks {exc}: {data!r}") from None


@dataclass(slots=True)
class TraceEvent:
    seq: int  # per-process line number, from 0
    pid: int  # process that made the call
    role: str  # "scheduler" or "worker"
    connector: str  # which connector instance: class name, or its configured name
    step: int | None  # engine step announced by trace_step; None before the first one
    method: str  # connector method called (or STEP_MARKER)
    req_ids: list[str] = field(default_factory=list)  # request ids found in the arguments
    ints: list[int] = field(default_factory=list)  # integer arguments, in order
    num_blocks: int | None = None  # length of the block id list argument (all groups')
    group_blocks: list[int] = field(default_factory=list)  # per KV cache group, if several
    layer: str | None = None  # layer name of wait_for_layer_load / save_kv_layer
    result: Any = None  # what the call returned, as plain JSON (see RecordingConnector)
    error: str | None = None  # "TypeName: message" if the call raised
    # update_connector_output: what the worker reported in that output
    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    invalid_block_ids: list[int] = field(default_factory=list)
    # build_connector_meta: per request of req_ids, its tokens computed by the end of the step
    computed: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that carry something: the first six always, the rest if non-empty."""
        out: dict[str, Any] = {}
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            if name in _REQUIRED or (value is not None and value != []):
                out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceEvent:
        missing = [name for name in _REQUIRED if name not in data]
        if missing:
            raise ValueError(f"trace record lacks field(s) {missing}: {data!r}")
        unknown = sorted(set(data) - set(_FIELD_NAMES))
        if unknown:
            raise ValueError(f"trace record has unknown field(s) {unknown}; "
                             f"accepted: {list(_FIELD_NAMES)}")
        if data["role"] not in ROLES:
            raise ValueError(f"trace record role must be one of {ROLES}, got {data['role']!r}")
        step = data["step"]
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise TypeError(f"trace record step must be an integer or null, got {step!r}")
        if not isinstance(data["method"], str):
            raise TypeError(f"trace record method must be a string, got {data['method']!r}")
        return cls(**data)


_FIELD_NAMES = tuple(f.name for f in fields(TraceEvent))
_REQUIRED = ("seq", "pid", "role", "connector", "step", "method")


# One encoder for every line: json.dumps with arguments builds a new encoder per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode_line(record: dict[str, Any]) -> bytes:
    """One record as one newline-terminated line of compact JSON."""
    return (_ENCODER.encode(record) + "\n").encode()


def write_events(path: str, events: Iterable[TraceEvent]) -> None:
    """Write (replace) a whole trace file; the recorder appends line by line instead."""
    with open(path, "wb") as f:
        f.writelines(encode_line(event.to_dict()) for event in events)


def iter_events(path: str) -> Iterator[TraceEvent]:
    """The records of a trace file, in file order. Blank lines are skipped; a line that is not a
    record raises ValueError naming the file and line number."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise TypeError(f"expected a JSON object, got {line.strip()[:80]!r}")
                yield TraceEvent.from_dict(data)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace record: {exc}") from None


def read_events(path: str) -> list[TraceEvent]:
    return list(iter_events(path))
