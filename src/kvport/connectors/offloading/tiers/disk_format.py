"""Formats and places of stored KV: the value header, the disk tier's namespace and directory.

The value header (little endian) leads every Redis value (tiers/redis_tier.py):

    offset size  field
    0      8     magic b"KVPORTKV"
    8      2     format version (FORMAT_VERSION)
    10     2     header size (HEADER.size = 80 for a Redis value)
    12     4     reserved, 0
    16     32    namespace digest: sha256 of the namespace bytes (model, dtype, layout, sizes)
    48     16    key digest: blake2b-128 of the key (a value under another key is a miss)
    64     8     payload length in bytes
    72     8     xxh3_64 of the payload

The disk tier keeps a job's entries in one run file (tiers/disk_runs.py), named once per key by
a hard link at `DiskLocation.path(key)`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvport.connectors.base import KVCacheSpec

logger = logging.getLogger("kvport.connectors.offloading.tiers.disk")
MAGIC = b"KVPORTKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHI32s16sQQ")  # the fields; a value's header is exactly these
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"


def disk_namespace(root_hash: bytes, spec: KVCacheSpec, offload_block_size: int) -> bytes:
    """The namespace of a disk tier: the engine's hash root (model, dtype, block size, layout)
    plus the pool geometry and offload block size, which fix the payload's byte layout. v2: run
    files (v1, one file per entry, lives in another directory and is not read)."""
    fields = [root_hash.hex(), spec.dtype, spec.layout, str(spec.block_size), str(spec.num_layers),
              str(spec.num_kv_heads), str(spec.head_dim), str(offload_block_size)]
    return "|".join(["kvport-disk-v2", *fields]).encode()


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(namespace_digest: bytes, key: bytes, payload: memoryview,
                header_size: int = HEADER.size) -> bytes:
    """The header of `payload`, zero-padded to `header_size` (>= HEADER.size)."""
    header = HEADER.pack(MAGIC, FORMAT_VERSION, header_size, 0, namespace_digest, key_digest(key),
                         payload.nbytes, checksum(payload))
    return header + bytes(header_size - HEADER.size)


def header_ok(namespace_digest: bytes, raw: bytes, key: bytes, payload_len: int,
              header_size: int = HEADER.size) -> bool:
    """Whether a header (`header_size` bytes) belongs to this namespace and key and announces
    this payload length (the payload's checksum is checked by the reader)."""
    if len(raw) != header_size:
        return False
    magic, version, hsize, _, ns, kd, length, _ = HEADER.unpack_from(raw)
    return bool(magic == MAGIC and version == FORMAT_VERSION and hsize == header_size
                and ns == namespace_digest and kd == key_digest(key) and length == payload_len)


def check_pairs(src: list[int] | list[bytes], dst: list[int] | list[bytes]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"source has {len(src)} blocks, destination {len(dst)}")


def unlink_quietly(path: str | os.PathLike[str]) -> None:
    """Remove a file; one already gone is fine, any other failure is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("disk tier could not remove %s", path, exc_info=True)


@dataclass(frozen=True)
class ScannedName:
    """A key's name found on disk, and the run file it links to."""

    key: bytes
    inode: int  # the run file's: shared by the names of one run
    size: int
    mtime_ns: int


class DiskLocation:
    """Where a disk tier's entries live: `<root>/<namespace digest hex[:16]>/<key hex[:2]>/<key
    hex>.kvb`, each a hard link to the run file holding the key's entry. The scheduler half uses it
    alone, as a read-only view of the directory (the worker's DiskTier writes and evicts, so a
    name's existence is the truth)."""

    def __init__(self, root_dir: str | os.PathLike[str], namespace: bytes) -> None:
        self.namespace_digest = hashlib.sha256(namespace).digest()
        self.dir = Path(root_dir) / self.namespace_digest.hex()[:16]
        self._dir = str(self.dir)
        self._temps = itertools.count()

    def path(self, key: bytes) -> Path:
        return Path(self.path_str(key))

    def path_str(self, key: bytes) -> str:
        """path(key) as a str: 0.6 us instead of pathlib's 5.7 (a load or store builds one per
        entry)."""
        h = key.hex()
        return f"{self._dir}/{h[:2]}/{h}{SUFFIX}"

    def temp_path_str(self) -> str:
        """A fresh name for a run file being written (this process and thread): it gets its keys'
        names once it is whole, and loses this one then."""
        return (f"{self._dir}/.run.{os.getpid()}.{threading.get_ident()}.{next(self._temps)}"
                f"{TEMP_SUFFIX}")

    def exists(self, key: bytes) -> bool:
        return os.path.isfile(self.path_str(key))

    def scan(self, stale_temp_seconds: float) -> list[ScannedName]:
        """Every key's name under the directory, by name and stat alone (no file is read).
        Temp files older than `stale_temp_seconds` (torn writes of dead processes: live writers
        finish far sooner) are removed."""
        now = time.time()
        found: list[ScannedName] = []
        for entry in os.scandir(self._dir):
            if entry.is_dir(follow_symlinks=False):
                for name in os.scandir(entry.path):
                    _scan_name(name, now, stale_temp_seconds, found)
            else:
                _scan_name(entry, now, stale_temp_seconds, found)
        return found


def _scan_name(entry: os.DirEntry[str], now: float, stale_temp_seconds: float,
               found: list[ScannedName]) -> None:
    try:
        st = entry.stat(follow_symlinks=False)
        if entry.name.endswith(TEMP_SUFFIX):
            if now - st.st_mtime > stale_temp_seconds:
                os.unlink(entry.path)
        elif entry.name.endswith(SUFFIX):
            key = bytes.fromhex(entry.name[:-len(SUFFIX)])
            found.append(ScannedName(key, st.st_ino, st.st_size, st.st_mtime_ns))
    except (OSError, ValueError):
        pass  # removed meanwhile, or a foreign name: not ours
