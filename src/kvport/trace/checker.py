"""Check a recorded connector trace against the connector contract.

Records are grouped per connector instance (pid, role, connector label), because the scheduler
half, the worker half and each child of a MultiConnector have their own contract. Each group is
held to one contract profile (profiles.py): the call order its header names, "legacy" without a
header, or the one the caller forces. Worker rules (worker_rules.py) are checked per step,
scheduler rules (scheduler_rules.py) per step and per request, in file order within one group;
the claim rules (claim_rules.py) on scheduler groups, the load rule (loaded.py) on worker groups;
nothing depends on positions across groups, since file order means nothing across processes.

Each violation names a rule id, the step, the request (or None), what went wrong and the
position of the record it is reported at (report.py shows the records around it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvport.trace.claim_rules import check_claims
from kvport.trace.events import (
    HEADER,
    LEGACY,
    SCHEDULER,
    STEP_MARKER,
    TraceEvent,
    TraceHeader,
    read_events,
)
from kvport.trace.findings import Findings, Violation
from kvport.trace.loaded import check_loads
from kvport.trace.profiles import PROFILES, ProfileChoice, choose_profile, get_profile
from kvport.trace.scheduler_rules import REQUEST_CALLS, check_scheduler
from kvport.trace.worker_rules import WORKER_STEP_METHODS, check_worker

__all__ = ["CHECKED_METHODS", "RULES", "WORKER_STEP_METHODS", "GroupCheck", "TraceCheck",
           "Violation", "analyze", "check_file", "check_trace"]

# The legacy profile's rule texts: what `kvport trace check` held every trace to before profiles.
RULES: Mapping[str, str] = PROFILES[LEGACY].rules

# Every method some rule reads (plus markers and headers): the rest is context noise to a reader.
CHECKED_METHODS = frozenset(
    WORKER_STEP_METHODS | REQUEST_CALLS | {"update_connector_output", STEP_MARKER, HEADER})


@dataclass(frozen=True)
class GroupCheck:
    """One connector group of a trace and the profile it was checked under."""

    pid: int
    role: str
    connector: str
    profile: str  # a key of profiles.PROFILES
    profile_source: str  # why: "header: vllm 0.32.0", "no header: legacy", "--profile"

    @property
    def label(self) -> str:
        return f"{self.role} {self.connector} pid {self.pid}"


@dataclass(frozen=True)
class TraceCheck:
    groups: list[GroupCheck]  # in order of their first record
    violations: list[Violation]  # in the order of the records they are reported at
    notes: list[str] = field(default_factory=list)  # what could not be judged, and why


def check_file(path: str, profile: str | None = None) -> list[Violation]:
    return check_trace(read_events(path), profile)


def check_trace(events: Iterable[TraceEvent], profile: str | None = None) -> list[Violation]:
    """All violations, in the order of the trace records that caused them. `profile` forces a
    contract profile on every group (else each group's header chooses, "legacy" without one);
    a malformed header raises profiles.TraceHeaderError (a ValueError)."""
    return analyze(events, profile).violations


def analyze(events: Iterable[TraceEvent], profile: str | None = None) -> TraceCheck:
    if profile is not None:
        get_profile(profile)  # a bad name fails here, even for a trace without records
    groups: dict[tuple[int, str, str], list[tuple[int, TraceEvent]]] = defaultdict(list)
    for pos, event in enumerate(events):
        groups[(event.pid, event.role, event.connector)].append((pos, event))
    checked: list[GroupCheck] = []
    found: list[Violation] = []
    notes: list[str] = []
    for (pid, role, connector), group in groups.items():
        out = Findings(f"{role} {connector} pid {pid}")
        choice: ProfileChoice = choose_profile(group, out.where, profile)
        checked.append(GroupCheck(pid, role, connector, choice.profile.name, choice.source))
        if role == SCHEDULER:
            check_scheduler(group, out)
            notes += check_claims(group, out, _sees_all_stores(group))
        else:
            check_worker(group, out, choice.profile)
            notes += check_loads(group, out)
        found.extend(out.items)
    found.sort(key=lambda v: v.pos)  # stable: one record's violations keep their rule order
    return TraceCheck(checked, found, notes)


def _sees_all_stores(group: list[tuple[int, TraceEvent]]) -> bool:
    """The group's header declares that its connector's store holds only what the trace shows
    being handed to it (a malformed header was reported by choose_profile already)."""
    for _, event in group:
        if event.method == HEADER:
            try:
                return TraceHeader.from_event(event).sees_all_stores
            except (ValueError, TypeError):
                return False
    return False
