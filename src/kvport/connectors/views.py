"""What a connector may read of the engine's objects: attributes, not classes.

The connector API names no engine class at run time. A connector gets the engine's request and
scheduler output and reads only the attributes below, so any engine whose objects have them can
drive it: kvport's engine passes its own `Request` and, of each step, a `SchedulerOutputRecord`
(its own records hold a block table per KV cache group, a connector reads one); an adapter for
another engine (vLLM) passes thin views of that engine's objects. Every attribute is read-only
for the connector.

`tests/connectors/test_engine_free.py` imports and drives connectors with `kvport.engine` made
unimportable, using plain records of these shapes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RequestView(Protocol):
    """One request, as the scheduler half of a connector sees it."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the engine's pool (before the step being scheduled)."""

    @property
    def block_size(self) -> int:
        """Tokens per engine block."""

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """Chained hash of every full engine block of the request's tokens: equal hashes mean
        equal prefixes of the same model (see KVCacheSpec.hash_root)."""

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt and output tokens so far (what the stored events of its blocks carry)."""

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None:
        """The request's own limits for connectors (max_load_tokens, ...), or None."""


@runtime_checkable
class NewRequestView(Protocol):
    """A request scheduled with its whole state (first time, or resumed)."""

    @property
    def req_id(self) -> str: ...

    @property
    def block_ids(self) -> Sequence[int]:
        """Its whole block table (for a SupportsHMA connector, a tuple: one per KV cache group)."""

    @property
    def num_computed_tokens(self) -> int: ...


@runtime_checkable
class CachedRequestView(Protocol):
    """A request scheduled again: only what changed."""

    @property
    def req_id(self) -> str: ...

    @property
    def new_block_ids(self) -> Sequence[int]:
        """Blocks appended to its block table in this step (for a SupportsHMA connector, a
        tuple: one per KV cache group)."""

    @property
    def num_computed_tokens(self) -> int: ...


@runtime_checkable
class StepView(Protocol):
    """What the worker driver reads of a step (a SchedulerOutputView has all of it)."""

    @property
    def step(self) -> int: ...

    @property
    def finished_req_ids(self) -> Collection[str]: ...

    @property
    def has_sync_kv_loads(self) -> bool: ...

    @property
    def kv_connector_metadata(self) -> Any: ...


@runtime_checkable
class SchedulerOutputView(Protocol):
    """One step's schedule, as build_connector_meta and the worker driver see it."""

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestView]: ...

    @property
    def scheduled_cached_reqs(self) -> Sequence[CachedRequestView]: ...

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]:
        """req_id -> tokens computed in this step."""

    @property
    def total_num_scheduled_tokens(self) -> int: ...

    @property
    def preempted_req_ids(self) -> Collection[str]:
        """Requests preempted in this step: their blocks are already free."""

    @property
    def finished_req_ids(self) -> Collection[str]:
        """Requests finished since the previous step."""

    @property
    def step(self) -> int: ...

    @property
    def has_sync_kv_loads(self) -> bool:
        """Some request scheduled in this step gets external tokens from a synchronous load
        (its connector answered is_async=False with tokens > 0). Those loads must finish before
        the forward reads them, so under vLLM 0.32's call order the worker driver runs
        start_load_kv before the forward only on such steps (see kvport.connectors.driver)."""

    @property
    def kv_connector_metadata(self) -> Any:
        """What build_connector_meta returned for this step (read by the worker driver)."""


# Plain records of the shapes above, for an engine whose own objects differ (vLLM's adapter; kvport's
# engine, whose records hold a table per KV cache group where a connector reads one).


@dataclass
class NewRequestRecord:
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestRecord:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutputRecord:
    """A `SchedulerOutputView` built once per step from another engine's scheduler output."""

    scheduled_new_reqs: list[NewRequestRecord]
    scheduled_cached_reqs: list[CachedRequestRecord]
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    step: int
    has_sync_kv_loads: bool = False
    kv_connector_metadata: Any = None
