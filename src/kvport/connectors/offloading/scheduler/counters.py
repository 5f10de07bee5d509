"""The scheduler half's own counters (exported as metrics.RequestMetrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerCounters:
    num_queried_tokens: int = 0  # prompt tokens beyond the local hit, asked of the connector
    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    num_redis_hit_tokens: int = 0
    num_load_jobs: int = 0
    num_sync_loads: int = 0  # of num_load_jobs: host hits copied before the step's forward
    num_failed_loads: int = 0
    num_store_jobs: int = 0
    num_failed_stores: int = 0
    num_flushed_jobs: int = 0
    num_busy_answers: int = 0  # None answers: the request's own stores were still pending
    # Admissions whose block hashes were not one per engine block (a hash block size unlike
    # the KV block's): key i would name another prefix than the bytes under it, so the
    # request is neither loaded nor stored.
    num_mismatched_hashes: int = 0
    num_skipped_write_throughs: int = 0  # stores kept in host memory only (WRITE_THROUGH_SHARE)
    # of num_store_jobs: blocks a request's final step completed, offered when it finished
    num_final_block_stores: int = 0
    # Requests whose kv_transfer_params could not be read: run with no load and no store.
    num_bad_transfer_params: int = 0
    num_limited_hits: int = 0  # hits cut short by a request's max_load_tokens or kv_load_tiers
