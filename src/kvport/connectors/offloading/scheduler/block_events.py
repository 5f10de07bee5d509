"""The KV cache events of every tier, self-describing: what a router needs to index a block.

A tier's manager (host) and the workers' reports (disk, Redis) name offload keys; a router knows
the engine's block hashes and tokens. So when a store or a promotion is planned, while the
request is alive, each key is described: its engine blocks' chained hashes, the hash before
them, its group, and (until the key's tiers have said it is stored) its tokens, LoRA and extra
keys. Tier events then become `KVCacheEvent`s in the engine's terms:

    stored   a tier holds the key and a hit can use it (host: copy done; disk, Redis: written,
             or found there already); one event per run of consecutive blocks, like an
             engine's own prefix cache reports a step's new blocks
    removed  a tier no longer holds it (evicted, reset, or found gone by a lookup)

A key's description lives while some tier holds it (the hashes of a removal are those of its
store); its tokens only until its store's tiers all reported. A key no tier described (stored
by another engine or an earlier life of this one) is not announced: its store was announced by
whoever made it. Off (`enabled=False`) nothing is kept or built.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvport.connectors.base import KVCacheEvent
from kvport.connectors.views import RequestView

# Descriptions kept for removals at most; beyond it the oldest is forgotten (counted): its
# removal will not be announced. Generous: a description is a few hashes.
MAX_DESCRIBED = 1 << 21


@dataclass(frozen=True)
class BlockDescription:
    """What an offload key stands for in the engine's terms."""

    block_hashes: tuple[bytes, ...]  # its engine blocks, in token order
    parent_block_hash: bytes | None
    group_idx: int


@dataclass(frozen=True)
class BlockContent:
    """What a stored event carries beyond the hashes; dropped once the key is announced."""

    token_ids: tuple[int, ...]
    lora_name: str | None
    lora_id: int | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None


class BlockEvents:
    def __init__(self, enabled: bool, block_size: int, block_factor: int,
                 max_described: int = MAX_DESCRIBED) -> None:
        self.enabled = enabled
        self.block_size = block_size
        self.block_factor = block_factor  # engine blocks per offload block
        self.max_described = max_described
        self._described: OrderedDict[bytes, BlockDescription] = OrderedDict()
        self._content: dict[bytes, BlockContent] = {}
        self._held: dict[bytes, set[str]] = {}  # key -> the media announced as holding it
        self._events: list[KVCacheEvent] = []
        self.num_forgotten = 0  # descriptions dropped for room (their removal goes unannounced)

    # ---- descriptions ----------------------------------------------------------------------

    def describe(self, request: RequestView, key: bytes, group: int, block: int) -> None:
        """Offload block `block` of the request's group `group` is about to be written under
        `key` (a store or a promotion): remember what it holds."""
        if not self.enabled:
            return
        f, bs = self.block_factor, self.block_size
        first, end = block * f, (block + 1) * f
        hashes = tuple(request.block_hashes[first:end])
        assert len(hashes) == f, f"block {block} of {request.request_id}: {len(hashes)} hashes"
        parent = request.block_hashes[first - 1] if first > 0 else None
        self._described[key] = BlockDescription(hashes, parent, group)
        self._described.move_to_end(key)
        self._content[key] = BlockContent(tuple(request.all_token_ids[first * bs:end * bs]),
                                          *_lora(request), _extra_keys(request, first, end))
        while len(self._described) > self.max_described:
            old, _ = self._described.popitem(last=False)
            self._content.pop(old, None)
            self._held.pop(old, None)
            self.num_forgotten += 1

    def settled(self, keys: Iterable[bytes]) -> None:
        """Every tier a store (or promotion) wrote these keys to has reported: their tokens are
        no longer needed; a key no tier holds is forgotten."""
        for key in keys:
            self._content.pop(key, None)
            if not self._held.get(key):
                self._forget(key)

    # ---- tier changes ----------------------------------------------------------------------

    def stored(self, medium: str, keys: Sequence[bytes]) -> None:
        """`medium` now holds `keys` (each hit-able)."""
        if not self.enabled:
            return
        run: list[bytes] = []
        for key in keys:
            desc = self._described.get(key)
            content = self._content.get(key)
            if desc is None or content is None or medium in self._held.get(key, ()):
                continue  # not ours to announce, or announced already
            self._held.setdefault(key, set()).add(medium)
            if run and not self._continues(run[-1], key):
                self._emit_stored(medium, run)
                run = []
            run.append(key)
        if run:
            self._emit_stored(medium, run)

    def removed(self, medium: str, keys: Sequence[bytes]) -> None:
        """`medium` no longer holds `keys`."""
        if not self.enabled:
            return
        by_group: dict[int, list[bytes]] = {}
        for key in keys:
            held = self._held.get(key)
            desc = self._described.get(key)
            if not held or medium not in held or desc is None:
                continue
            held.discard(medium)
            by_group.setdefault(desc.group_idx, []).extend(desc.block_hashes)
            if not held and key not in self._content:
                self._forget(key)
        for group, hashes in by_group.items():
            self._events.append(KVCacheEvent(tuple(hashes), medium, removed=True,
                                             block_size=self.block_size, group_idx=group))

    def change(self, medium: str, keys: Sequence[bytes], removed: bool) -> None:
        """`medium` stored (or removed) `keys`."""
        if removed:
            self.removed(medium, keys)
        else:
            self.stored(medium, keys)

    def holds(self, medium: str, key: bytes) -> bool:
        """Whether `medium` was announced as holding `key` (and not as dropping it since)."""
        return medium in self._held.get(key, ())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        """Keys described (tests: 0 once every tier dropped what it announced)."""
        return len(self._described)

    # ---- helpers ---------------------------------------------------------------------------

    def _continues(self, prev: bytes, key: bytes) -> bool:
        a, b = self._described[prev], self._described[key]
        c, d = self._content[prev], self._content[key]
        return (a.group_idx == b.group_idx and b.parent_block_hash == a.block_hashes[-1]
                and (c.lora_name, c.lora_id) == (d.lora_name, d.lora_id))

    def _emit_stored(self, medium: str, run: list[bytes]) -> None:
        descs = [self._described[k] for k in run]
        contents = [self._content[k] for k in run]
        extra = None
        if any(c.extra_keys is not None for c in contents):
            f = self.block_factor
            extra = tuple(e for c in contents for e in (c.extra_keys or (None,) * f))
        self._events.append(KVCacheEvent(
            tuple(h for d in descs for h in d.block_hashes), medium, removed=False,
            parent_block_hash=descs[0].parent_block_hash,
            token_ids=tuple(t for c in contents for t in c.token_ids),
            block_size=self.block_size, group_idx=descs[0].group_idx,
            lora_name=contents[0].lora_name, lora_id=contents[0].lora_id, extra_keys=extra))

    def _forget(self, key: bytes) -> None:
        self._described.pop(key, None)
        self._content.pop(key, None)
        self._held.pop(key, None)


def _lora(request: RequestView) -> tuple[str | None, int | None]:
    """The request's LoRA adapter (name, id), where its engine has one (an optional attribute
    of a request view: `lora_name`, `lora_id`)."""
    return getattr(request, "lora_name", None), getattr(request, "lora_id", None)


def _extra_keys(request: RequestView, first: int, end: int,
                ) -> tuple[tuple[Any, ...] | None, ...] | None:
    """Per engine block of [first, end), what besides tokens its hash covers (cache_salt, LoRA,
    multimodal items), where the engine's request view can say (an optional method
    `block_extra_keys(first, end)`); None when nothing does."""
    extra = getattr(request, "block_extra_keys", None)
    if extra is None:
        return None
    keys = extra(first, end)
    return None if keys is None or all(k is None for k in keys) else tuple(keys)
