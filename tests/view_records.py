"""Plain records with exactly the attributes of kvport.connectors.views: what another engine
hands a connector. Tests drive connector halves with them, without kvport's engine."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


def chain_hashes(token_ids: list[int], block_size: int, root: bytes = b"view-records") -> list[bytes]:
    """A chained hash per full block (any stable function serves: the connector compares)."""
    out, parent = [], root
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + json.dumps(block).encode()).digest()
        out.append(parent)
    return out


@dataclass
class ViewRequest:
    request_id: str
    prompt_token_ids: list[int]
    block_size: int
    block_hashes: list[bytes] = field(default_factory=list)  # default: chain_hashes(prompt)
    num_computed_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.block_hashes:
            self.block_hashes = chain_hashes(self.prompt_token_ids, self.block_size)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class ViewNewRequest:
    req_id: str
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class ViewSchedulerOutput:
    scheduled_new_reqs: list[ViewNewRequest]
    num_scheduled_tokens: dict[str, int]
    step: int = 0
    scheduled_cached_reqs: list[Any] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    has_sync_kv_loads: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
