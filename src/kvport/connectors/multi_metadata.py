"""MultiConnector's records: its config, the per-step metadata and the worker metadata.

Index i of every tuple belongs to child i (config order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvport.config import KVTransferConfig
from kvport.connectors.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class MultiConnectorConfig:
    connectors: list[dict[str, Any]] = field(default_factory=list)  # KVTransferConfig dicts

    def child_configs(self) -> list[KVTransferConfig]:
        if not self.connectors:
            raise ValueError("MultiConnector: kv_connector_extra_config['connectors'] must list at "
                             "least one connector config, got []")
        configs = []
        for i, child in enumerate(self.connectors):
            try:
                config = KVTransferConfig.from_any(child)
            except ValueError as exc:
                raise ValueError(f"MultiConnector: connectors[{i}]: {exc}") from None
            if config is None:
                raise ValueError(f"MultiConnector: connectors[{i}] must be a config dict, got None")
            configs.append(config)
        return configs


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    per_connector: tuple[KVConnectorMetadata, ...]
    async_load_owners: dict[str, int] = field(default_factory=dict)  # req_id -> child index
    savers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # req_id -> saving children


@dataclass(frozen=True)
class MultiConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    per_connector: tuple[KVConnectorWorkerMetadata | None, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> MultiConnectorWorkerMetadata:
        """Element-wise; None is the identity."""
        if not (isinstance(other, MultiConnectorWorkerMetadata)
                and len(other.per_connector) == len(self.per_connector)):
            raise ValueError(f"cannot aggregate {self!r} with {other!r}")
        return MultiConnectorWorkerMetadata(tuple(
            b if a is None else a if b is None else a.aggregate(b)
            for a, b in zip(self.per_connector, other.per_connector, strict=True)))
