"""Per-process state every trace recorder shares: the pid, one line counter (`seq` numbers all
the lines a process writes, whichever recorder wrote them) and the connector labels handed out.
Reset in a forked child, so its lines carry its own pid and seq."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import ClassVar


class TraceProcess:
    pid: ClassVar[int] = os.getpid()
    seq: ClassVar[Iterator[int]] = itertools.count()
    # (trace path, role, label) -> recorders made so far, to tell same-named instances apart
    labels: ClassVar[dict[tuple[str, str, str], int]] = {}

    @classmethod
    def reset(cls) -> None:
        cls.pid = os.getpid()
        cls.seq = itertools.count()
        cls.labels = {}


os.register_at_fork(after_in_child=TraceProcess.reset)


def unique_label(base: str, path: str, role: str) -> str:
    """`base`, or `base#N` for the N-th recorder of that name on one file and role in this
    process (two children of one class, a second engine on the same file): the checker groups
    records per connector label."""
    key = (os.path.realpath(path), role, base)
    count = TraceProcess.labels.get(key, 0) + 1
    TraceProcess.labels[key] = count
    return base if count == 1 else f"{base}#{count}"
