"""One configuration of `kvport bench multi-turn|long-doc --engine vllm`: a vLLM engine process
(bench.vllm) with the interface of `ConfigRunner` (serving.PhaseRunner), so the workload
benchmark drives both engines with the same loop, phases and equality guard.

The client keeps the workload's conversations (a user's next round is built from the answer vLLM
gave) and sends each phase's prompts as token ids; the engine process runs the closed loop and
times it. Engine processes of all configurations live side by side for the whole run, but only
one of them runs at a time: the others wait for their next phase on a pipe.
"""

from __future__ import annotations

from kvport.bench.common.command import JsonObject
from kvport.bench.vllm.engine import VllmEngineProcess, threads_env
from kvport.bench.workload.serving import RequestRecord, metrics_delta
from kvport.bench.workload.workloads import Prompt, WorkloadState


class VllmConfigRunner:
    """One configuration of a workload benchmark: its vLLM engine process and its copy of the
    workload."""

    def __init__(self, name: str, llm_kwargs: JsonObject, state: WorkloadState,
                 concurrency: int, answer_tokens: int, cold_host: bool = False,
                 python: str | None = None, threads: int | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.name = name
        self.state = state
        self.concurrency = concurrency
        self.answer_tokens = answer_tokens
        self.cold_host = cold_host
        self.records: list[RequestRecord] = []
        self.phase_busy_s: dict[int, float] = {}
        self.busy_s = 0.0
        self.resets_unsupported = 0
        self.engine = VllmEngineProcess(f"config {name}: vLLM engine", llm_kwargs, python,
                                        threads_env(threads))
        self._metrics_start: JsonObject = {}

    @property
    def info(self) -> JsonObject:
        return self.engine.info

    def warm_up(self, prompt: list[int]) -> None:
        self.engine.call({"op": "warm_up", "token_ids": prompt})
        self._metrics_start = self.engine.metrics()

    def run_phase(self, phase: int) -> list[RequestRecord]:
        prompts = {f"{self.name}/p{phase}/s{p.session}/i{p.index}": p
                   for p in self.state.prompts(phase)}
        reply = self.engine.run_phase({rid: list(p.token_ids) for rid, p in prompts.items()},
                                      self.concurrency, self.answer_tokens, self.cold_host)
        if reply["reset"] == "unsupported":
            self.resets_unsupported += 1
        done = []
        for r in reply["records"]:  # in finish order, as the closed loop answered them
            prompt = prompts[r["id"]]
            done.append(self._record(prompt, r))
            self.state.answer(prompt, r["output_token_ids"])
        self.phase_busy_s[phase] = reply["busy_s"]
        self.busy_s += reply["busy_s"]
        self.records.extend(done)
        return done

    def _record(self, prompt: Prompt, r: JsonObject) -> RequestRecord:
        if r["finish_reason"] not in ("length", "stop"):
            raise RuntimeError(f"config {self.name}: request {r['id']} ended with "
                               f"{r['finish_reason']!r}")
        return RequestRecord(
            config=self.name, session=prompt.session, index=prompt.index, phase=prompt.phase,
            prompt_tokens=r["prompt_tokens"], output_tokens=r["output_tokens"],
            ttft_s=r["ttft_s"], e2e_s=r["e2e_s"], num_cached_tokens=r["num_cached_tokens"],
            num_external_tokens=r["num_external_tokens"], num_preemptions=r["num_preemptions"],
            queued_steps=r["queued_steps"], ttft_steps=r["ttft_steps"],
            output_token_ids=r["output_token_ids"])

    def metrics(self) -> JsonObject:
        delta: JsonObject = metrics_delta(self._metrics_start, self.engine.metrics())
        return delta

    def evicted_blocks(self) -> int | None:
        """vLLM 0.32 counts no evictions of its prefix cache: None (the report shows '-')."""
        return None

    def shutdown(self) -> None:
        self.engine.shutdown()
