"""What `kvport trace check` prints, and what its --json writes.

A raw list of violations is hard to act on: one engine bug shows up hundreds of times (once per
step), and a line like "W4 ... before start_load_kv" says nothing of what the step looked like.
So the report groups violations by rule (count, the rule as the applied profile states it, and
why that order asks for it), shows the first few of each with the records around them in their
connector group, and ends with a summary line. Records the checker has no rule for (vLLM's
has_connector_metadata once per layer, stats, events) are left out of that context: they would
crowd out the calls the rule is about.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvport.trace.checker import CHECKED_METHODS, TraceCheck
from kvport.trace.events import LEGACY, TraceEvent
from kvport.trace.findings import Violation
from kvport.trace.profiles import COMMON_WHY, PROFILE_RULES, PROFILES

_RULE_ORDER = {rule: i for i, rule in enumerate(PROFILES[LEGACY].rules)}
_MAX_IDS = 4  # request ids shown on one line before "+N"
_MAX_RESULT = 60  # characters of a result shown on one line


def _ids(ids: list[str]) -> str:
    shown = ",".join(ids[:_MAX_IDS])
    return shown + (f" +{len(ids) - _MAX_IDS}" if len(ids) > _MAX_IDS else "")


def one_line(pos: int, e: TraceEvent, *, marked: bool = False, who: bool = False) -> str:
    """A record in one compact line: position, step, role (and connector and pid if `who`),
    method, then only what it carries: layer, request ids, ints, blocks, finished sets, result."""
    step = "-" if e.step is None else e.step
    actor = f"{e.role} {e.connector} pid {e.pid}" if who else e.role
    parts = [f"{'>' if marked else ' '} #{pos:<5} step {step:<4} {actor} {e.method}"]
    if e.layer is not None:
        parts.append(e.layer)
    if e.req_ids:
        parts.append(f"req {_ids(e.req_ids)}")
    if e.ints:
        parts.append(f"ints {e.ints}")
    if e.num_blocks is not None:
        parts.append(f"blocks {e.num_blocks}")
    if e.finished_sending:
        parts.append(f"sending {_ids(e.finished_sending)}")
    if e.finished_recving:
        parts.append(f"recving {_ids(e.finished_recving)}")
    if e.invalid_block_ids:
        parts.append(f"invalid {e.invalid_block_ids}")
    if e.result is not None:
        text = json.dumps(e.result, separators=(",", ":"), default=str)
        parts.append("-> " + (text if len(text) <= _MAX_RESULT else text[:_MAX_RESULT] + "..."))
    if e.error is not None:
        parts.append(f"!! {e.error}")
    return " ".join(parts)


def counts_by_rule(violations: list[Violation]) -> dict[str, int]:
    counts = Counter(v.rule for v in violations)
    return {rule: counts[rule] for rule in sorted(counts, key=lambda r: _RULE_ORDER.get(r, 99))}


class _Context:
    """The checked records of each connector group, by position, to show a violation's
    neighbours within its own group (other groups' lines are unrelated calls)."""

    def __init__(self, events: list[TraceEvent]) -> None:
        self.events = events
        self.positions: dict[tuple[int, str, str], list[int]] = {}
        for pos, e in enumerate(events):
            if e.method in CHECKED_METHODS:
                self.positions.setdefault(_key(e), []).append(pos)

    def around(self, pos: int, size: int) -> list[str]:
        if not 0 <= pos < len(self.events):
            return []
        mine = self.positions.get(_key(self.events[pos]), [pos])
        i = bisect.bisect_left(mine, pos)
        window = sorted({*mine[max(0, i - size):i + size + 1], pos})
        return [one_line(p, self.events[p], marked=p == pos) for p in window]


def _key(e: TraceEvent) -> tuple[int, str, str]:
    return (e.pid, e.role, e.connector)


def text_report(path: str, events: list[TraceEvent], check: TraceCheck, *, show: int = 3,
                context: int = 3) -> list[str]:
    """The report of one file, as lines."""
    lines = [f"{path}: {len(events)} records, {len(check.groups)} connector group(s)"]
    by_choice: dict[tuple[str, str], list[str]] = {}
    for g in check.groups:
        by_choice.setdefault((g.profile, g.profile_source), []).append(g.label)
    for (profile, source), labels in by_choice.items():
        lines.append(f"  profile {profile} ({source}): {', '.join(labels)}")
    groups = {(g.pid, g.role, g.connector): g for g in check.groups}
    ctx = _Context(events)
    per_rule: dict[str, list[Violation]] = {}
    for v in check.violations:
        per_rule.setdefault(v.rule, []).append(v)
    for rule in counts_by_rule(check.violations):
        found = per_rule[rule]
        lines.append(f"{rule}: {len(found)} violation(s)")
        profiles = sorted({groups[_key(events[v.pos])].profile for v in found
                           if 0 <= v.pos < len(events)} or {LEGACY})
        for name in profiles:
            lines.append(f"  rule ({name}): {PROFILES[name].rules.get(rule, '?')}")
            if rule in PROFILE_RULES:
                lines.append(f"  why ({name}): {PROFILES[name].why[rule]}")
            elif rule in COMMON_WHY:
                lines.append(f"  why: {COMMON_WHY[rule]}")
        for v in found[:show]:
            lines.append(f"  {v}")
            lines.extend("    " + line for line in ctx.around(v.pos, context))
        if len(found) > show:
            lines.append(f"  ... {len(found) - show} more {rule} violation(s) "
                         f"(--show N shows more)")
    lines.extend(f"  note: {note}" for note in check.notes)
    return lines


def summary_line(path: str, num_records: int, violations: list[Violation]) -> str:
    if not violations:
        return f"{path}: ok, {num_records} records, no violations"
    counts = ", ".join(f"{rule} {n}" for rule, n in counts_by_rule(violations).items())
    return f"{path}: {len(violations)} violation(s) in {num_records} records ({counts})"


def json_file_entry(path: str, events: list[TraceEvent], check: TraceCheck) -> dict[str, Any]:
    """One file of the --json document (see cli.py for the whole shape)."""
    return {
        "path": path,
        "num_records": len(events),
        "groups": [{"pid": g.pid, "role": g.role, "connector": g.connector,
                    "profile": g.profile, "profile_source": g.profile_source}
                   for g in check.groups],
        "violations": [{"rule": v.rule, "step": v.step, "req_id": v.req_id,
                        "message": v.message, "pos": v.pos} for v in check.violations],
        "counts_by_rule": counts_by_rule(check.violations),
        "notes": list(check.notes),
    }


def json_document(files: list[Mapping[str, Any]]) -> str:
    total = sum(len(f["violations"]) for f in files)
    return json.dumps({"files": files, "num_violations": total}, indent=1) + "\n"
