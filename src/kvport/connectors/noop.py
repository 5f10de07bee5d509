"""A connector that does nothing: measures the framework's own cost, and is a minimal template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvport.config import KVTransferConfig
from kvport.connectors.base import ForwardContext, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvport.connectors.factory import parse_extra_config
from kvport.connectors.views import RequestView, SchedulerOutputView


@dataclass(frozen=True)
class NoOpConfig:
    pass


class NoOpConnector(KVConnectorBase):
    """Loads nothing, stores nothing. Subclasses override what they need and name their own
    config dataclass in `config_class` (parsed into `self.cfg`, unknown keys rejected)."""

    config_class: ClassVar[type[Any]] = NoOpConfig

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.cfg = parse_extra_config(self.config_class, config)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, ctx: ForwardContext) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
