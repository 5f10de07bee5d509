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

import errno
import hashlib
import logging
import os
import struct
import threading
import time
from pathlib import Path

import xxhash

from kvport.connectors.base import KVCacheSpec

logger = logging.getLogger("kvport.connectors.offloading.tiers.disk")
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


def entry_problem(namespace_digest: bytes, raw: bytes | bytearray, key: bytes,
                  payload: memoryview, got: int) -> str | None:
    """Why an entry read into (raw header, payload) with `got` bytes is not key's whole, intact
    payload (None: it is)."""
    if not header_ok(namespace_digest, bytes(raw), key, payload.nbytes):
        return "bad header"
    if got != HEADER_SIZE + payload.nbytes:
        return f"{got} bytes, not {HEADER_SIZE + payload.nbytes}"
    if checksum(payload) != HEADER.unpack_from(raw)[7]:
        return "checksum mismatch"
    return None


def write_entry(path: str | os.PathLike[str], header: bytes, payload: memoryview) -> None:
    """Header and payload with one writev, no Python file object (the store's per-entry cost:
    see BENCHMARKS.md "Tier transfers")."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = [memoryview(header), payload.cast("B")]
        while left:
            n = os.writev(fd, left)
            while left and n >= left[0].nbytes:
                n -= left.pop(0).nbytes
            if left:
                left[0] = left[0][n:]
    finally:
        os.close(fd)


def read_entry(fd: int, raw: bytearray, payload: memoryview) -> int:
    """Read header and payload with one preadv (3 syscalls per entry with open and close, which
    is what per-file cost comes down to at small entries)."""
    return os.preadv(fd, [raw, payload], 0)


def read_entry_nowait(fd: int, raw: bytearray, payload: memoryview) -> int | None:
    """read_entry with RWF_NOWAIT: None instead of waiting when the entry is not wholly in the
    page cache. Such a read still starts the kernel's readahead of the entry (measured: 50 ms
    later a cold 724 KiB entry reads whole without waiting), so a first pass of these over a
    job queues every cold entry's I/O at once, with no extra open + POSIX_FADV_WILLNEED.
    OSError(EOPNOTSUPP) where the file system cannot tell."""
    try:
        got = os.preadv(fd, [raw, payload], 0, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            raise OSError(errno.EOPNOTSUPP, "RWF_NOWAIT not supported") from exc
        raise
    # partly cached (or short: the waiting read decides)
    return got if got == HEADER_SIZE + payload.nbytes else None


def scan_entries(directory: Path, stale_temp_seconds: float) -> list[tuple[float, bytes, int]]:
    """(mtime, key, file size) of every entry under a tier's directory, by name and stat alone;
    temp files older than `stale_temp_seconds` (torn writes of dead processes: live writers
    finish far sooner) are removed."""
    now = time.time()
    found: list[tuple[float, bytes, int]] = []
    for sub in directory.iterdir():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            try:
                st = entry.stat()
                if entry.name.endswith(".tmp"):
                    if now - st.st_mtime > stale_temp_seconds:
                        os.unlink(entry.path)
                    continue
                if entry.name.endswith(SUFFIX):
                    found.append((st.st_mtime, bytes.fromhex(entry.name[:-len(SUFFIX)]),
                                  st.st_size))
            except (OSError, ValueError):
                continue  # removed meanwhile, or a foreign name: not ours
    return found


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


class DiskLocation:
    """Where a disk tier's entries live: `<root>/<namespace digest hex[:16]>/<key hex[:2]>/<key
    hex>.kvb`. The scheduler half uses it alone, as a read-only view of the directory (the worker's
    DiskTier writes and evicts, so a file's existence is the truth)."""

    def __init__(self, root_dir: str | os.PathLike[str], namespace: bytes) -> None:
        self.namespace_digest = hashlib.sha256(namespace).digest()
        self.dir = Path(root_dir) / self.namespace_digest.hex()[:16]
        self._dir = str(self.dir)

    def path(self, key: bytes) -> Path:
        return Path(self.path_str(key))

    def path_str(self, key: bytes) -> str:
        """path(key) as a str: 0.6 us instead of pathlib's 5.7 (a transfer builds one per
        entry; a warm 32 KiB entry reads in about 25 us)."""
        h = key.hex()
        return f"{self._dir}/{h[:2]}/{h}{SUFFIX}"

    def temp_path_str(self, key: bytes) -> str:
        """Where a writer of key (this process and thread) writes before renaming."""
        h = key.hex()
        return f"{self._dir}/{h[:2]}/.{h}.{os.getpid()}.{threading.get_ident()}.tmp"

    def exists(self, key: bytes) -> bool:
        return os.path.isfile(self.path_str(key))
