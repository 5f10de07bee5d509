"""A contract violation, and the collector the worker and scheduler rules report into."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    rule: str  # a rule id (profiles.PROFILES[...].rules)
    step: int | None
    req_id: str | None
    message: str  # "RULE [role connector pid N] what went wrong"
    # Index of the record the violation is reported at: the offending call, or for a missing
    # call the last call of its step. 0-based over the trace's records (blank lines not counted).
    pos: int = -1

    def __str__(self) -> str:
        step = "-" if self.step is None else self.step
        req = "-" if self.req_id is None else self.req_id
        return f"step {step} request {req}: {self.message}"


class Findings:
    """Violations of one connector group, each kept with the trace position that caused it."""

    def __init__(self, where: str) -> None:
        self.where = where  # "worker ExampleConnector pid 42", put in every message
        self.items: list[Violation] = []

    def add(self, pos: int, rule: str, step: int | None, req_id: str | None, text: str) -> None:
        self.items.append(Violation(rule, step, req_id, f"{rule} [{self.where}] {text}", pos))
