"""An OffloadingConnector variant whose scheduler half hands each step's store jobs to the worker
one step late, in the next step's metadata, as connectors that plan a step's stores once they
know it ran do. A store can then reach the worker on a step without a forward, which the stock
connector never plans (it stores only what the step's scheduled requests compute), so only
this variant shows that the worker half queues stores on every step.

The variant keeps the fence sound only while no block is handed out again between a store's
planning and its submission two steps later: tests use it with a pool that never reuses one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvport.connectors.base import KVCacheSpec
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.connector import OffloadingConnector
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.metadata import OffloadingConnectorMetadata, StoreJob
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler

if TYPE_CHECKING:
    from kvport.connectors.views import SchedulerOutputView


class OneStepLateScheduler(OffloadingScheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._late: list[StoreJob] = []
        self.num_stores_on_empty_steps = 0  # stores sent with a step that has no forward

    def build_connector_meta(self, so: SchedulerOutputView) -> OffloadingConnectorMetadata:
        meta = super().build_connector_meta(so)
        meta.stores, self._late = self._late, meta.stores
        if meta.stores and not so.total_num_scheduled_tokens:
            self.num_stores_on_empty_steps += len(meta.stores)
        return meta


class OneStepLateOffloadingConnector(OffloadingConnector):
    def make_scheduler(self, config: OffloadingConfig, geometry: OffloadGeometry, load: bool,
                       store: bool, spec: KVCacheSpec) -> OffloadingScheduler:
        return OneStepLateScheduler(config, geometry, load=load, store=store)
