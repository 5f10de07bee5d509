"""Chained block hashes: the identity of a full KV block.

The hash of block i covers the namespace and every token of blocks 0..i, so two requests share the
hash of block i exactly when their first (i + 1) * block_size tokens are equal (and they run the
same model, dtype, block size and KV layout). Hashes are SHA-256 over a fixed byte encoding: the
same on every process and machine (never Python's `hash()`), and collision-resistant, because a
collision would silently serve another prompt's KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvport.config import EngineConfig
from kvport.model.attention import KV_LAYOUT

BlockHash = bytes  # 32-byte digest

HASH_FORMAT_VERSION = "kvport-block-hash-v1"


def namespace_hash(model_identity: str, dtype: str, block_size: int, kv_layout: str) -> BlockHash:
    """Root of every chain: entries of different models, dtypes, block sizes or layouts never mix."""
    text = "|".join([HASH_FORMAT_VERSION, model_identity, dtype, str(block_size), kv_layout])
    return hashlib.sha256(text.encode()).digest()


def engine_hash_root(config: EngineConfig, model_identity: str) -> BlockHash:
    """The engine's root: its model, dtype, block size and pool layout. The scheduler and the
    runner (possibly in another process) each derive it, and must get the same bytes."""
    return namespace_hash(model_identity, config.dtype, config.block_size, KV_LAYOUT)


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (the namespace hash for block 0)."""
    payload = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(parent + payload).digest()


def hash_blocks(
    root: BlockHash, token_ids: Sequence[int], block_size: int, known: list[BlockHash]
) -> list[BlockHash]:
    """Extend `known` (hashes of the leading full blocks) with the hashes of newly full blocks.

    Incremental: only blocks past `len(known)` are hashed. Returns the new hashes.
    """
    new: list[BlockHash] = []
    parent = known[-1] if known else root
    start = len(known) * block_size
    while start + block_size <= len(token_ids):
        parent = hash_block(parent, token_ids[start:start + block_size])
        new.append(parent)
        start += block_size
    known.extend(new)
    return new
