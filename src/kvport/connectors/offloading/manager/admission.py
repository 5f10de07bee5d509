"""Admission control: which new keys a tier stores. A strategy of the policy manager
(`PolicyManager(admission=...)`), consulted in prepare_store.

Most prefixes are seen once; storing them evicts blocks that would have been reused.
`AdmitAfterRequests(n)` admits a key only once `n` admitted requests asked the tier for it; the
others come back as `deferred_keys` (nothing happens to them), and a later request with the same
prefix offers them again. `AdmitAll` admits everything (store_threshold 0 or 1).

Counting: `on_request(keys)` is called once per admission of a request (the manager's
`count_admission`, from the connector's update_state_after_alloc), never per lookup: the
engine may ask about the same waiting request several times before it is admitted, and one
retried request must not admit its own blocks. Every distinct key of the call counts once, hits
and misses alike. Counters live in a bounded LRU dict of `max_tracked` keys, so a key not asked
for in a long time starts over.

The manager, not the strategy, lets through keys that are already present (so that the call
still names them and they cannot become its own victims) and promotions from a lower tier (hits,
admitted when they were first stored).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

from kvport.connectors.offloading.manager.abstract import BlockKey


class AdmissionPolicy(ABC):
    @abstractmethod
    def on_request(self, keys: Sequence[BlockKey]) -> None:
        """An admitted request asked the tier for these keys (once per admission)."""

    @abstractmethod
    def admits(self, key: BlockKey) -> bool:
        """Whether a key that is not in the tier may be stored now."""

    def check(self) -> list[str]:
        """Problems with the strategy's own bookkeeping (for check_integrity)."""
        return []


class AdmitAll(AdmissionPolicy):
    def on_request(self, keys: Sequence[BlockKey]) -> None:
        pass

    def admits(self, key: BlockKey) -> bool:
        return True


class AdmitAfterRequests(AdmissionPolicy):
    """Admit a key once `store_threshold` admitted requests asked for it (0, 1: always)."""

    def __init__(self, store_threshold: int, max_tracked: int = 64000) -> None:
        if isinstance(store_threshold, bool) or not isinstance(store_threshold, int) \
                or store_threshold < 0:
            raise ValueError(f"store_threshold must be an int >= 0, got {store_threshold!r}")
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 1:
            raise ValueError(f"max_tracked must be an int >= 1, got {max_tracked!r}")
        self.store_threshold = store_threshold
        self.max_tracked = max_tracked
        self._num_requests: OrderedDict[BlockKey, int] = OrderedDict()  # key -> count, LRU first

    def num_requests_of(self, key: BlockKey) -> int:
        """How many admitted requests asked for the key (0 once it falls out of the tracker)."""
        return self._num_requests.get(key, 0)

    def on_request(self, keys: Sequence[BlockKey]) -> None:
        for key in dict.fromkeys(keys):
            self._num_requests[key] = self._num_requests.pop(key, 0) + 1
            if len(self._num_requests) > self.max_tracked:
                self._num_requests.popitem(last=False)

    def admits(self, key: BlockKey) -> bool:
        # NOTE: 0 and 1 admit everything, as store_threshold documents (a key being stored by
        # its first request has been asked for once, by that request).
        return self.store_threshold <= 1 or self.num_requests_of(key) >= self.store_threshold

    def check(self) -> list[str]:
        if len(self._num_requests) > self.max_tracked:
            return [(f"admission tracks {len(self._num_requests)} keys > max_tracked "
                     f"{self.max_tracked}")]
        return []


def admission_for(store_threshold: int) -> AdmissionPolicy:
    """The strategy for the `store_threshold` config key (0 and 1 both mean: store always)."""
    return AdmitAfterRequests(store_threshold) if store_threshold >= 2 else AdmitAll()
