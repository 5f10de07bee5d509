"""A request as the scheduler sees it: tokens, progress, status and block hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from typing import Any

from kvport.engine.hashing import BlockHash, hash_blocks
from kvport.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # parked until a connector's async load finishes
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        block_size: int,
        hash_root: BlockHash,
        arrival_time: float | None = None,
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        # Tokens whose KV is in the engine's pool (or is being computed by the scheduled step).
        self.num_computed_tokens = 0
        # Prompt tokens not computed by this request: local prefix hits plus connector loads.
        # Set at first admission; None until then.
        self.num_cached_tokens: int | None = None
        self.num_external_computed_tokens = 0  # tokens a KV connector loads for this request
        self.num_preemptions = 0
        # Tokens being sampled by steps in flight (async scheduling): scheduled, not yet known.
        self.num_output_placeholders = 0
        # Outputs of steps before this one are stale (a failed load rewound the request).
        self.discard_outputs_before_step = 0
        self.stop_reason: int | None = None  # the stop token id that finished the request
        self.error: str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.block_size = block_size
        self._hash_root = hash_root
        self.block_hashes: list[BlockHash] = []  # chained hashes of every full block of tokens
        hash_blocks(hash_root, self.all_token_ids, block_size, self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """The request's limits for the KV connector (SamplingParams.extra_args)."""
        return self.sampling_params.kv_transfer_params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]
        hash_blocks(self._hash_root, self.all_token_ids, self.block_size, self.block_hashes)

    def rewind(self, num_good_tokens: int, step: int) -> None:
        """KV from token `num_good_tokens` on is not to be trusted (a load into it failed):
        compute it again. Outputs of steps scheduled before `step` (in flight under async
        scheduling) were computed from bad KV and are dropped."""
        self.num_computed_tokens = min(self.num_computed_tokens, num_good_tokens)
        self.num_cached_tokens = min(self.num_cached_tokens or 0, num_good_tokens)
        self.num_external_computed_tokens = 0
        self.num_output_placeholders = 0
        self.discard_outputs_before_step = step

    def check_stop(self, max_model_len: int) -> bool:
        """Finish the request if its last token ends it. Returns whether it finished."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
