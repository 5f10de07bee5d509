"""The header every stored value carries (Redis values; the disk tier's run files have their own,
tiers/disk/runs.py, with the same digests), and the check a reader makes before it decodes one.

Header (little endian):

    offset size  field
    0      8     magic b"KVPORTKV"
    8      2     format version (FORMAT_VERSION)
    10     2     header size: HEADER.size (80), or 112 with a MAC
    12     4     reserved, 0
    16     32    namespace digest: sha256 of the namespace bytes (model, dtype, layout, sizes)
    48     16    key digest: blake2b-128 of the key (a value under another key is a miss)
    64     8     payload length in bytes
    72     8     xxh3_64 of the payload
    80     32    (with a MAC key) keyed BLAKE3 of bytes 0-79 and the payload

What a reader concludes (`Verdict`):
    OK            decode it
    OTHER_FORMAT  another format version or header size: a miss, and the value is left alone (a
                  fleet in the middle of an upgrade shares keys; the other version reads it)
    BAD           another namespace or key, a wrong length or checksum: a miss; the tier removes
                  it (it would be found by every lookup and fail every load)
    FORGED        a MAC key is set and the value does not carry a valid MAC (someone who can write
                  keys but does not know the key planted it): a miss; removed, and counted

The xxh3 is not a defense against a writer: anyone can compute it. The MAC is: without the key no
one can make a value that passes it (BLAKE3 in keyed mode; its cost against xxh3's is in
BENCHMARKS.md). With a MAC key the xxh3 is not checked (the MAC covers the payload).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from typing import Any

import xxhash

MAGIC = b"KVPORTKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHI32s16sQQ")  # 80 bytes
MAC_BYTES = 32
# BLAKE3's key derivation contexts: a key from the operator's secret, and the key's public id.
_MAC_CONTEXT = "kvport 2026-12 value MAC key"
_KEY_ID_CONTEXT = "kvport 2026-12 value MAC key id"


class Verdict(enum.Enum):
    OK = "ok"
    OTHER_FORMAT = "other_format"
    BAD = "bad"
    FORGED = "forged"


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _blake3() -> Any:
    try:
        import blake3
    except ImportError as exc:  # only a configured MAC key needs it
        raise ImportError("a MAC key (mac_key_env) needs the blake3 package: pip install "
                          "'kvport[redis]'") from exc
    return blake3.blake3


def derive_mac_key(secret: str) -> bytes:
    """The 32-byte MAC key derived from an operator's secret (any length)."""
    return bytes(_blake3()(secret.encode(), derive_key_context=_MAC_CONTEXT).digest())


def mac_key_id(mac_key: bytes) -> bytes:
    """A public id of a MAC key (8 bytes), part of the namespace: engines with different keys
    use different names, so a value one of them stores is never judged by another's key."""
    return bytes(_blake3()(mac_key, derive_key_context=_KEY_ID_CONTEXT).digest()[:8])


class ValueCodec:
    """Packs and checks the headers of one namespace's values, with a MAC if `mac_key`."""

    def __init__(self, namespace_digest: bytes, mac_key: bytes | None = None) -> None:
        assert len(namespace_digest) == 32, "a sha256 namespace digest"
        assert mac_key is None or len(mac_key) == 32, "a 32-byte MAC key (derive_mac_key)"
        self.namespace_digest = namespace_digest
        self._mac_key = mac_key
        self._hasher = _blake3() if mac_key is not None else None
        self.header_size = HEADER.size + (MAC_BYTES if mac_key is not None else 0)

    @property
    def keyed(self) -> bool:
        return self._mac_key is not None

    def pack_header(self, key: bytes, payload: memoryview | bytes) -> bytes:
        """The header of `payload` under `key` (`header_size` bytes)."""
        fixed = HEADER.pack(MAGIC, FORMAT_VERSION, self.header_size, 0, self.namespace_digest,
                            key_digest(key), len(memoryview(payload).cast("B")),
                            checksum(payload))
        return fixed if self._mac_key is None else fixed + self._mac(fixed, payload)

    def _mac(self, fixed: bytes | memoryview, payload: memoryview | bytes) -> bytes:
        assert self._hasher is not None
        h = self._hasher(key=self._mac_key)
        h.update(fixed)
        h.update(payload)
        return bytes(h.digest())

    def check(self, key: bytes, value: bytes | memoryview, payload_len: int) -> Verdict:
        """What a reader concludes from `value` (header, then payload) found under `key`, for a
        payload of `payload_len` bytes. Never raises for any bytes."""
        raw = memoryview(value).cast("B")
        if len(raw) < HEADER.size:
            return Verdict.BAD
        magic, version, hsize, _, ns, kd, length, xxh = HEADER.unpack_from(raw)
        if magic != MAGIC:
            return Verdict.BAD
        if version != FORMAT_VERSION or hsize not in (HEADER.size, HEADER.size + MAC_BYTES):
            return Verdict.OTHER_FORMAT
        if hsize != self.header_size:  # a value with a MAC where none is kept, or one without
            return Verdict.FORGED if self.keyed else Verdict.OTHER_FORMAT
        if (ns != self.namespace_digest or kd != key_digest(key) or length != payload_len
                or len(raw) != hsize + payload_len):
            return Verdict.BAD
        payload = raw[hsize:]
        if self._mac_key is not None:
            good = hmac.compare_digest(self._mac(raw[:HEADER.size], payload),
                                       bytes(raw[HEADER.size:hsize]))
            return Verdict.OK if good else Verdict.FORGED
        return Verdict.OK if checksum(payload) == xxh else Verdict.BAD
