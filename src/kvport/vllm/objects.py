"""vLLM's objects as kvport's connector views, and the pool facts kvport derives from them.

Duck-typed: nothing here imports vLLM, so the conversions are tested without it. What vLLM
hands a connector and what kvport's connector core reads (kvport.connectors.views):

    vLLM                                        kvport
    Request (request_id, prompt_token_ids,      RequestView (the same, plus the engine's
      num_tokens, num_computed_tokens,            block_size)
      block_hashes)
    KVCacheBlocks.get_block_ids() -> (ids,)     block_ids: list[int] (one KV cache group), or
      (a tuple per group)                         a tuple of lists (SupportsHMA: every group)
    SchedulerOutput: scheduled_new_reqs with    SchedulerOutputView: new requests (full block
      block_ids per group; scheduled_cached_       table), cached ones (new blocks only);
      reqs as parallel lists, resumed ones         a resumed request counts as new: vLLM
      carrying their whole table; preempted_      sends its whole table, as kvport's engine
      req_ids may be None                          does for a resumed request
    register_kv_caches: {layer name: tensor     kv_cache (num_blocks, num_layers, 2,
      [num_blocks, heads, block_size, 2C]} (CPU:   block_size, heads, head_dim): a strided view
      one layer-major storage)                     of the same memory (kvport_view)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvport.connectors.views import CachedRequestRecord, NewRequestRecord, SchedulerOutputRecord


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

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._request.all_token_ids

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        return getattr(self._request, "kv_transfer_params", None)

    @property
    def lora_name(self) -> str | None:
        lora = getattr(self._request, "lora_request", None)
        return None if lora is None else lora.name

    @property
    def lora_id(self) -> int | None:
        lora = getattr(self._request, "lora_request", None)
        return None if lora is None else lora.adapter_id

    def block_extra_keys(self, first: int, end: int) -> list[tuple[Any, ...] | None] | None:
        """What vLLM's block hash of engine blocks [first, end) covers besides tokens (LoRA,
        multimodal items, cache_salt: vLLM's own function), as its prefix cache's events say;
        None for a request with none of them."""
        request = self._request
        if (getattr(request, "lora_request", None) is None and not getattr(request, "cache_salt",
                                                                             None)
                and not getattr(request, "mm_features", None)
                and getattr(request, "prompt_embeds", None) is None):
            return None
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        keys, mm_idx = [], 0
        for i in range(first, end):
            extra, mm_idx = generate_block_hash_extra_keys(
                request, i * self.block_size, (i + 1) * self.block_size, mm_idx)
            keys.append(extra)
        return keys


def group0(block_ids: Sequence[Sequence[int]] | None) -> list[int]:
    """The block ids of the one KV cache group (vLLM passes a tuple per group, or None)."""
    if not block_ids:
        return []
    assert len(block_ids) == 1, f"kvport.vllm handles one KV cache group, got {len(block_ids)}"
    return list(block_ids[0])


def tables(block_ids: Sequence[Sequence[int]] | None, num_groups: int,
           ) -> list[int] | tuple[list[int], ...]:
    """What a kvport connector reads: one group's block ids, or with several groups (a
    SupportsHMA connector) a list per group (vLLM passes None for "no new blocks")."""
    if num_groups == 1:
        return group0(block_ids)
    if not block_ids:
        return tuple([] for _ in range(num_groups))
    assert len(block_ids) == num_groups, f"{len(block_ids)} tables for {num_groups} groups"
    return tuple(list(ids) for ids in block_ids)


def adapt_scheduler_output(so: Any, step: int, num_groups: int = 1) -> SchedulerOutputRecord:
    new = [NewRequestRecord(r.req_id, tables(r.block_ids, num_groups),  # type: ignore[arg-type]
                            r.num_computed_tokens)
           for r in so.scheduled_new_reqs]
    cached: list[CachedRequestRecord] = []
    c = so.scheduled_cached_reqs
    resumed = set(getattr(c, "resumed_req_ids", ()) or ())
    for i, rid in enumerate(c.req_ids):
        ids: Any = tables(c.new_block_ids[i], num_groups)
        if rid in resumed:  # resumed after a preemption: its whole block table
            new.append(NewRequestRecord(rid, ids, c.num_computed_tokens[i]))
        else:
            cached.append(CachedRequestRecord(rid, ids, c.num_computed_tokens[i]))
    return SchedulerOutputRecord(
        new, cached, dict(so.num_scheduled_tokens), int(so.total_num_scheduled_tokens),
        set(so.preempted_req_ids or ()), set(so.finished_req_ids), step,
        bool(getattr(so, "has_sync_kv_loads", False)))


def kvport_view(kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str],
                num_blocks: int) -> torch.Tensor:
    """vLLM's registered KV caches as kvport's pool, `(num_blocks, num_layers, 2, block_size,
    heads, head_dim)`, a strided view of the same memory (nothing is copied). Each layer's
    tensor is `[num_blocks, heads, block_size, 2 * head_dim]` (vLLM's CPU backends: a page
    holds K of every token of a head, then its V; for MLA the last dim is the latent,
    head_size + head_size_v with head_size_v 0, and its halves are only kvport's labels:
    pages.py) or `[2, num_blocks, block_size, heads, head_dim]` (K and V first; no vLLM 0.32-0.34
    backend registers it); the layers must lie at one stride in one storage, as vLLM allocates
    them on CPU."""
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise ValueError(f"kvport.vllm: register_kv_caches lacks layers {missing[:3]} of the KV "
                         f"cache group (got {list(kv_caches)[:3]}...)")
    views = [_layer_view(name, kv_caches[name], num_blocks) for name in layer_names]
    first = views[0]
    stride = (views[1].data_ptr() - first.data_ptr()) // first.element_size() if len(views) > 1 \
        else first.numel()
    for i, view in enumerate(views):
        if (view.shape, view.stride(), view.dtype) != (first.shape, first.stride(), first.dtype) \
                or view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or view.data_ptr() != first.data_ptr() + i * stride * first.element_size():
            raise ValueError(f"kvport.vllm: the KV caches of layers {layer_names[0]!r} and "
                             f"{layer_names[i]!r} are not at one stride in one allocation; "
                             f"this layout is not supported")
    shape = (num_blocks, len(views), *first.shape[1:])
    strides = (first.stride(0), stride, *first.stride()[1:])
    return first.as_strided(shape, strides)


def _layer_view(name: str, t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """One layer's cache as (num_blocks, 2, block_size, heads, head_dim)."""
    if t.dim() == 4 and t.shape[0] == num_blocks and t.shape[3] % 2 == 0:
        b, heads, block, two_dim = t.shape
        return t.view(b, heads, 2, block, two_dim // 2).permute(0, 2, 3, 1, 4)
    if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return t.transpose(0, 1)
    raise ValueError(f"kvport.vllm: layer {name!r} has a KV cache of shape {tuple(t.shape)}: "
                     f"neither [{num_blocks}, heads, block_size, 2 * head_dim] nor "
                     f"[2, {num_blocks}, block_size, heads, head_dim]; this layout is not "
                     f"supported")


def layer_indices(layer_names: Sequence[str]) -> dict[str, int]:
    """vLLM's layer names -> kvport's layer index (the KV cache group's order)."""
    return {name: i for i, name in enumerate(layer_names)}


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
