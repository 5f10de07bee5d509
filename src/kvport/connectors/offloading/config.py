"""OffloadingConnector configuration (`kv_connector_extra_config`, vLLM's offloading names) and the
offload-block arithmetic shared by both halves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvport.engine.hashing import BlockHash

EVICTION_POLICIES = ("lru", "arc")
TIER_TYPES = {"disk": {"root_dir", "max_bytes"}}  # type -> accepted keys besides "type"
# Default offload block: the fewest whole engine blocks holding at least this many bytes.
# `kvport bench transfer` measured host copies at 0.8-0.9x of a plain torch copy from 1 MiB up
# (less below), and cold disk loads at 0.48-0.57x of one sequential file for 720 KiB entries
# but 0.6-0.8x from 1 MiB up (BENCHMARKS.md).
TARGET_OFFLOAD_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class DiskTierConfig:
    root_dir: str
    max_bytes: int


@dataclass(frozen=True)
class OffloadingConfig:
    cpu_bytes_to_use: int = 0  # host tier size in bytes (required, > 0)
    block_size: int | None = None  # offload block in tokens; None: about 1 MiB of KV
    eviction_policy: str = "lru"
    store_threshold: int = 0  # store a block only after it was looked up this many times
    secondary_tiers: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_bytes_to_use, int) or self.cpu_bytes_to_use <= 0:
            raise ValueError(f"OffloadingConnector: cpu_bytes_to_use must be a positive number of "
                             f"bytes, got {self.cpu_bytes_to_use!r}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"OffloadingConnector: block_size must be positive, got {self.block_size}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"OffloadingConnector: eviction_policy must be one of "
                             f"{EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if self.store_threshold < 0:
            raise ValueError(f"OffloadingConnector: store_threshold must be >= 0, "
                             f"got {self.store_threshold}")
        self.disk_tiers()  # validates the tier list

    def disk_tiers(self) -> list[DiskTierConfig]:
        out = []
        for i, tier in enumerate(self.secondary_tiers):
            where = f"OffloadingConnector: secondary_tiers[{i}]"
            if not isinstance(tier, dict) or tier.get("type") not in TIER_TYPES:
                raise ValueError(f"{where} must be a dict with 'type' one of {sorted(TIER_TYPES)}, "
                                 f"got {tier!r}")
            accepted = TIER_TYPES[tier["type"]]
            unknown = sorted(set(tier) - accepted - {"type"})
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {unknown}; accepted: {sorted(accepted)}")
            root, max_bytes = tier.get("root_dir"), tier.get("max_bytes")
            if not isinstance(root, str) or not root:
                raise ValueError(f"{where}: root_dir must be a directory path, got {root!r}")
            if not isinstance(max_bytes, int) or max_bytes <= 0:
                raise ValueError(f"{where}: max_bytes must be a positive integer, got {max_bytes!r}")
            out.append(DiskTierConfig(root, max_bytes))
        return out


def block_factor(config: OffloadingConfig, engine_block_size: int, engine_block_bytes: int) -> int:
    """Engine blocks per offload block (f). The configured block_size must be a whole number of
    engine blocks; the default is the smallest f whose offload block holds at least 1 MiB."""
    if config.block_size is None:
        return max(1, -(-TARGET_OFFLOAD_BLOCK_BYTES // engine_block_bytes))
    if config.block_size % engine_block_size:
        raise ValueError(f"OffloadingConnector: block_size={config.block_size} is not a multiple "
                         f"of the engine's block_size={engine_block_size}")
    return config.block_size // engine_block_size


def offload_keys(block_hashes: Sequence[BlockHash], factor: int) -> list[BlockHash]:
    """Keys of the request's full offload blocks: the chained hash of each one's last engine
    block (which identifies the whole prefix up to it)."""
    return list(block_hashes[factor - 1::factor])
