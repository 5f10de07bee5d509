"""The records of one engine step: what the scheduler hands the runner (`SchedulerOutput`, with a
`NewRequestData` or `CachedRequestData` per scheduled request) and what the runner answers
(`ModelRunnerOutput`). Plain data, picklable, no tensors: with `worker="process"` they cross a
pipe. The public per-request result of `LLM.generate` is kvport.outputs.RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvport.connectors.base import KVConnectorMetadata, KVConnectorOutput
from kvport.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (full state)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # outputs generated before a preemption
    sampling_params: SamplingParams
    sampling_seed: int  # seeds the request's own generator (the request's seed, or one drawn)
    block_ids: tuple[list[int], ...]  # its block table per KV cache group
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV cache group, the entries added this step
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]  # finished (or aborted) since the previous step
    step: int = 0
    # The connector's scheduler half built it for its worker half; None without a connector.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # A request scheduled in this step loads external tokens synchronously (the worker driver
    # then starts loads before the forward under vLLM 0.32's call order).
    has_sync_kv_loads: bool = False


@dataclass
class ModelRunnerOutput:
    # req_id -> sampled tokens (empty for a prefill chunk that does not reach the end)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    failed_req_ids: dict[str, str] = field(default_factory=dict)  # req_id -> error message
    # The connector's worker half answered the step; None without a connector.
    kv_connector_output: KVConnectorOutput | None = None
