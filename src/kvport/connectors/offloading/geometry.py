"""The offload geometry: how offload blocks lie over the engine's pool, the host tier's slots and
the disk tier's namespace. Built once per half from (config, KVCacheSpec) by
`OffloadGeometry.build`, so the scheduler half and the worker half cannot disagree about it.

An offload block is `block_factor` (f) engine blocks: `offload_tokens = f * block_size` tokens,
`slot_bytes = f * engine block bytes` in a host slot. Its key is the chained hash of its last
engine block, which identifies the whole prefix up to it (`offload_keys`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvport.connectors.base import KVCacheSpec
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.tiers.disk_format import disk_namespace


@dataclass(frozen=True)
class OffloadGeometry:
    block_size: int  # engine block, tokens
    block_factor: int  # f: engine blocks per offload block
    slot_bytes: int  # one offload block (f engine blocks, every layer, K and V)
    num_slots: int  # host tier capacity, offload blocks
    # the disk and Redis tiers' namespace: model, dtype, layout, sizes, the config's namespace
    disk_namespace: bytes

    @classmethod
    def build(cls, config: OffloadingConfig, spec: KVCacheSpec) -> OffloadGeometry:
        f = block_factor(config, spec.block_size)
        slot_bytes = f * spec.block_bytes
        num_slots = config.cpu_bytes_to_use // slot_bytes
        if num_slots < 1:
            raise ValueError(f"OffloadingConnector: cpu_bytes_to_use={config.cpu_bytes_to_use} is "
                             f"smaller than one offload block ({slot_bytes} bytes)")
        namespace = disk_namespace(spec.hash_root, spec, f * spec.block_size)
        if config.namespace is not None:  # the user's name for what may share entries
            namespace += b"|namespace=" + config.namespace.encode()
        return cls(spec.block_size, f, slot_bytes, num_slots, namespace)

    @property
    def offload_tokens(self) -> int:
        """Tokens per offload block (obs)."""
        return self.block_factor * self.block_size

    def keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        return offload_keys(block_hashes, self.block_factor)


def block_factor(config: OffloadingConfig, engine_block_size: int) -> int:
    """Engine blocks per offload block (f). The default is 1: keys, hits and stores at the
    engine's own granularity, so no token the engine's block could supply is recomputed (a
    request's last full engine block is stored and hit too). Bandwidth does not need bigger
    blocks: a job's blocks move together (consecutive host slots: one gather or scatter). A
    configured block_size must be a whole number of engine blocks."""
    if config.block_size is None:
        return 1
    if config.block_size % engine_block_size:
        raise ValueError(f"OffloadingConnector: block_size={config.block_size} is not a multiple "
                         f"of the engine's block_size={engine_block_size}")
    return config.block_size // engine_block_size


def offload_keys(block_hashes: Sequence[bytes], factor: int) -> list[bytes]:
    """Keys of the request's full offload blocks: the chained hash of each one's last engine
    block (which identifies the whole prefix up to it)."""
    return list(block_hashes[factor - 1::factor])
