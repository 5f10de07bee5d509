"""kvport's KV cache events and hit sources in vLLM's types."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvport.connectors.base import KVCacheEvent
from kvport.vllm.compat import require_vllm

require_vllm()

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_events import KVCacheEvent as VllmKVCacheEvent  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

MEDIUMS = {"HOST": "CPU", "DISK": "DISK"}  # kvport medium -> vLLM event medium
# vLLM has no source for a remote store: Redis hits are EXTERNAL_UNSPECIFIED.
HIT_SOURCES = {"HOST": CacheHitSource.HOST, "DISK": CacheHitSource.DISK,
               "REDIS": CacheHitSource.EXTERNAL_UNSPECIFIED}


def vllm_events(events: Iterable[KVCacheEvent], block_size: int) -> list[VllmKVCacheEvent]:
    """kvport's events as vLLM's BlockStored / BlockRemoved (blocks of `block_size` tokens)."""
    out: list[VllmKVCacheEvent] = []
    for e in events:
        medium = MEDIUMS.get(e.medium, e.medium)
        hashes = list(e.block_hashes)
        if e.removed:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium))
        else:
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                   block_size=block_size, lora_id=None, medium=medium,
                                   lora_name=None))
    return out


def hit_sources(by_medium: Mapping[str, int]) -> dict[CacheHitSource, int]:
    """Tokens per kvport medium ("HOST", "DISK", "REDIS") as tokens per vLLM cache hit source."""
    sources: dict[CacheHitSource, int] = {}
    for medium, n in by_medium.items():
        source = HIT_SOURCES.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
        sources[source] = sources.get(source, 0) + n
    return {s: n for s, n in sources.items() if n > 0}
