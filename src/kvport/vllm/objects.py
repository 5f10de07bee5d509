"""vLLM's objects as kvport's connector views, and the pool facts kvport derives from them.

Duck-typed: nothing here imports vLLM, so the conversions are tested without it. What vLLM
hands a connector and what kvport's connector core reads (kvport.connectors.views):

    vLLM                                        kvport
    Request (request_id, prompt_token_ids,      RequestView (the same, plus the engine's
      num_tokens, num_computed_tokens,            block_size)
      block_hashes)
    KVCacheBlocks.get_block_ids() -> (ids,)     block_ids: list[int] (one KV cache group)
    SchedulerOutput: scheduled_new_reqs with    SchedulerOutputView: new requests (full block
      block_ids per group; scheduled_cached_       table), cached ones (new blocks only);
      reqs as parallel lists, resumed ones         a resumed request counts as new: vLLM
      carrying their whole table; preempted_      sends its whole table, as kvport's engine
      req_ids may be None                          does for a resumed request
    register_kv_caches: {layer name: tensor     EnginePool: one segment per page run, in
      [num_blocks, ...]} (CPU: one layer-major     layer order
      storage; GPU backends may put K and V
      first: [2, num_blocks, ...])
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool

# vLLM hashes blocks with a process-random seed for these algorithms unless PYTHONHASHSEED is
# set: equal prefixes in two processes then get different hashes.
SEEDED_HASH_ALGOS = ("xxhash", "xxhash_cbor")


class RequestAdapter:
    """A vLLM Request, read through kvport's RequestView (attributes are read live: the
    scheduler half keeps the object and reads `block_hashes` as tokens are generated)."""

    __slots__ = ("_request", "block_size")

    def __init__(self, request: Any, block_size: int) -> None:
        self._request = request
        self.block_size = block_size

    @property
    def request_id(self) -> str:
        return str(self._request.request_id)

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self._request.prompt_token_ids or []

    @property
    def num_prompt_tokens(self) -> int:
        return int(self._request.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self._request.num_tokens)

    @property
    def num_computed_tokens(self) -> int:
        return int(self._request.num_computed_tokens)

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self._request.block_hashes


@dataclass
class NewRequest:
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequest:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutputAdapter:
    """A vLLM SchedulerOutput as kvport's SchedulerOutputView (converted once per step)."""

    scheduled_new_reqs: list[NewRequest]
    scheduled_cached_reqs: list[CachedRequest]
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    step: int
    # a request of this step loads external tokens synchronously (vLLM 0.32 names it so too)
    has_sync_kv_loads: bool = False
    kv_connector_metadata: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def group0(block_ids: Sequence[Sequence[int]] | None) -> list[int]:
    """The block ids of the one KV cache group (vLLM passes a tuple per group, or None)."""
    if not block_ids:
        return []
    assert len(block_ids) == 1, f"kvport.vllm handles one KV cache group, got {len(block_ids)}"
    return list(block_ids[0])


def adapt_scheduler_output(so: Any, step: int) -> SchedulerOutputAdapter:
    new = [NewRequest(r.req_id, group0(r.block_ids), r.num_computed_tokens)
           for r in so.scheduled_new_reqs]
    cached: list[CachedRequest] = []
    c = so.scheduled_cached_reqs
    resumed = set(getattr(c, "resumed_req_ids", ()) or ())
    for i, rid in enumerate(c.req_ids):
        ids = group0(c.new_block_ids[i])
        if rid in resumed:  # resumed after a preemption: its whole block table
            new.append(NewRequest(rid, ids, c.num_computed_tokens[i]))
        else:
            cached.append(CachedRequest(rid, ids, c.num_computed_tokens[i]))
    return SchedulerOutputAdapter(
        new, cached, dict(so.num_scheduled_tokens), int(so.total_num_scheduled_tokens),
        set(so.preempted_req_ids or ()), set(so.finished_req_ids), step,
        bool(getattr(so, "has_sync_kv_loads", False)))


def engine_pool(kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str],
                num_blocks: int) -> EnginePool:
    """The registered KV caches as kvport's EnginePool, in the KV cache group's layer order.
    A tensor whose first dimension is the block is one segment per layer; one whose first
    dimension is K/V ([2, num_blocks, ...], some GPU backends) is two."""
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise ValueError(f"kvport.vllm: register_kv_caches lacks layers {missing[:3]} of the KV "
                         f"cache group (got {list(kv_caches)[:3]}...)")
    pages: list[torch.Tensor] = []
    for name in layer_names:
        t = kv_caches[name]
        if t.shape[0] == num_blocks:
            pages.append(t)
        elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            pages += [t[0], t[1]]
        else:
            raise ValueError(f"kvport.vllm: layer {name!r} has a KV cache of shape "
                             f"{tuple(t.shape)}, with the {num_blocks} blocks in neither the "
                             f"first dimension nor the second after K/V; this layout is not "
                             f"supported")
    return EnginePool.from_pages(pages)


def hash_root(identity: str, dtype: str, block_size: int, layout: str, hash_algo: str) -> bytes:
    """kvport's namespace for vLLM's block hashes, which carry neither the model, nor the
    dtype, nor the page layout: a persistent tier keyed by them must. A seeded hash also
    carries its seed (PYTHONHASHSEED)."""
    seed = os.environ.get("PYTHONHASHSEED", "") if hash_algo in SEEDED_HASH_ALGOS else ""
    fields = ["kvport-vllm-v1", identity, dtype, str(block_size), layout, hash_algo, seed]
    return hashlib.sha256("|".join(fields).encode()).digest()


def hashes_are_stable(hash_algo: str) -> bool:
    """Whether vLLM's block hashes are equal across processes for equal prefixes."""
    return hash_algo not in SEEDED_HASH_ALGOS or bool(os.environ.get("PYTHONHASHSEED"))
