"""LRU eviction: the victim is the least recently stored or touched evictable block.

One ordered dict holds every block, oldest first. A new block and a touched block move to the end;
victims are taken scanning from the front, skipping blocks that are pinned (being loaded), being
written, or named in the prepare_store call that needs the room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvport.connectors.offloading.manager.admission import AdmissionPolicy
from kvport.connectors.offloading.manager.abstract import BlockKey
from kvport.connectors.offloading.manager.policy import BlockStatus, PolicyManager


class LRUManager(PolicyManager):
    def __init__(self, num_blocks: int, medium: str,
                 admission: AdmissionPolicy | None = None) -> None:
        super().__init__(num_blocks, medium, admission)
        # key -> block, least recently used first
        self._table: OrderedDict[BlockKey, BlockStatus] = OrderedDict()

    @property
    def keys_by_age(self) -> list[BlockKey]:
        """Every present key, least recently used first."""
        return list(self._table)

    def _find(self, key: BlockKey) -> BlockStatus | None:
        return self._table.get(key)

    def _blocks(self) -> Iterator[tuple[BlockKey, BlockStatus]]:
        return iter(self._table.items())

    def _insert(self, key: BlockKey, block: BlockStatus) -> None:
        assert key not in self._table, f"key {key!r} is already present"
        self._table[key] = block

    def _remove(self, key: BlockKey, evicted: bool) -> BlockStatus:
        return self._table.pop(key)

    def _promote(self, key: BlockKey, block: BlockStatus) -> None:
        self._table.move_to_end(key)

    def _select_victims(self, num: int, protected: set[BlockKey]) -> list[BlockKey]:
        victims: list[BlockKey] = []
        for key, block in self._table.items():
            if len(victims) == num:
                break
            if block.ref_cnt == 0 and key not in protected:
                victims.append(key)
        return victims
