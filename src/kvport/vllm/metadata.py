"""kvport's per-step records in vLLM's metadata classes: what the scheduler half sends the worker
(with the step's facts the worker's ForwardContext needs), and the worker's answer, which vLLM
aggregates over tensor-parallel ranks."""

from __future__ import annotations

from collections.abc import Mapping

from kvport.connectors import base
from kvport.vllm.compat import require_vllm

require_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorMetadata, KVConnectorWorkerMetadata,
)


class VllmMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the kvport connector's metadata for the step, and the step's number
    and scheduled tokens (kvport's ForwardContext)."""

    def __init__(self, inner: base.KVConnectorMetadata, step: int,
                 num_scheduled_tokens: Mapping[str, int]) -> None:
        self.inner = inner
        self.step = step
        self.num_scheduled_tokens = dict(num_scheduled_tokens)


class VllmWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the kvport connector's worker metadata; vLLM aggregates the ranks'
    with aggregate()."""

    def __init__(self, inner: base.KVConnectorWorkerMetadata) -> None:
        self.inner = inner

    def aggregate(self, other: KVConnectorWorkerMetadata) -> VllmWorkerMetadata:
        assert isinstance(other, VllmWorkerMetadata), f"cannot aggregate {other!r}"
        return VllmWorkerMetadata(self.inner.aggregate(other.inner))


def inner_metadata(meta: object) -> base.KVConnectorMetadata:
    if not isinstance(meta, VllmMetadata):
        raise TypeError(f"kvport.vllm: expected kvport's VllmMetadata, got "
                        f"{type(meta).__name__}")
    return meta.inner
