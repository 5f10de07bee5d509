"""Where the blocks of one transfer live: one small record per medium (worker side).

A transfer is a pair `(src, dst)` of `LoadStoreSpec`s; the worker routes it by
`(src.medium(), dst.medium())` to the handler registered for that pair. Every spec lists the
blocks of one job in order, and position `i` of `src` pairs with position `i` of `dst` (after
expanding offload blocks into engine blocks, see `EngineBlocks`). The records are plain data
(picklable), so the scheduler half can build them and send them to a worker in another process.

Mediums:
    ENGINE  engine KV pool blocks (`EngineBlocks`), one entry per engine block
    HOST    host-memory slots (`HostBlocks`), one entry per offload block of f engine blocks
    DISK    files of the disk tier (`DiskBlocks`), one entry per offload block, by key
    REDIS   values of the Redis tier (`RedisBlocks`), one entry per offload block, by key
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

ENGINE = "ENGINE"
HOST = "HOST"
DISK = "DISK"
REDIS = "REDIS"


class LoadStoreSpec(ABC):
    """The blocks one side of a transfer reads or writes."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The routing key of this kind of spec (ENGINE, HOST, DISK)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of entries (engine blocks for ENGINE, offload blocks otherwise)."""


@dataclass
class EngineBlocks(LoadStoreSpec):
    """Engine pool blocks, in token order.

    As a store source: `f * n` engine blocks filling n offload blocks, `skip` must be 0.
    As a load destination the first offload block may be only partly wanted: when the engine's own
    prefix hit ends inside offload block 0, its first `skip` engine blocks are already in the pool
    and are not copied, so `len(block_ids) == f * n - skip` with `0 <= skip < f`:

        offload blocks:  |  0: e0 e1 e2 e3  |  1: e0 e1 e2 e3  |      (f = 4, skip = 3)
        copied:                         ^^     ^^ ^^ ^^ ^^
        block_ids:                     [b0,    b1, b2, b3, b4]

    A failed load reports positions in `block_ids` (see `TransferResult.failed_indices`).

    `deadline` (a load destination, worker side only): the `time.monotonic()` after which the
    copy must not start. A synchronous load's parts carry it: a part its step gave up on (its
    blocks recomputed) never writes them later.
    """

    block_ids: list[int]
    skip: int = 0
    deadline: float | None = None

    def __post_init__(self) -> None:
        self.block_ids = [int(b) for b in self.block_ids]
        if self.skip < 0:
            raise ValueError(f"EngineBlocks.skip must be >= 0, got {self.skip}")
        if any(b < 0 for b in self.block_ids):
            raise ValueError(f"EngineBlocks.block_ids must be >= 0, got {self.block_ids}")

    @staticmethod
    def medium() -> str:
        return ENGINE

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class HostBlocks(LoadStoreSpec):
    """Slots of the host tier's preallocated buffer, one per offload block."""

    slot_ids: list[int]

    def __post_init__(self) -> None:
        self.slot_ids = [int(s) for s in self.slot_ids]
        if any(s < 0 for s in self.slot_ids):
            raise ValueError(f"HostBlocks.slot_ids must be >= 0, got {self.slot_ids}")

    @staticmethod
    def medium() -> str:
        return HOST

    def __len__(self) -> int:
        return len(self.slot_ids)


@dataclass
class KeyedBlocks(LoadStoreSpec):
    """Entries of a tier below the host tier, one per offload block, by key (the chained hash of
    the offload block's last engine block)."""

    keys: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = [bytes(k) for k in self.keys]
        if any(not k for k in self.keys):
            raise ValueError(f"{type(self).__name__}.keys must be non-empty bytes")

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class DiskBlocks(KeyedBlocks):
    """Files of the disk tier."""

    @staticmethod
    def medium() -> str:
        return DISK


@dataclass
class RedisBlocks(KeyedBlocks):
    """Values of the Redis tier."""

    @staticmethod
    def medium() -> str:
        return REDIS


KEYED_BLOCKS: dict[str, type[KeyedBlocks]] = {DISK: DiskBlocks, REDIS: RedisBlocks}
