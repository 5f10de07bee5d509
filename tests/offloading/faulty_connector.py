"""An OffloadingConnector whose transfers go through FaultyTransfer (in-process tests only).

A test sets FAULTS[(src medium, dst medium)] = {"fail_on": {...}, "hold_on": {...}} before it
builds the LLM; the wrappers of the last connector built are in WRAPPERS."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fault_tiers import FaultyTransfer
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.connector import OffloadingConnector
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.worker.wiring import LowerTier, tier_routes
from kvport.connectors.offloading.worker.threads import ThreadPoolHandler
from kvport.connectors.offloading.worker.transfers import TransferRouter
from kvport.connectors.offloading.worker.half import OffloadingConnectorWorker

FAULTS: dict[tuple[str, str], dict[str, Any]] = {}
WRAPPERS: dict[tuple[str, str], FaultyTransfer] = {}


def faulty_transfers(host: HostTier, lower: Mapping[str, LowerTier]) -> TransferRouter:
    worker = TransferRouter()
    WRAPPERS.clear()
    for (src, dst), fn in tier_routes(host, lower).items():
        WRAPPERS[(src, dst)] = wrapper = FaultyTransfer(fn, **FAULTS.get((src, dst), {}))
        worker.register_handler(src, dst, ThreadPoolHandler(wrapper, 1, f"{src}-{dst}"))
    return worker


class FaultyOffloadingConnector(OffloadingConnector):
    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        return OffloadingConnectorWorker(config, make_transfers=faulty_transfers)


class SyncStoresFaultyConnector(FaultyOffloadingConnector):
    """Every step's stores copied within that step (as inside vLLM): a store reads its blocks
    before the next step's forward can write them again."""

    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        return OffloadingConnectorWorker(config, make_transfers=faulty_transfers,
                                         sync_stores=True)
