"""Admission control: store a block only once it has been asked for often enough.

Most prefixes are seen once; storing them evicts blocks that would have been reused. An
AdmissionFilter wraps any OffloadingManager and passes a key to prepare_store only after `lookup`
was asked about it `store_threshold` times. The other keys come back as `deferred_keys` (nothing
happens to them); the caller offers them again on a later request with the same prefix.

Counting: every lookup call counts each distinct key of its argument once, hits and misses alike,
including the keys after the first miss (those are the ones a store would add). Counters live in
a bounded LRU dict of `max_tracked` keys, so a key not looked up for a long time starts over.

A key already present in the inner manager always passes, so that the call still names it and it
cannot become the call's own victim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

from kvport.connectors.offloading.manager import (
    BlockKey,
    OffloadingEvent,
    OffloadingManager,
    OffloadingStats,
    PrepareStoreOutput,
)


class AdmissionFilter(OffloadingManager):
    def __init__(self, inner: OffloadingManager, store_threshold: int,
                 max_tracked: int = 64000) -> None:
        if isinstance(store_threshold, bool) or not isinstance(store_threshold, int) \
                or store_threshold < 0:
            raise ValueError(f"store_threshold must be an int >= 0, got {store_threshold!r}")
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 1:
            raise ValueError(f"max_tracked must be an int >= 1, got {max_tracked!r}")
        self.inner = inner
        self.store_threshold = store_threshold
        self.max_tracked = max_tracked
        self._num_seen: OrderedDict[BlockKey, int] = OrderedDict()  # key -> lookups, LRU first
        self._num_deferred = 0

    def num_lookups_of(self, key: BlockKey) -> int:
        """How many lookup calls asked about the key (0 once it falls out of the tracker)."""
        return self._num_seen.get(key, 0)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        if self.store_threshold >= 2:
            for key in dict.fromkeys(keys):
                self._num_seen[key] = self._num_seen.pop(key, 0) + 1
                if len(self._num_seen) > self.max_tracked:
                    self._num_seen.popitem(last=False)
        return self.inner.lookup(keys)

    def prepare_store(self, keys: Sequence[BlockKey]) -> PrepareStoreOutput | None:
        admitted: list[BlockKey] = []
        deferred: list[BlockKey] = []
        for key in dict.fromkeys(keys):
            if (self.store_threshold <= 1 or self.num_lookups_of(key) >= self.store_threshold
                    or self.inner.contains(key)):
                admitted.append(key)
            else:
                deferred.append(key)
        output = self.inner.prepare_store(admitted)
        if output is None:
            return None
        self._num_deferred += len(deferred)
        return replace(output, deferred_keys=output.deferred_keys + deferred)

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        return self.inner.prepare_load(keys)

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        self.inner.complete_load(keys)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.inner.touch(keys)

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        self.inner.complete_store(keys, success)

    def take_events(self) -> list[OffloadingEvent]:
        return self.inner.take_events()

    def contains(self, key: BlockKey) -> bool:
        return self.inner.contains(key)

    def reset(self) -> bool:
        return self.inner.reset()

    def check_integrity(self) -> None:
        self.inner.check_integrity()
        if len(self._num_seen) > self.max_tracked:
            raise RuntimeError(f"AdmissionFilter tracks {len(self._num_seen)} keys > "
                               f"max_tracked {self.max_tracked}")

    @property
    def medium(self) -> str:
        return self.inner.medium

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def num_free_slots(self) -> int:
        return self.inner.num_free_slots

    @property
    def num_pinned(self) -> int:
        return self.inner.num_pinned

    @property
    def num_being_written(self) -> int:
        return self.inner.num_being_written

    @property
    def stats(self) -> OffloadingStats:
        stats = self.inner.stats
        stats.num_deferred_blocks += self._num_deferred
        return stats
