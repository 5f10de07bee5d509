"""A closed-loop client over kvport's engine core: one configuration, driven a phase at a time.

Within a phase (a round of every user; one long-doc query) at most `concurrency` requests are in
the engine; the next waiting prompt is submitted the moment one finishes, and a user's next round
is only built from its previous answer. The driver times each request from the engine's own
timestamps (`Request.arrival_time` is taken in `add_request`, so TTFT includes queueing inside the
engine, not the client's wait for a free slot), and counts the engine steps each request waited
for its KV blocks and for its first token (deterministic where time is not: they show queueing
and the extra steps of an asynchronous load).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvport.bench.common.command import JsonObject
from kvport.bench.workload.workloads import Prompt, WorkloadState

if TYPE_CHECKING:
    from kvport.engine.llm import LLM
    from kvport.engine.request import Request

# reset_prefix_cache(reset_connector=True) says False while the connector still moves bytes; the
# engine is stepped in between, so this bounds a wait for in-flight stores, not a busy loop.
MAX_RESET_ATTEMPTS = 1000


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as measured; `output_token_ids` serve the equality guard only."""

    config: str
    session: int  # user (multi-turn) or document (long-doc)
    index: int  # round or query
    phase: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    num_cached_tokens: int  # local prefix hits plus tokens a connector loaded
    num_external_tokens: int  # tokens a connector loaded
    num_preemptions: int
    queued_steps: int  # engine steps before the one that first gave it KV blocks
    ttft_steps: int  # engine steps up to and including the one that sampled its first token
    output_token_ids: list[int] = field(repr=False)

    def to_json(self) -> JsonObject:
        out = asdict(self)
        del out["output_token_ids"]
        return out


@dataclass(frozen=True)
class Outcome:
    """One configuration's run of a pass: its requests, the time it ran each phase, and its
    engine's and connector's counters over the run."""

    records: tuple[RequestRecord, ...]
    busy_s: float  # wall time inside run_phase, resets excluded
    phase_busy_s: dict[int, float]  # phase -> wall time inside run_phase
    metrics: JsonObject | None  # LLM.get_metrics() over the run (metrics_delta)
    engine_evicted_blocks: int | None  # None: the engine does not count them (vLLM)
    kv_transfer_config: JsonObject | None  # as the JSON records it (no Redis password)
    ideal: bool
    resets_unsupported: int


# Metrics that are levels or settings, not counters: the run's value is the value at its end.
# (The OffloadingConnector's; a delta of them read 0 slots and a 0-token offload block.)
GAUGES = frozenset({"offload_block_tokens", "num_slots", "occupancy_bytes", "occupancy_blocks"})


def metrics_delta(before: Any, after: Any) -> Any:
    """after - before, leaf by leaf, for nested dicts of numbers (other leaves, and the leaves
    named in GAUGES: the after value)."""
    return _combine(before, after, lambda a, b: b - a, "")


def metrics_sum(first: Any, second: Any) -> Any:
    """first + second, leaf by leaf: the counters of two runs as one (keys of either; gauges and
    other leaves: the second's value where it has one)."""
    return _combine(first, second, lambda a, b: a + b, "", union=True)


def _combine(a: Any, b: Any, op: Callable[[float, float], float], name: str,
             union: bool = False) -> Any:
    if isinstance(b, dict):
        a = a if isinstance(a, dict) else {}
        keys = {**a, **b} if union else b
        return {k: _combine(a.get(k), b.get(k), op, k, union) for k in keys}
    if isinstance(b, (int, float)) and not isinstance(b, bool) \
            and isinstance(a, (int, float)) and not isinstance(a, bool) and name not in GAUGES:
        return op(a, b)
    return a if b is None and union else b


class PhaseRunner(Protocol):
    """What the workload benchmark drives: one configuration's engine, a phase at a time
    (`ConfigRunner` for kvport's engine, `VllmConfigRunner` for a vLLM engine process)."""

    name: str
    records: list[RequestRecord]
    busy_s: float
    phase_busy_s: dict[int, float]
    resets_unsupported: int

    def warm_up(self, prompt: list[int]) -> None: ...

    def run_phase(self, phase: int) -> list[RequestRecord]: ...

    def metrics(self) -> JsonObject: ...

    def evicted_blocks(self) -> int | None: ...

    def shutdown(self) -> None: ...


@dataclass
class _InFlight:
    """A request the driver submitted, and what it saw of it after each engine step."""

    prompt: Prompt
    req: Request
    steps: int = 0
    external: int = 0
    queued_steps: int | None = None
    ttft_steps: int | None = None


class ConfigRunner:
    """Owns one configuration's `LLM` and its copy of the workload's conversations."""

    def __init__(self, name: str, llm: LLM, state: WorkloadState, concurrency: int,
                 answer_tokens: int, cold_host: bool = False) -> None:
        from kvport import SamplingParams

        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.name = name
        self.llm = llm
        self.state = state
        self.concurrency = concurrency
        self.cold_host = cold_host
        # equal lengths across configurations: throughput compares the same work
        self.params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
        self.records: list[RequestRecord] = []
        self.phase_busy_s: dict[int, float] = {}  # phase -> wall time inside run_phase
        self.busy_s = 0.0  # wall time inside run_phase, resets excluded
        self.resets_unsupported = 0
        self._metrics_start = llm.get_metrics()
        self._evicted_start = llm.engine.pool.stats.num_evicted_blocks

    def warm_up(self, prompt: list[int]) -> None:
        """One short untimed request (first-call costs), then forget it in the engine's cache."""
        from kvport import SamplingParams

        self.llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)
        self.llm.reset_prefix_cache()
        self._metrics_start = self.llm.get_metrics()
        self._evicted_start = self.llm.engine.pool.stats.num_evicted_blocks

    def run_phase(self, phase: int) -> list[RequestRecord]:
        from kvport.engine.request import RequestStatus

        engine = self.llm.engine
        if self.cold_host:
            self._drop_host_tier()
        waiting: deque[Prompt] = deque(self.state.prompts(phase))
        in_flight: dict[str, _InFlight] = {}
        done: list[RequestRecord] = []
        start = time.perf_counter()
        while waiting or in_flight:
            while waiting and len(in_flight) < self.concurrency:
                prompt = waiting.popleft()
                rid = f"{self.name}/p{phase}/s{prompt.session}/i{prompt.index}"
                in_flight[rid] = _InFlight(prompt, engine.add_request(
                    rid, list(prompt.token_ids), self.params))
            finished = engine.step()
            for flight in in_flight.values():
                req = flight.req
                flight.steps += 1
                # The engine resets num_external_computed_tokens when a parked request resumes
                # after its async load, so the largest value seen is what the connector loaded.
                flight.external = max(flight.external, req.num_external_computed_tokens)
                if flight.queued_steps is None and req.status != RequestStatus.WAITING:
                    flight.queued_steps = flight.steps - 1
                if flight.ttft_steps is None and req.first_token_time is not None:
                    flight.ttft_steps = flight.steps
            for req in finished:
                flight = in_flight.pop(req.request_id)
                done.append(self._record(flight))
                self.state.answer(flight.prompt, list(req.output_token_ids))
        while engine.has_pending_work():  # stores still in flight are this config's cost
            engine.step()
        elapsed = time.perf_counter() - start
        self.phase_busy_s[phase] = elapsed
        self.busy_s += elapsed
        self.records.extend(done)
        return done

    def _record(self, flight: _InFlight) -> RequestRecord:
        prompt, req = flight.prompt, flight.req
        if (req.status.finish_reason not in ("length", "stop") or req.first_token_time is None
                or req.finished_time is None):
            raise RuntimeError(f"config {self.name}: request {req.request_id} ended with "
                               f"{req.status.name}: {req.error}")
        # both were seen after the step that finished it at the latest
        assert flight.queued_steps is not None and flight.ttft_steps is not None
        return RequestRecord(
            config=self.name, session=prompt.session, index=prompt.index, phase=prompt.phase,
            prompt_tokens=len(prompt.token_ids), output_tokens=len(req.output_token_ids),
            ttft_s=req.first_token_time - req.arrival_time,
            e2e_s=req.finished_time - req.arrival_time,
            num_cached_tokens=req.num_cached_tokens or 0,  # set at admission: an int here
            num_external_tokens=flight.external,
            num_preemptions=req.num_preemptions,
            queued_steps=flight.queued_steps, ttft_steps=flight.ttft_steps,
            output_token_ids=list(req.output_token_ids))

    def _drop_host_tier(self) -> None:
        """Empty the engine's prefix cache and the connector's host tier (the disk tier stays),
        so that every hit of the next phase must come from disk."""
        engine = self.llm.engine
        for _ in range(MAX_RESET_ATTEMPTS):
            while engine.has_pending_work():
                engine.step()
            answer = self.llm.reset_prefix_cache(reset_connector=True)
            if answer is None:  # this connector cannot drop its cache: record it, go on
                self.resets_unsupported += 1
                return
            if answer:
                return
            engine.step()  # False: transfers in flight; let them move on
        raise RuntimeError(f"config {self.name}: the connector refused reset_cache "
                           f"{MAX_RESET_ATTEMPTS} times with no request in flight")

    def metrics(self) -> JsonObject:
        """Connector and cache counters of this configuration's run."""
        return metrics_delta(self._metrics_start, self.llm.get_metrics())

    def evicted_blocks(self) -> int:
        """Cached blocks the engine's pool dropped for reuse during the run (`ideal`: must be 0,
        else some of its prefix hits were not free)."""
        return self.llm.engine.pool.stats.num_evicted_blocks - self._evicted_start

    def shutdown(self) -> None:
        self.llm.shutdown()
