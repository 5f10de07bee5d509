"""Search generated workloads for a connector's contract violations, and shrink each one found.

Hypothesis draws workload plans (strategies.py); each is played into the engine session
(driver.py) and checked. A workload that breaks a rule (or stops the engine, or never ends)
fails with an exception of its own per rule, so Hypothesis shrinks it to the shortest workload
that still breaks that rule. The search then goes on, the rules already found set aside, until
the example budget is spent: one run finds and shrinks each distinct rule a connector breaks. A
crash that follows a broken rule is that rule's consequence (the ExampleConnector's load stops
vLLM after it claimed what it never stored): only a crash with no broken rule before it is a
finding of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky

from kvport.conformance.driver import CRASH, HANG, EngineSession, EngineStartError, Outcome
from kvport.conformance.strategies import workload_plans
from kvport.conformance.workload import Workload, WorkloadPlan


@dataclass(frozen=True)
class Finding:
    key: str  # the rule broken (its id), or driver.CRASH / driver.HANG
    workload: Workload  # the shortest one found that does it
    outcome: Outcome  # what that workload did
    flaky: bool = False  # replaying the shrunk workload did not do it again


@dataclass(frozen=True)
class SearchResult:
    examples: int  # workloads played, shrinking included
    clean: int  # of them, those that broke no rule and ran to the end
    seconds: float
    engines: int  # engines started (one, plus one after each crash)
    findings: tuple[Finding, ...]
    preempted: int  # workloads in which vLLM preempted a request
    hit: int  # ... in which the connector claimed tokens
    salted: int  # ... with a cache_salt on some request
    # Rules broken only after earlier workloads on the same engine, never alone: each with the
    # workload that did it (what the connector kept from the earlier ones matters).
    after_others: tuple[Finding, ...] = ()
    lora: int = 0  # workloads with a LoRA adapter on some request

    @property
    def examples_per_minute(self) -> float:
        return 60.0 * self.examples / self.seconds if self.seconds > 0 else 0.0


class Failed(Exception):
    """A workload broke `key`; subclassed per key, so Hypothesis shrinks each key apart."""


_FAILURES: dict[str, type[Failed]] = {}


def _failure(key: str) -> type[Failed]:
    if key not in _FAILURES:
        _FAILURES[key] = type(f"Broke_{key}", (Failed,), {})
    return _FAILURES[key]


def finding_key(outcome: Outcome, set_aside: set[str]) -> str | None:
    """The rule this outcome counts as breaking, the rules found already set aside."""
    if outcome.violations:
        return next((v.rule for v in outcome.violations if v.rule not in set_aside), None)
    key = outcome.key
    return key if key in (CRASH, HANG) and key not in set_aside else None


def breaks(outcome: Outcome, key: str) -> bool:
    """The outcome breaks `key`, whatever else it breaks."""
    if key in (CRASH, HANG):
        return outcome.key == key
    return any(v.rule == key for v in outcome.violations)


class Search:
    def __init__(self, session: EngineSession, *, seed: int = 0, max_requests: int = 6,
                 max_prompt_len: int = 1000, max_shrink_plays: int = 60, loras: int = 0,
                 on_example: Callable[[Workload, Outcome], None] | None = None) -> None:
        self._session = session
        self._seed = seed
        self._max_requests = max_requests
        self._max_prompt_len = max_prompt_len
        self._on_example = on_example
        self._played = self._clean = self._preempted = self._hit = self._salted = 0
        self._loras, self._lora = loras, 0  # adapters the engine has; workloads using one
        self._max_shrink_plays = max_shrink_plays
        self._limit = 0  # run()'s max_examples: shrinking stops there too
        self._last: dict[str, tuple[Workload, Outcome]] = {}
        self._best: dict[str, WorkloadPlan] = {}  # per key, the shortest plan that did it
        self._shrink_plays = -1  # in this round: -1 while generating, then plays since
        self._round_key: str | None = None  # the rule this round found and shrinks
        self._start_error: EngineStartError | None = None
        # Per key, a workload that broke it only after earlier workloads on the same engine
        # (it did not alone): what the connector's store kept from them matters.
        self._history: dict[str, tuple[Workload, Outcome]] = {}

    def _play(self, plan: WorkloadPlan, set_aside: set[str]) -> None:
        if self._start_error is not None:
            raise self._start_error  # Hypothesis's shrinking of it ends at once
        shrinking = self._shrink_plays >= 0
        if shrinking:
            if self._shrink_plays >= self._max_shrink_plays or self._played >= self._limit:
                # Shrink budget spent: only the best plan found still fails, as it did.
                for best_key, best in self._best.items():
                    if best == plan:
                        raise _failure(best_key)(best_key)
                return
            self._shrink_plays += 1
        self._played += 1
        # Each play its own token content: no two workloads on one engine share a prefix.
        workload = plan.materialize(self._seed * 1_000_003 + self._played, self._max_prompt_len)
        # Shrinking plays each get a fresh engine: a shrunk workload does what it does alone,
        # not because of what an earlier one left in the connector's store.
        try:
            outcome = self._session.run(workload, fresh=shrinking)
            shared_key = None if shrinking else finding_key(outcome, set_aside)
            if shared_key is not None:
                # Found on the shared engine: does it do it alone? Only then is it shrunk.
                alone = self._session.run(workload, fresh=True)
                if finding_key(alone, set_aside) is None:
                    self._history.setdefault(shared_key, (workload, outcome))
                outcome = alone
        except EngineStartError as exc:
            self._start_error = exc
            raise
        self._preempted += outcome.preemptions > 0
        self._hit += outcome.hits > 0
        self._salted += any(a.cache_salt for a in workload.arrivals)
        self._lora += any(a.lora for a in workload.arrivals)
        if self._on_example is not None:
            self._on_example(workload, outcome)
        if outcome.key is None:
            self._clean += 1
        # While one rule is shrunk, a workload that breaks only others passes: each rule has
        # a round of its own.
        key = (finding_key(outcome, set_aside) if self._round_key is None
               else self._round_key if breaks(outcome, self._round_key) else None)
        if key is not None:
            self._round_key = key
            self._last[key], self._best[key] = (workload, outcome), plan
            self._shrink_plays = max(self._shrink_plays, 0)
            raise _failure(key)(f"{key}: {workload.summary()}")

    def _round(self, set_aside: set[str], budget: int,
               round_no: int) -> tuple[str | None, bool]:
        """Generate up to `budget` workloads; the key of the first one that fails, shrunk, and
        whether Hypothesis found its shrunk workload flaky (it failed, then not on replay)."""

        @hypothesis_seed(self._seed * 101 + round_no)
        @settings(max_examples=budget, database=None, deadline=None, derandomize=False,
                  phases=(Phase.generate, Phase.shrink), report_multiple_bugs=False,
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(workload_plans(self._max_requests, self._loras))
        def body(plan: WorkloadPlan) -> None:
            self._play(plan, set_aside)

        self._shrink_plays = -1
        self._round_key = None
        flaky = False
        try:
            body()
        except Failed:
            pass
        except Flaky:
            flaky = True
        except EngineStartError:
            if self._start_error is None:
                raise
        if self._start_error is not None:
            raise self._start_error
        return self._round_key, flaky

    def run(self, max_examples: int) -> SearchResult:
        start = time.monotonic()
        self._limit = max_examples
        set_aside: set[str] = set()
        findings: list[Finding] = []
        while self._played < max_examples:
            key, flaky = self._round(set_aside, max_examples - self._played, len(findings))
            if key is None:
                break
            workload, outcome = self._last[key]
            findings.append(Finding(key, workload, outcome, flaky))
            set_aside.add(key)
        return SearchResult(self._played, self._clean, time.monotonic() - start,
                            self._session.engines_started, tuple(findings), self._preempted,
                            self._hit, self._salted,
                            tuple(Finding(k, w, o) for k, (w, o) in self._history.items()
                                  if k not in set_aside), self._lora)
