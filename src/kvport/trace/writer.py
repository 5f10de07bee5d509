"""TraceWriter: appends the records of one recorded connector instance to a trace file.

Both call recorders write through it: kvport's (kvport.connectors.recording) and vLLM's
(kvport.vllm.recording). A recorder only decides which calls it records and which fields
(kvport.trace.events.TraceEvent) each record carries; the writer owns the rest:

- `call(method, fn, *args, fields=..., summary=..., **kwargs)` runs `fn` and writes its record
  after it returns (with `result=summary(out)` when a summary is given; its repr if the summary
  fails on a malformed answer) or raises (with `error`, then the exception propagates). What `fn`
  returns or raises reaches the caller unchanged. A record holds seq and pid
  (kvport.trace.process), role, the connector label, the current step, the method, then `fields`.
- A writer given a header precedes the first record it writes in each process with a
  `trace_header` record (step None, result: the TraceHeader), so every (pid, role, connector)
  group the checker sees starts with it, a forked child's included.
- `start_step(step)`: the records that follow carry `step`; a `trace_step` marker line says so.
- `close()`: later records are dropped; calls still run.

Writes: every writer of a run may append to one file, from several processes. Each line is one
os.write on an O_APPEND descriptor, so lines never interleave, and nothing is buffered (a killed
process loses no line).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

from kvport.trace.events import HEADER, ROLES, STEP_MARKER, TraceHeader, encode_line
from kvport.trace.process import TraceProcess, unique_label

# A record as a recorder fills it in: TraceEvent's fields by name, as plain JSON values.
Record = dict[str, Any]

MAX_ERROR_CHARS = 300  # keeps an error line well under the 4 KiB atomic-append size


class TraceWriter:
    def __init__(self, path: str, role: str, name: str, header: TraceHeader | None = None
                 ) -> None:
        """`name`: the connector's label, made unique per file, role and process
        (kvport.trace.process.unique_label). `header`: None writes none (the checker then holds
        the group to the legacy call order)."""
        if role not in ROLES:
            raise ValueError(f"trace role must be one of {ROLES}, got {role!r}")
        self.path = path
        self.role = role
        self.label = unique_label(name, path, role)
        self.header = header
        self.step: int | None = None
        self._header_pid: int | None = None  # the process whose records the header already heads
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._close_fd = weakref.finalize(self, os.close, self._fd)

    def fileno(self) -> int:
        """The descriptor records go to; -1 once closed."""
        return self._fd

    def _record(self, method: str) -> Record:
        if self.header is not None and self._header_pid != TraceProcess.pid:
            # The group's first record: written now, so its seq precedes the record's.
            self._header_pid = TraceProcess.pid
            header = self._new(HEADER, None)
            header["result"] = self.header.to_result()
            self._write(header)
        return self._new(method, self.step)

    def start_step(self, step: int) -> None:
        self.step = step
        self._write(self._record(STEP_MARKER))

    def note(self, method: str, fields: Record) -> None:
        """A record that is not a call (a marker such as identity.BLOCKS_MARKER)."""
        rec = self._record(method)
        rec.update(fields)
        self._write(rec)

    def call(self, method: str, fn: Callable[..., Any], /, *args: Any,
             fields: Record | None = None, summary: Callable[[Any], Any] | None = None,
             **kwargs: Any) -> Any:
        rec = self._record(method)  # before the call: its seq orders it among the inner calls'
        if fields:
            rec.update(fields)
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            self._write(rec)
            raise
        if summary is not None:
            try:
                rec["result"] = summary(out)
            except Exception:  # noqa: BLE001  # a malformed answer is the checker's business
                rec["result"] = repr(out)[:MAX_ERROR_CHARS]
        self._write(rec)
        return out

    def close(self) -> None:
        self._fd = -1
        self._close_fd()

    def _new(self, method: str, step: int | None) -> Record:
        return {"seq": next(TraceProcess.seq), "pid": TraceProcess.pid, "role": self.role,
                "connector": self.label, "step": step, "method": method}

    def _write(self, rec: Record) -> None:
        if self._fd < 0:  # closed: the call is still forwarded, just not recorded
            return
        line = encode_line(rec)
        while line:  # a regular-file write is whole in practice; loop in case it is not
            line = line[os.write(self._fd, line):]
