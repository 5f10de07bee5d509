"""The offload manager: which keys one tier holds, in which slots, and which block to evict.

It runs in the scheduler, beside the OffloadingConnector's scheduler half, and never touches KV
bytes: it hands out slot ids (the tier's block ids) and the worker moves the data. Keys are opaque
hashables: in production the 32-byte chained hash of an offload block, in tests small ints.

Primitives (all called by the scheduler):
    lookup(keys)            length of the leading run of keys that are stored and ready; changes
                            nothing and counts nothing (the engine may retry a match)
    count_admission(keys, num_hits)  a request was admitted after asking for these keys, of
                            which num_hits were hits: once per admission, the lookup counters
                            and the admission strategy's per-key counts
    prepare_load(keys)      slot ids of ready keys; pins them against eviction until complete_load
    touch(keys)             marks the keys recently used, keys[0] ends up the most recent
    complete_load(keys)     unpins what prepare_load pinned
    prepare_store(keys)     reserves slots for the admitted keys not yet present, evicting if
                            needed; or returns None and changes nothing when they cannot fit
                            (retry later). bypass_admission=True: promotions of hits from a
                            lower tier, which admission control must not hold back
    complete_store(keys, success)  written blocks become ready; failed ones give their slot back
    take_events()           drains the stored / removed events, oldest first

A block is being written (ref_cnt == -1) from prepare_store until complete_store, then ready with
ref_cnt readers (>= 0). Only ready blocks with ref_cnt == 0 are evicted, and never by the
prepare_store call that names them.

Slot ids 0..N-1 are handed out fresh first; after that freed ids are reused last-freed-first
(LIFO). Eviction happens before allocation within one prepare_store, so a store may reuse the slot
it just evicted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

BlockKey = Hashable  # opaque; production: bytes (32-byte block hash), tests: int


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[BlockKey]  # the caller writes these, in this order ...
    slot_ids: list[int]  # ... into these slots
    evicted_keys: list[BlockKey]  # dropped to make room, in eviction order
    # Not stored this time by choice (admission control); the caller may offer them again later.
    deferred_keys: list[BlockKey] = field(default_factory=list)


@dataclass(frozen=True)
class OffloadingEvent:
    keys: tuple[BlockKey, ...]
    medium: str
    removed: bool  # False: the keys became ready; True: they were dropped


@dataclass
class ManagerCounters:
    num_lookups: int = 0  # admitted requests that asked this tier (count_admission calls)
    num_hit_blocks: int = 0  # their hits
    num_stored_blocks: int = 0  # blocks made ready by complete_store
    num_evicted_blocks: int = 0
    num_failed_blocks: int = 0  # blocks freed by complete_store(success=False)
    num_rejected_stores: int = 0  # prepare_store calls that returned None
    num_deferred_blocks: int = 0  # keys held back by admission control


class OffloadingManager(ABC):
    """The scheduler's view of one tier. See the module docstring for the call protocol."""

    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Called when a request is matched: how many leading keys are stored and ready.
        Counts nothing: a request may be matched several times before it is admitted."""

    @abstractmethod
    def count_admission(self, keys: Sequence[BlockKey], num_hits: int) -> None:
        """Called once per admission of a request, with the keys its match asked for and how
        many of them were hits: the lookup counters and the admission strategy count it."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        """Called before a load: the keys' slot ids. Every key must be ready; each stays pinned
        (never evicted) until the matching complete_load."""

    @abstractmethod
    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        """Called when a load finished (or failed): unpins the keys of one prepare_load."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Called on every hit, offloaded or local: marks the keys recently used so that keys[0]
        ends up the most recent. Unknown keys are ignored."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[BlockKey], *,
                      bypass_admission: bool = False) -> PrepareStoreOutput | None:
        """Called before a store: reserves slots for the keys not yet present (stored or being
        written) that admission control admits (all of them with `bypass_admission`: promotions
        of hits), evicting unpinned ready blocks not named in `keys`. Returns None, changing
        nothing but stats.num_rejected_stores, when they cannot fit; an empty output when
        nothing is new."""

    @abstractmethod
    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        """Called when a store finished: its blocks become ready, or on failure are freed.
        Ready blocks and unknown keys are left alone."""

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]:
        """Called once per scheduler step: the events since the last call, oldest first."""

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether the key is stored or being written."""

    @abstractmethod
    def reset(self) -> bool:
        """Drops every block; refuses (returns False, changes nothing) while any is in use."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raises RuntimeError, with the numbers, if the slot or ref-count accounting is off."""

    @property
    @abstractmethod
    def medium(self) -> str:
        """The tier's medium name, fixed at construction. Every OffloadingEvent the manager
        emits carries it; the scheduler half passes it on as its KVCacheEvents' medium."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Capacity in blocks (slots)."""

    @property
    @abstractmethod
    def num_free_slots(self) -> int:
        """Read by the scheduler half for its occupancy metrics, at any time: slots that hold
        no block, ready or being written (num_blocks minus those). Changes nothing."""

    @property
    @abstractmethod
    def num_pinned(self) -> int:
        """Blocks with a load in flight; 0 when nothing leaked."""

    @property
    @abstractmethod
    def num_being_written(self) -> int:
        """Blocks with a store in flight; 0 when nothing leaked."""

    @property
    @abstractmethod
    def stats(self) -> ManagerCounters:
        """A snapshot of the counters."""
