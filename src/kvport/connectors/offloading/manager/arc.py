"""ARC eviction (adaptive replacement): balances recency against frequency by itself.

Resident blocks live in two ordered lists, oldest first:
    T1  blocks accessed once since they were stored (every new block enters here)
    T2  blocks accessed again after that
and two ghost lists remember only the keys of recent victims:
    B1  keys evicted from T1        B2  keys evicted from T2
Each ghost list keeps at most `num_blocks` keys, dropping its oldest.

`target_t1_size` (an int in [0, num_blocks]) is how large T1 should be; it adapts:
    - a key stored again while in B1 means T1 was too small: the target grows by
      max(1, |B2| // |B1|);
    - a key stored again while in B2 means T2 was too small: the target shrinks by
      max(1, |B1| // |B2|).
The key then leaves its ghost list and enters T1 like any new block. When several stored keys are
ghosts, they adjust the target one after another, in call order.

touch: a ready block in T1 moves to the end of T2 (its second access); a block still being written
stays in T1 and only moves to its end (being stored is not an access); a block in T2 moves to the
end of T2. Keys that are not resident (ghosts included) are ignored.

Eviction, one victim at a time: if |T1| >= target, the oldest evictable block of T1 (or of T2 when
T1 has none), else the oldest evictable block of T2 (or of T1). Evictable means ready, not pinned
and not named in the prepare_store call. The victim's key goes to the end of B1 or B2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvport.connectors.offloading.manager.admission import AdmissionPolicy
from kvport.connectors.offloading.manager.abstract import BlockKey
from kvport.connectors.offloading.manager.policy import BlockStatus, PolicyManager

_NO_KEY = object()


class ARCManager(PolicyManager):
    def __init__(self, num_blocks: int, medium: str,
                 admission: AdmissionPolicy | None = None) -> None:
        super().__init__(num_blocks, medium, admission)
        self._t1: OrderedDict[BlockKey, BlockStatus] = OrderedDict()  # key -> block, oldest first
        self._t2: OrderedDict[BlockKey, BlockStatus] = OrderedDict()  # key -> block, oldest first
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()  # ghost keys, oldest first
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()  # ghost keys, oldest first
        self._target_t1_size = 0

    @property
    def target_t1_size(self) -> int:
        return self._target_t1_size

    @property
    def t1_keys(self) -> list[BlockKey]:
        return list(self._t1)

    @property
    def t2_keys(self) -> list[BlockKey]:
        return list(self._t2)

    @property
    def b1_keys(self) -> list[BlockKey]:
        return list(self._b1)

    @property
    def b2_keys(self) -> list[BlockKey]:
        return list(self._b2)

    def _find(self, key: BlockKey) -> BlockStatus | None:
        block = self._t1.get(key)
        return block if block is not None else self._t2.get(key)

    def _blocks(self) -> Iterator[tuple[BlockKey, BlockStatus]]:
        yield from self._t1.items()
        yield from self._t2.items()

    def _on_store(self, new_keys: list[BlockKey]) -> None:
        for key in new_keys:
            if key in self._b1:
                step = max(1, len(self._b2) // len(self._b1))
                self._target_t1_size = min(self.num_blocks, self._target_t1_size + step)
                del self._b1[key]
            elif key in self._b2:
                step = max(1, len(self._b1) // len(self._b2))
                self._target_t1_size = max(0, self._target_t1_size - step)
                del self._b2[key]

    def _insert(self, key: BlockKey, block: BlockStatus) -> None:
        assert self._find(key) is None, f"key {key!r} is already present"
        self._b1.pop(key, None)
        self._b2.pop(key, None)
        self._t1[key] = block

    def _remove(self, key: BlockKey, evicted: bool) -> BlockStatus:
        table, ghosts = (self._t1, self._b1) if key in self._t1 else (self._t2, self._b2)
        block = table.pop(key)
        if evicted:
            ghosts[key] = None
            if len(ghosts) > self.num_blocks:
                ghosts.popitem(last=False)
        return block

    def _promote(self, key: BlockKey, block: BlockStatus) -> None:
        if key in self._t1:
            if block.is_ready:
                del self._t1[key]
                self._t2[key] = block
            else:
                self._t1.move_to_end(key)
        else:
            self._t2.move_to_end(key)

    def _select_victims(self, num: int, protected: set[BlockKey]) -> list[BlockKey]:
        def evictable(table: OrderedDict[BlockKey, BlockStatus]) -> Iterator[BlockKey]:
            return (key for key, block in table.items()
                    if block.ref_cnt == 0 and key not in protected)

        from_t1, from_t2 = evictable(self._t1), evictable(self._t2)
        t1_size = len(self._t1)  # as it will be once the victims so far are gone
        victims: list[BlockKey] = []
        for _ in range(num):
            order = (from_t1, from_t2) if t1_size >= self._target_t1_size else (from_t2, from_t1)
            key = next(order[0], _NO_KEY)
            if key is _NO_KEY:
                key = next(order[1], _NO_KEY)
            assert key is not _NO_KEY, f"only {len(victims)} of {num} victims found"
            if key in self._t1:
                t1_size -= 1
            victims.append(key)
        return victims

    def _clear(self) -> None:
        super()._clear()
        self._b1.clear()
        self._b2.clear()
        self._target_t1_size = 0

    def _check_policy(self) -> list[str]:
        problems = []
        both = self._t1.keys() & self._t2.keys()
        if both:
            problems.append(f"keys in both T1 and T2: {sorted(map(repr, both))}")
        ghosts = self._b1.keys() | self._b2.keys()
        resident = self._t1.keys() | self._t2.keys()
        if len(ghosts) != len(self._b1) + len(self._b2) or ghosts & resident:
            problems.append("a ghost key is in both B1 and B2 or is also resident")
        if len(self._b1) > self.num_blocks or len(self._b2) > self.num_blocks:
            problems.append(f"|B1|={len(self._b1)}, |B2|={len(self._b2)} > {self.num_blocks}")
        if not 0 <= self._target_t1_size <= self.num_blocks:
            problems.append(f"target_t1_size {self._target_t1_size} outside [0, {self.num_blocks}]")
        return problems
