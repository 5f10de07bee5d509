"""What `LLM.generate` returns (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: top-n logprobs
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: int | None = None  # the stop token id, when one ended the request


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() seconds
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens not computed: local prefix hits + connector loads
    metrics: RequestMetrics
    error: str | None = None
