"""Several KV cache groups in the connector API: the mixin a connector declares to get them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from kvport.connectors.views import RequestView


class SupportsHMA(ABC):
    """Mixin of a connector that handles several KV cache groups (vLLM's name: hybrid memory
    allocator). With it the engine keeps a hybrid model's groups and hands the connector a block
    table per group, in group order, wherever it hands one table otherwise:
    `update_state_after_alloc(request, block_ids: tuple[list[int], ...], ...)`, the step view's
    `block_ids` / `new_block_ids`, and `request_finished_all_groups` in place of
    `request_finished`. A sliding group's table holds the null block (id 0) where its window
    has moved past. Without it the engine keeps one group of every layer."""

    @abstractmethod
    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` with a block table per KV cache group (the same contract)."""


def supports_hma(connector: object) -> bool:
    """Whether a connector (instance or class) handles several KV cache groups."""
    cls = connector if isinstance(connector, type) else type(connector)
    return issubclass(cls, SupportsHMA)


def group_tables(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> tuple[list[int], ...]:
    """A block table per KV cache group, copied, from what an engine hands a connector: a tuple
    of tables (a SupportsHMA connector, one per group even for a single group) or one flat table
    (a connector without SupportsHMA, or an engine that knows one group, such as kvport.vllm's
    adapter). An empty flat table is one empty group."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return tuple(list(table) for table in block_ids)  # type: ignore[arg-type]
    return (list(block_ids),)  # type: ignore[arg-type]
