"""Shared pieces of the Redis tier tests that drive RedisTier and RedisLookup directly: keys,
payloads, a filled host tier, store and load calls."""

from __future__ import annotations

import hashlib

import torch

from kvport.connectors.offloading.config import RedisTierConfig
from kvport.connectors.offloading.mediums import HostBlocks, RedisBlocks
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.tiers.redis.lookup import RedisLookup
from kvport.connectors.offloading.tiers.redis.tier import RedisTier

NS = b"kvport-disk-v1|root|float32|layout|16|4|2|32|256"  # a geometry namespace
PAYLOAD = 16384  # bytes per slot: a GET reply is far larger than any EXISTS reply


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int, size: int = PAYLOAD) -> torch.Tensor:
    return torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(i),
                         dtype=torch.uint8)


def filled_host(n: int = 8, slots: int = 32, size: int = PAYLOAD) -> HostTier:
    """A host tier whose slot i holds payload(i) for i < n, the others zeros."""
    host = HostTier(slots, size)
    for i in range(slots):
        host.slot(i).copy_(payload(i, size) if i < n else torch.zeros(size, dtype=torch.uint8))
    return host


def store(tier: RedisTier, host: HostTier, ids: list[int]) -> TransferOutcome:
    return tier.store_from_host(host, HostBlocks(ids), RedisBlocks([key(i) for i in ids]))


def load(tier: RedisTier, host: HostTier, ids: list[int], slots: list[int]) -> TransferOutcome:
    return tier.load_to_host(host, RedisBlocks([key(i) for i in ids]), HostBlocks(slots))


def loaded_exactly(tier: RedisTier, host: HostTier, ids: list[int], slots: list[int]) -> bool:
    """Every value loads, and each slot then holds exactly the payload stored under its key."""
    if load(tier, host, ids, slots).failed_indices:
        return False
    return all(torch.equal(host.slot(s), payload(i, host.slot_bytes))
               for i, s in zip(ids, slots))


def untouched(host: HostTier, slots: list[int]) -> bool:
    return all(not host.slot(s).any() for s in slots)


def tier_and_lookup(cfg: RedisTierConfig, ns: bytes = NS) -> tuple[RedisTier, RedisLookup]:
    return RedisTier(cfg, ns), RedisLookup(cfg, ns)
