"""A connector that declares SupportsHMA and records what the engine hands it, for
test_hybrid_connector_api.py (loaded with kv_connector_module_path="hma_connector")."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvport.connectors.base import KVCacheSpec
from kvport.connectors.hma import SupportsHMA
from kvport.connectors.noop import NoOpConnector
from kvport.connectors.views import RequestView, SchedulerOutputView


class GroupsConnector(NoOpConnector, SupportsHMA):
    # Both halves run in the test's process: one log for both, cleared by the test.
    calls: ClassVar[list[tuple[str, Any]]] = []

    def set_kv_cache_spec(self, spec: KVCacheSpec) -> None:
        self.calls.append(("set_kv_cache_spec", spec))

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self.calls.append(("register_kv_caches", (tuple(kv_cache.shape), spec)))

    def update_state_after_alloc(self, request: RequestView, block_ids: Any,
                                 num_external_tokens: int) -> None:
        self.calls.append(("update_state_after_alloc", block_ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> Any:
        for new in scheduler_output.scheduled_new_reqs:
            self.calls.append(("new_block_ids", new.block_ids))
        for cached in scheduler_output.scheduled_cached_reqs:
            self.calls.append(("cached_block_ids", cached.new_block_ids))
        return super().build_connector_meta(scheduler_output)

    def request_finished_all_groups(self, request: RequestView, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished_all_groups", block_ids))
        return False, None

    def request_finished(self, request: RequestView, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        raise AssertionError("a SupportsHMA connector is asked request_finished_all_groups")
