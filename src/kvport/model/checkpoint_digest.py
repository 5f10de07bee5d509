"""A cheap content digest of a checkpoint (a directory of weight files, or one file).

What it covers, per file (sorted by relative path; names starting with "." are skipped, as
`.cache/` or `.git/` metadata that changes without the weights changing):

- its relative name and size, always;
- a file of at most WHOLE_BYTES: every byte;
- a bigger one: its first and last SAMPLE_BYTES and NUM_SAMPLES samples of SAMPLE_BYTES at fixed
  offsets spread over the file; a `.safetensors` file also its whole header (tensor names,
  dtypes, shapes, offsets) and the first TENSOR_SAMPLE_BYTES of every tensor (of at most
  MAX_TENSOR_SAMPLES tensors, spread evenly over the header's order).

So a renamed, added, removed or resized file changes the digest, as does any change of a small
file, of a safetensors header, or of a sampled byte. A change elsewhere in a big file (one
weight of a fine-tuned checkpoint whose files keep their sizes, outside the samples) does not:
`mode="full"` hashes every byte for that. The reads are a few dozen MiB per checkpoint
whatever its size, so the digest costs well under a second for a 100 GB checkpoint.

Not a security boundary: whoever can write the weights can keep the sampled bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import xxhash

WHOLE_BYTES = 18 << 20  # files up to this size are hashed whole
SAMPLE_BYTES = 1 << 20  # head, tail and each fixed-offset sample of a bigger file
NUM_SAMPLES = 16
TENSOR_SAMPLE_BYTES = 256  # of each tensor of a safetensors file
MAX_TENSOR_SAMPLES = 4096  # tensors sampled per file
MAX_HEADER_BYTES = 100 << 20  # a safetensors header longer than this is not parsed
MODES = ("sample", "full")
VERSION = "kvport-checkpoint-digest-v1"


def checkpoint_files(path: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of every regular file the digest covers, sorted by name."""
    if path.is_file():
        return [(path.name, path)]
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            full = Path(dirpath) / name
            if full.is_file():  # follows a symlink (Hugging Face snapshots link to blobs)
                out.append((full.relative_to(path).as_posix(), full))
    return sorted(out)


def checkpoint_digest(path: str | os.PathLike[str], mode: str = "sample") -> str:
    """Hex sha256 of the checkpoint's content as the module docstring says; OSError if a file
    cannot be read, ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"checkpoint_digest: mode must be one of {MODES}, got {mode!r}")
    root = Path(path)
    h = hashlib.sha256(f"{VERSION}|{mode}".encode())
    for name, full in checkpoint_files(root):
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"\0{name}\0{size}\0".encode())
            h.update(_file_digest(f.fileno(), size, name, mode))
    return h.hexdigest()


def _file_digest(fd: int, size: int, name: str, mode: str) -> bytes:
    content = xxhash.xxh3_128()
    if mode == "full" or size <= WHOLE_BYTES:
        _hash_range(content, fd, 0, size)
        return content.digest()
    for offset in sample_offsets(size):
        _hash_range(content, fd, offset, SAMPLE_BYTES)
    if name.endswith(".safetensors"):
        _hash_safetensors(content, fd, size)
    return content.digest()


def sample_offsets(size: int) -> list[int]:
    """Offsets of the SAMPLE_BYTES reads of a file bigger than WHOLE_BYTES: head, NUM_SAMPLES
    evenly spaced between, tail."""
    last = size - SAMPLE_BYTES
    return [0, *(last * i // (NUM_SAMPLES + 1) for i in range(1, NUM_SAMPLES + 1)), last]


def _hash_range(content: xxhash.xxh3_128, fd: int, offset: int, length: int) -> None:
    end = offset + length
    while offset < end:
        chunk = os.pread(fd, min(8 << 20, end - offset), offset)
        if not chunk:  # the file shrank while read: what was read is the content
            return
        content.update(chunk)
        offset += len(chunk)


def _hash_safetensors(content: xxhash.xxh3_128, fd: int, size: int) -> None:
    """The header whole, then the head of each sampled tensor. A header that does not parse is
    hashed as read (its bytes, so a changed one still changes the digest)."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return
    (n,) = struct.unpack("<Q", raw)
    if n > min(MAX_HEADER_BYTES, size - 8):
        return  # not a safetensors header: the samples above cover the file
    header = os.pread(fd, n, 8)
    content.update(header)
    try:
        entries = json.loads(header)
        starts = sorted(int(v["data_offsets"][0]) for k, v in entries.items()
                        if k != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return
    if len(starts) > MAX_TENSOR_SAMPLES:
        step = len(starts) / MAX_TENSOR_SAMPLES
        starts = [starts[int(i * step)] for i in range(MAX_TENSOR_SAMPLES)]
    base = 8 + n
    for start in starts:
        content.update(os.pread(fd, TENSOR_SAMPLE_BYTES, base + start))
