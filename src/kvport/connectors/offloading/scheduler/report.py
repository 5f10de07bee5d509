"""The scheduler half's records of the host tier and of its decisions, from the manager's and
its own counters (the rest of metrics.ConnectorMetrics is the workers' and the lookups')."""

from __future__ import annotations

from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.manager.policy import PolicyManager
from kvport.connectors.offloading.metrics import (
    DecisionMetrics, HostMetrics, TierMetrics, extend,
)
from kvport.connectors.offloading.scheduler.counters import SchedulerCounters
from kvport.connectors.offloading.scheduler.decisions import DecisionCounters


def host_metrics(manager: PolicyManager, g: OffloadGeometry, copies: TierMetrics,
                 counts: SchedulerCounters) -> HostMetrics:
    """The workers' copies (`copies`) with the host tier's slots, lookups, hits and evictions
    (the manager's)."""
    m = manager.stats
    used = g.num_slots - manager.num_free_slots
    return extend(HostMetrics, copies, num_slots=g.num_slots, occupancy_blocks=used,
                  occupancy_bytes=used * g.slot_bytes, lookups=m.num_lookups,
                  hits=m.num_hit_blocks, evictions=m.num_evicted_blocks,
                  num_rejected_stores=m.num_rejected_stores,
                  num_deferred_blocks=m.num_deferred_blocks,
                  hit_tokens=counts.num_host_hit_tokens)


def decision_metrics(d: DecisionCounters, manager: PolicyManager) -> DecisionMetrics:
    """Prompt tokens by source and the host tier's store outcomes (stored, deferred and failed
    are the manager's)."""
    m, n = manager.stats, manager.num_blocks
    reading, writing = manager.num_pinned / n, manager.num_being_written / n
    return DecisionMetrics(
        d.prompt_tokens_device, d.prompt_tokens_host, d.prompt_tokens_disk,
        d.prompt_tokens_redis, d.prompt_tokens_computed, m.num_stored_blocks,
        d.host_present_blocks, d.host_refused_blocks, m.num_deferred_blocks,
        m.num_failed_blocks, reading, writing, reading + writing)
