"""What a request's blocks are, for the rules that judge a connector's claims: `trace_blocks`
records, written by both recorders, read by the claim rules (claim_rules.py).

A claim ("these tokens of the request are in my store") can only be judged against what the
connector was handed: which blocks some request computed while it was attached. Two names per
full block make that judgeable from a trace:

- `hashes`: the engine's own block hash (vLLM's: the chained hash over the block's tokens and
  its extra keys, cache_salt on the first block and the LoRA on every one), shortened to 64 bits
  in hex: what the engine itself calls "the same prefix";
- `contents`: a chained hash of the token ids alone (xxh64 over the parent's and the block's
  tokens), so that a hit on the same tokens under another salt or LoRA is told apart from a hit
  on tokens nobody computed.

With them, each record carries the request's salt as a digest (never the salt: it is a secret
between tenants) and its LoRA name. A recorder writes a request's blocks once, as they become
known, in records of at most MAX_BLOCKS_PER_RECORD blocks (a line stays under the 4 KiB that one
append writes whole):

    {"method": "trace_blocks", "req_ids": ["r1"], "ints": [FIRST_BLOCK, BLOCK_SIZE],
     "result": {"hashes": [...], "contents": [...], "salt": "9f2c...", "lora": null}}
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

BLOCKS_MARKER = "trace_blocks"
MAX_BLOCKS_PER_RECORD = 48
_NO_PARENT = b"\0" * 8


def short_hash(block_hash: Any) -> str:
    """An engine block hash as 16 hex digits: bytes (kvport's, vLLM's) by their first 8 bytes,
    an int (vLLM's converted hashes) by its low 64 bits."""
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash)[:8].hex()
    if isinstance(block_hash, int):
        return (block_hash & (2 ** 64 - 1)).to_bytes(8, "big").hex()
    raw = getattr(block_hash, "hash_value", None)  # older vLLM's BlockHash tuples
    if raw is not None:
        return short_hash(raw)
    return hashlib.sha256(repr(block_hash).encode()).digest()[:8].hex()


def salt_digest(salt: str | None) -> str | None:
    """A cache_salt's stand-in in a trace: equal salts, equal digests; the salt is not in it."""
    if not salt:
        return None
    return hashlib.sha256(b"kvport-trace-salt\0" + salt.encode()).digest()[:8].hex()


@dataclass
class RequestBlocks:
    """A recorder's memory of one request: how many of its blocks it has written, and the
    content chain so far."""

    recorded: int = 0
    contents: list[str] = field(default_factory=list)
    _parent: bytes = _NO_PARENT

    def extend_contents(self, token_ids: Sequence[int], block_size: int, upto: int) -> None:
        """Content hashes of blocks [len(contents), upto)."""
        for j in range(len(self.contents), upto):
            block = token_ids[j * block_size:(j + 1) * block_size]
            digest = xxhash.xxh64(self._parent + b"".join(
                int(t).to_bytes(4, "little", signed=True) for t in block)).digest()
            self._parent = digest
            self.contents.append(digest.hex())


def block_records(req_id: str, state: RequestBlocks, block_hashes: Sequence[Any],
                  token_ids: Sequence[int], block_size: int, salt: str | None,
                  lora: str | None) -> Iterator[dict[str, Any]]:
    """The `trace_blocks` records (their fields) for the blocks of `req_id` not written yet:
    every full block the engine has hashed (at most as many as whole blocks of `token_ids`)."""
    upto = min(len(block_hashes), len(token_ids) // block_size) if block_size > 0 else 0
    if upto <= state.recorded:
        return
    state.extend_contents(token_ids, block_size, upto)
    salt_tag = salt_digest(salt)
    for first in range(state.recorded, upto, MAX_BLOCKS_PER_RECORD):
        end = min(upto, first + MAX_BLOCKS_PER_RECORD)
        yield {"req_ids": [req_id], "ints": [first, block_size],
               "result": {"hashes": [short_hash(h) for h in block_hashes[first:end]],
                          "contents": state.contents[first:end], "salt": salt_tag,
                          "lora": lora}}
    state.recorded = upto


# What a recorder reads off its engine's request: (block hashes, all token ids, cache_salt,
# LoRA name, block size).
Describe = Callable[[Any], tuple[Sequence[Any], Sequence[int], str | None, str | None, int]]


class BlockLog:
    """A recorder's side of `trace_blocks`: the live request objects it was handed (kept until
    the request finishes: its hashes grow as it decodes) and what it wrote of each."""

    def __init__(self, describe: Describe) -> None:
        self._describe = describe
        self._requests: dict[str, Any] = {}
        self._state: dict[str, RequestBlocks] = {}

    def seen(self, req_id: str, request: Any) -> Iterator[dict[str, Any]]:
        """Remember `request`; the records of its blocks not written yet."""
        self._requests[req_id] = request
        yield from self.new_blocks(req_id)

    def new_blocks(self, req_id: str) -> Iterator[dict[str, Any]]:
        """The records of a known request's blocks not written yet (none for an unknown one)."""
        request = self._requests.get(req_id)
        if request is None:
            return
        hashes, tokens, salt, lora, block_size = self._describe(request)
        state = self._state.setdefault(req_id, RequestBlocks())
        yield from block_records(req_id, state, hashes, tokens, block_size, salt, lora)

    def hashes(self, req_id: str) -> Sequence[Any]:
        """A known request's engine block hashes so far (none for an unknown one)."""
        request = self._requests.get(req_id)
        return () if request is None else self._describe(request)[0]

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._state.pop(req_id, None)


@dataclass(frozen=True)
class BlockNames:
    """One request's blocks as the checker reads them from its `trace_blocks` records."""

    block_size: int
    hashes: list[str]
    contents: list[str]
    salt: str | None
    lora: str | None


def read_blocks(names: dict[str, BlockNames], req_id: str, ints: Sequence[int],
                result: Any) -> str | None:
    """Add one `trace_blocks` record to `names` (req_id -> its blocks). Returns what is wrong
    with the record (a gap, another block size, a malformed result), or None."""
    if len(ints) != 2 or not isinstance(result, dict):
        return f"malformed trace_blocks record: ints {list(ints)}, result {result!r}"[:200]
    first, block_size = ints
    hashes, contents = result.get("hashes"), result.get("contents")
    if not isinstance(hashes, list) or not isinstance(contents, list) or \
            len(hashes) != len(contents):
        return "trace_blocks: hashes and contents must be lists of one length"
    known = names.get(req_id)
    if known is None:
        known = BlockNames(block_size, [], [], result.get("salt"), result.get("lora"))
        names[req_id] = known
    if block_size != known.block_size:
        return f"trace_blocks: block size {block_size}, earlier {known.block_size}"
    if first > len(known.hashes):
        return f"trace_blocks: blocks from {first}, only {len(known.hashes)} known"
    del known.hashes[first:], known.contents[first:]  # a resumed request may say them again
    known.hashes.extend(str(h) for h in hashes)
    known.contents.extend(str(c) for c in contents)
    return None
