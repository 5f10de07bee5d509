"""The disk tier's file format: a fixed header, then the payload.

Fields (little endian):

    offset size  field
    0      8     magic b"KVPORTKV"
    8      2     format version (FORMAT_VERSION)
    10     2     header size (HEADER_SIZE = 4096: the fields below, then zeros)
    12     4     reserved, 0
    16     32    namespace digest: sha256 of the namespace bytes (model, dtype, layout, sizes)
    48     16    key digest: blake2b-128 of the key (a renamed or misplaced file is a miss)
    64     8     payload length in bytes
    72     8     xxh3_64 of the payload
    80     4016  zeros
    4096         payload

The header fills a whole page so that the payload starts page-aligned in the file: the kernel
then copies page cache pages to the (aligned) destination whole, measured 1.3x faster per entry
than with an 80-byte header. It costs 4 KiB per entry (1/8 of one 32 KiB engine block, 1/256 of
a 1 MiB offload block).

The Redis tier (tiers/redis_tier.py) stores the same header with header size HEADER.size (80):
a value has no pages to align.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import xxhash

from kvport.connectors.base import KVCacheSpec

MAGIC = b"KVPORTKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHI32s16sQQ")  # the fields; padded with zeros to HEADER_SIZE
HEADER_SIZE = 4096
SUFFIX = ".kvb"


def disk_namespace(root_hash: bytes, spec: KVCacheSpec, offload_block_size: int) -> bytes:
    """The namespace of a disk tier: the engine's hash root (model, dtype, block size, layout)
    plus the pool geometry and offload block size, which fix the payload's byte layout."""
    fields = [root_hash.hex(), spec.dtype, spec.layout, str(spec.block_size), str(spec.num_layers),
              str(spec.num_kv_heads), str(spec.head_dim), str(offload_block_size)]
    return "|".join(["kvport-disk-v1", *fields]).encode()


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(namespace_digest: bytes, key: bytes, payload: memoryview,
                header_size: int = HEADER_SIZE) -> bytes:
    """The header of `payload`, zero-padded to `header_size` (>= HEADER.size; the Redis tier's
    values use HEADER.size: they have no pages to align to)."""
    header = HEADER.pack(MAGIC, FORMAT_VERSION, header_size, 0, namespace_digest, key_digest(key),
                         payload.nbytes, checksum(payload))
    return header + bytes(header_size - HEADER.size)


def header_ok(namespace_digest: bytes, raw: bytes, key: bytes, payload_len: int,
              header_size: int = HEADER_SIZE) -> bool:
    """Whether a header (`header_size` bytes) belongs to this namespace and key and announces
    this payload length (the payload's checksum is checked by the reader)."""
    if len(raw) != header_size:
        return False
    magic, version, hsize, _, ns, kd, length, _ = HEADER.unpack_from(raw)
    return bool(magic == MAGIC and version == FORMAT_VERSION and hsize == header_size
                and ns == namespace_digest and kd == key_digest(key) and length == payload_len)


class DiskLocation:
    """Where a disk tier's entries live: `<root>/<namespace digest hex[:16]>/<key hex[:2]>/<key
    hex>.kvb`. The scheduler half uses it alone, as a read-only view of the directory (the worker's
    DiskTier writes and evicts, so a file's existence is the truth)."""

    def __init__(self, root_dir: str | os.PathLike[str], namespace: bytes) -> None:
        self.namespace_digest = hashlib.sha256(namespace).digest()
        self.dir = Path(root_dir) / self.namespace_digest.hex()[:16]

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}{SUFFIX}"

    def exists(self, key: bytes) -> bool:
        return self.path(key).is_file()
