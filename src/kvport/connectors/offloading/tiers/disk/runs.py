"""The disk tier's run files: the entries one store job wrote, back to back in one file.

A run file holds n entries of one payload size P (an offload block's bytes, as the host tier
holds them), in the order the job listed them:

    offset      size   field (little endian)
    0           8      magic b"KVPORTRN"
    8           2      run format version (RUN_VERSION)
    10          2      reserved, 0
    12          4      header size H: the fields and records, zero-padded to whole pages
    16          32     namespace digest: sha256 of the namespace (model, dtype, layout, sizes)
    48          8      payload bytes per entry, P
    56          4      number of entries, n
    60          4      reserved, 0
    64          24 n   one record per entry: blake2b-128 of its key, xxh3_64 of its payload
    H + i P     P      payload of entry i

Each entry's key names the file through a hard link (`DiskLocation.path`): a name per key, so
that whether a key is held is one stat of its name (the scheduler's lookup), while the bytes of a
job's keys lie in one extent that a load reads with one `preadv` (cold: large device requests
like one sequential file's; warm: one open for the whole run). A name whose run does not list
its key (a renamed or foreign file) is a miss. The payloads start page-aligned (H is whole pages),
so the kernel copies page-cache pages to the destination whole.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvport.connectors.offloading.tiers.value_format import Verdict, checksum, key_digest

RUN_MAGIC = b"KVPORTRN"
RUN_VERSION = 1
RUN_FIXED = struct.Struct("<8sHHI32sQI4x")  # 64 bytes
RECORD = struct.Struct("<16sQ")  # key digest, payload xxh3
PAGE = 4096
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)


def header_size(num_entries: int) -> int:
    """Bytes before the first payload: the fields and records, rounded up to whole pages."""
    return -(-(RUN_FIXED.size + num_entries * RECORD.size) // PAGE) * PAGE


def run_bytes(num_entries: int, payload_bytes: int) -> int:
    """The size of a run file of `num_entries` entries."""
    return header_size(num_entries) + num_entries * payload_bytes


def pack_run_header(namespace_digest: bytes, keys: Sequence[bytes],
                    payloads: Sequence[memoryview]) -> bytes:
    """The header of a run of `payloads` (equal sizes) under `keys`, padded to whole pages."""
    assert keys and len(keys) == len(payloads), (len(keys), len(payloads))
    size = payloads[0].nbytes
    assert all(p.nbytes == size for p in payloads), "a run's payloads have one size"
    h = header_size(len(keys))
    parts = [RUN_FIXED.pack(RUN_MAGIC, RUN_VERSION, 0, h, namespace_digest, size, len(keys))]
    parts += [RECORD.pack(key_digest(k), checksum(p)) for k, p in zip(keys, payloads)]
    head = b"".join(parts)
    return head + bytes(h - len(head))


@dataclass(frozen=True)
class RunHeader:
    """What a run file's header says: where each key's payload lies and its checksum."""

    header_size: int
    payload_bytes: int
    num_entries: int
    entries: dict[bytes, tuple[int, int]]  # key digest -> (position, payload xxh3)

    def offset(self, position: int) -> int:
        return self.header_size + position * self.payload_bytes


def read_run_header(fd: int, namespace_digest: bytes, payload_bytes: int,
                    file_size: int) -> RunHeader | Verdict:
    """The header of the run file open at fd (`file_size` bytes), or why it cannot be read:
    OTHER_FORMAT for another run format version (a miss, the file left to its readers), BAD if
    it is not a run of this namespace with payloads of `payload_bytes` (a torn, foreign or
    corrupt file). Reads at most the header, which must fit in the file: no count in a damaged
    header makes it read or allocate more. Raises OSError only for a failed read."""
    first = os.pread(fd, PAGE, 0)
    if len(first) < RUN_FIXED.size:
        return Verdict.BAD
    magic, version, _, h, ns, size, n, = RUN_FIXED.unpack_from(first)
    if magic != RUN_MAGIC:
        return Verdict.BAD
    if version != RUN_VERSION:
        return Verdict.OTHER_FORMAT
    if (ns != namespace_digest or size != payload_bytes or n < 1 or h != header_size(n)
            or h > file_size):
        return Verdict.BAD
    raw = first if h == PAGE else first + os.pread(fd, h - PAGE, PAGE)
    if len(raw) != h:
        return Verdict.BAD
    entries = {}
    for i in range(n):
        digest, xxh = RECORD.unpack_from(raw, RUN_FIXED.size + i * RECORD.size)
        entries.setdefault(digest, (i, xxh))
    return RunHeader(h, size, n, entries)


def write_run(fd: int, header: bytes, payloads: Sequence[memoryview]) -> None:
    """Header and payloads at the start of the (empty) file open at fd: writev in batches of at
    most IOV_MAX buffers, partial writes resumed."""
    buffers = [memoryview(header), *(p.cast("B") for p in payloads)]
    while buffers:
        batch, buffers = buffers[:IOV_MAX], buffers[IOV_MAX:]
        while batch:
            n = os.writev(fd, batch)
            while batch and n >= batch[0].nbytes:
                n -= batch.pop(0).nbytes
            if batch:
                batch[0] = batch[0][n:]
