"""Redis tier (worker side): one Redis value per offload block, shared by every engine (and
machine) that reaches the same Redis or Redis Cluster; written through from the host tier.

Value: the header of value_format (magic, format version, header size, sha256 of the namespace,
digest of the key, payload length, xxh3 of the payload, and with a MAC key a keyed BLAKE3 of all
that and the payload), then the payload, the offload block's bytes as the host tier holds them.
Never pickle: a value is read from a server other processes write to. The key is the connector's
`RedisKeyspace.key` (tenant, namespace digest prefix, key hex).

A load GETs its keys in pipelines of at most STORE_BATCH_BYTES of values (one round trip per
server for each), so that a long prompt's promotion holds one batch of replies at a time, not the
whole job. A store asks first which of its keys Redis holds (a pipeline of EXISTS: instances
sharing a Redis compute the same prefixes, and a value it holds is not sent again), then sends
the others' SETs, in pipelines of at most STORE_BATCH_BYTES. Values are built in a buffer each
worker thread reuses: a fresh buffer per job costs more than sending it (the kernel zeroes every
new page). Redis owns eviction (`maxmemory` with an
LRU policy): this tier tracks no occupancy, and a value may vanish between the scheduler's
lookup and the load.

Nothing here raises for a Redis problem; positions fail and are counted instead:
    down (no attempt while backing off)    skipped_down (per call); every position fails
    timeout / connection error             timeouts / errors (per round trip)
    a SET refused (OOM, READONLY, ...)     refused_stores (per block)
    a store of a value Redis holds         already_present (per block; not sent, not failed)
    another error reply (MOVED twice, ...) errors (per block)
    a GET that finds nothing               vanished (per block)
    a value of another format version      other_format (per block); left for its readers
    a bad header, checksum or length       corrupt (per block); the value is deleted
    no valid MAC (a MAC key is set)        forged (per block); the value is deleted
    a key of another type (WRONGTYPE)      wrong_type (per block); the key is deleted
    a MOVED or ASK reply (cluster)         redirects (per block); sent on within the call
`skipped_stores` counts every block not stored, `failures` every block not loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from redis.exceptions import ResponseError

from kvport.connectors.offloading.config import RedisTierConfig
from kvport.connectors.offloading.mediums import HostBlocks, RedisBlocks
from kvport.connectors.offloading.metrics import Counters, RedisTierMetrics
from kvport.connectors.offloading.tiers import DroppedKeys, TransferOutcome
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.tiers.redis.client import (
    TOPOLOGY_ERRORS, RedisConnection, RedisKeyspace, RedisUnavailable,
)
from kvport.connectors.offloading.tiers.value_format import Verdict

logger = logging.getLogger(__name__)

# A store's SETs and a load's GETs go out in pipelines of at most this many value bytes: the bound of the value
# buffer each worker thread keeps (larger jobs take more round trips, not more memory).
STORE_BATCH_BYTES = 64 << 20


class RedisTier:
    """Stores and loads host slots as Redis values under `namespace` (the geometry's) and the
    config's tenant salt."""

    def __init__(self, config: RedisTierConfig, namespace: bytes) -> None:
        self.config = config
        self.keyspace = RedisKeyspace.build(config, namespace)
        self.namespace_digest = self.keyspace.namespace_digest
        self._codec = self.keyspace.codec
        self.stats = Counters(RedisTierMetrics)
        # Found gone by a load (evicted or expired by Redis itself) or deleted as bad.
        self.dropped = DroppedKeys()
        self._conn = RedisConnection(config, timeout_s=config.io_timeout_s, stats=self.stats)
        self._refusing = False  # warn once per run of refused stores, not once per job
        self._buffers = threading.local()  # per worker thread: the values being sent

    def key(self, key: bytes) -> bytes:
        """The Redis key of an offload block's key."""
        return self.keyspace.key(key)

    def close(self) -> None:
        self._conn.close()

    # --- values ---------------------------------------------------------------------------------

    def _values(self, host: HostTier, slots: list[int], keys: list[bytes]) -> list[memoryview]:
        """Each slot as a value (header, then payload: SET takes one contiguous value, so one
        copy of the slot), in this thread's reused buffer: valid until its next call."""
        header_size = self._codec.header_size
        size = header_size + host.slot_bytes
        buf: np.ndarray | None = getattr(self._buffers, "buf", None)
        if buf is None or buf.size < size * len(slots):
            buf = self._buffers.buf = np.empty(size * len(slots), dtype=np.uint8)
        values = []
        for i, (slot, key) in enumerate(zip(slots, keys)):
            value = buf[i * size:(i + 1) * size]
            value[header_size:] = host.slot(slot).numpy()
            # NOTE: the header is made from the copy, not the slot: what is sent is what it
            # describes, whatever happens to the slot meanwhile.
            payload = memoryview(value[header_size:])
            value[:header_size] = np.frombuffer(self._codec.pack_header(key, payload), np.uint8)
            values.append(memoryview(value))
        return values

    def _per_batch(self, host: HostTier) -> int:
        return max(1, STORE_BATCH_BYTES // (self._codec.header_size + host.slot_bytes))

    # --- transfers (run on worker threads) ------------------------------------------------------

    def store_from_host(self, host: HostTier, src: HostBlocks, dst: RedisBlocks,
                        ) -> TransferOutcome:
        """HOST -> REDIS (write-through): slot src.slot_ids[i] is stored as dst.keys[i], unless
        Redis holds that key already."""
        _check_pairs(src.slot_ids, dst.keys)
        if not dst.keys:
            return TransferOutcome(0, [])
        start = time.perf_counter()
        held = self._conn.execute([("EXISTS", self.key(k)) for k in dst.keys])
        unavailable = [i for i, r in enumerate(held) if isinstance(r, RedisUnavailable)]
        present = sum(1 for r in held if isinstance(r, int) and r == 1)
        # Not held, or an error reply (a SET may still work: it is tried and counted).
        todo = [i for i, r in enumerate(held) if not isinstance(r, (int, RedisUnavailable))
                or r == 0]
        per_batch = self._per_batch(host)
        replies: list[Any] = []
        for b in range(0, len(todo), per_batch):
            batch = todo[b:b + per_batch]
            values = self._values(host, [src.slot_ids[i] for i in batch],
                                  [dst.keys[i] for i in batch])
            replies += self._conn.execute([("SET", self.key(dst.keys[i]), v)
                                           for i, v in zip(batch, values)])
        not_set = [i for i, r in zip(todo, replies) if not _stored(r)]
        failed = sorted(unavailable + not_set)
        refused = [r for r in replies
                   if isinstance(r, ResponseError) and not isinstance(r, TOPOLOGY_ERRORS)]
        errors = sum(isinstance(r, TOPOLOGY_ERRORS) for r in replies)
        self._note_refusals(refused)
        done = len(todo) - len(not_set)
        self.stats.add(skipped_stores=len(failed), refused_stores=len(refused), errors=errors,
                       already_present=present, blocks_stored=done,
                       bytes_stored=done * host.slot_bytes,
                       store_seconds=time.perf_counter() - start)
        return TransferOutcome((done + present) * host.slot_bytes, failed)

    def load_to_host(self, host: HostTier, src: RedisBlocks, dst: HostBlocks) -> TransferOutcome:
        """REDIS -> HOST (promotion): value src.keys[i] fills slot dst.slot_ids[i]; GETs in
        batches of at most STORE_BATCH_BYTES of values."""
        _check_pairs(src.keys, dst.slot_ids)
        start = time.perf_counter()
        per_batch = self._per_batch(host)
        failed: list[int] = []
        delete: list[bytes] = []
        counts = dict.fromkeys(("vanished", "corrupt", "forged", "other_format", "wrong_type",
                                "errors"), 0)
        for b in range(0, len(src.keys), per_batch):
            keys = src.keys[b:b + per_batch]
            replies = self._conn.execute([("GET", self.key(k)) for k in keys])
            for j, (k, value) in enumerate(zip(keys, replies)):
                why = self._fill(k, value, host.slot(dst.slot_ids[b + j]))
                if why is None:
                    continue
                failed.append(b + j)
                if why == "vanished":
                    self.dropped.add([k])
                if why in counts:
                    counts[why] += 1
                if why in ("corrupt", "forged", "wrong_type"):
                    delete.append(k)
        if delete:
            self._delete(delete)
        done = len(src.keys) - len(failed)
        self.stats.add(failures=len(failed), blocks_loaded=done,
                       bytes_loaded=done * host.slot_bytes,
                       load_seconds=time.perf_counter() - start, **counts)
        return TransferOutcome(done * host.slot_bytes, failed)

    def _fill(self, key: bytes, value: Any, out: torch.Tensor) -> str | None:
        """Copy a GET's reply into out once its header, length and checksum (or MAC) say it is
        key's value of this namespace (the one copy: from redis-py's bytes into the slot);
        else the counter it goes to (None: filled)."""
        if value is None:
            return "vanished"
        if isinstance(value, RedisUnavailable):
            return "unavailable"
        if isinstance(value, ResponseError):
            return "wrong_type" if str(value).startswith("WRONGTYPE") else "errors"
        if not isinstance(value, bytes):
            return "errors"
        n = out.numel()
        verdict = self._codec.check(key, value, n)
        if verdict is not Verdict.OK:
            return {Verdict.BAD: "corrupt", Verdict.FORGED: "forged",
                    Verdict.OTHER_FORMAT: "other_format"}[verdict]
        out.numpy()[:] = np.frombuffer(value, dtype=np.uint8, count=n,
                                       offset=self._codec.header_size)
        return None

    def _delete(self, keys: list[bytes]) -> None:
        # A later store rewrites it; until then every lookup would find it and every load fail.
        # NOTE: a good value written between our GET and this DEL is deleted too: a later miss.
        logger.warning("Redis tier: %d bad value(s) deleted (first %s)", len(keys),
                       self.key(keys[0]).decode())
        self._conn.execute([("DEL", self.key(k)) for k in keys])
        self.dropped.add(keys)

    def _note_refusals(self, refused: list[Any]) -> None:
        if refused and not self._refusing:
            logger.warning("Redis tier %s refuses stores (%s); blocks are not written through",
                           self._conn.url, refused[0])
        self._refusing = bool(refused)


def _stored(reply: Any) -> bool:
    return reply is True or reply == b"OK"


def _check_pairs(src: list[int] | list[bytes], dst: list[int] | list[bytes]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"source has {len(src)} blocks, destination {len(dst)}")
