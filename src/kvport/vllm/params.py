"""A request's kv_transfer_params checked when vLLM admits it, so a bad value fails that request
alone, with a clear error (HTTP 400 from the OpenAI server), before it reaches the engine.

A connector cannot fail one request: vLLM calls it inside the scheduler, where an exception
stops the engine. vLLM does check each request's parameters at admission against the custom
logits processors it was given (`validate_params`), in the front end; `KVTransferParamsCheck`
is such a processor that changes no logits and only checks `kv_transfer_params`
(kvport.connectors.transfer_params). Give it to vLLM with the connector:

    LLM(..., kv_transfer_config=..., logits_processors=[KVTransferParamsCheck])
    python -m kvport.vllm serve MODEL ... \
        --logits-processors kvport.vllm.params:KVTransferParamsCheck

Without it, a request whose parameters kvport cannot read runs with no load and no store (the
connector logs and counts it: num_bad_transfer_params).
"""

from __future__ import annotations

from typing import Any

import torch

from kvport.connectors.transfer_params import TransferLimits
from kvport.vllm.compat import require_vllm

require_vllm()

from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402


class KVTransferParamsCheck(LogitsProcessor):
    """Checks each request's `extra_args["kv_transfer_params"]` at admission; touches no
    logits (argmax invariant, no per-request state)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        extra = getattr(sampling_params, "extra_args", None) or {}
        TransferLimits.parse(extra.get("kv_transfer_params"))

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
