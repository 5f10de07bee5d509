"""Which of the OffloadingConnector's numbers vLLM's `/metrics` shows, under which names.

Where vLLM's own offloading connector has a family of the same meaning, kvport fills it
(`vllm:kv_offload_*`: host <-> engine copies, the host tier's in-flight usage and allocation
failures, the lower tiers as vLLM's secondary tiers), so a dashboard made for vLLM's connector
reads kvport's; the rest is kvport's own (`vllm:kvport_*`). Histograms are made of single
measurements (scheduler/decisions.py), the rest of the records' fields (metrics.py).
Plain data: no vLLM import, so tests and the dashboard check read it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
OBSERVATIONS = "obs"  # the section of a histogram's path: measurements, not a record field

# vLLM's buckets where it has the family; kvport's lookups span microseconds (host) to the
# lookup timeouts (disk, Redis).
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
LOOKUP_CALL_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)
ALLOCATION_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
TIER_LOOKUP_BUCKETS = (1e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)


@dataclass(frozen=True)
class Metric:
    # (section, field) of ConnectorMetrics (a record of its own, or a tier's, which may be
    # absent), or (OBSERVATIONS, name) for a histogram; a test resolves every path.
    path: tuple[str, str]
    name: str  # Prometheus name (counters without "_total": the client adds it)
    labels: tuple[tuple[str, str], ...]
    kind: str = COUNTER
    buckets: tuple[float, ...] = ()

    @property
    def key(self) -> str:
        """Its key in the stats dict vLLM carries between processes."""
        return ".".join(self.path)

    @property
    def gauge(self) -> bool:
        return self.kind == GAUGE


def _k(key: str, name: str, kind: str = COUNTER, **labels: str) -> Metric:
    section, _, field_name = key.partition(".")
    return Metric((section, field_name), f"vllm:kvport_{name}", tuple(labels.items()), kind)


def _v(key: str, name: str, kind: str = COUNTER, **labels: str) -> Metric:
    section, _, field_name = key.partition(".")
    return Metric((section, field_name), f"vllm:kv_offload_{name}", tuple(labels.items()), kind)


def _h(obs: str, name: str, buckets: tuple[float, ...], **labels: str) -> Metric:
    return Metric((OBSERVATIONS, obs), name, tuple(labels.items()), HISTOGRAM, buckets)


VLLM_FAMILIES = (
    _v("host.bytes_loaded", "load_bytes"),
    _v("host.load_seconds", "load_time"),
    _v("host.bytes_stored", "store_bytes"),
    _v("host.store_seconds", "store_time"),
    _v("host.num_rejected_stores", "allocation_failure"),
    _v("host.num_deferred_blocks", "stores_skipped"),  # the reuse threshold not reached
    _v("decisions.host_usage", "cpu_cache_usage_perc", GAUGE),
    _v("decisions.host_write_usage", "cpu_cache_write_usage_perc", GAUGE),
    _v("decisions.host_read_usage", "cpu_cache_read_usage_perc", GAUGE),
    *(m for tier in ("disk", "redis") for m in (
        _v(f"{tier}.bytes_loaded", "tiering_read_bytes", tier=tier),
        _v(f"{tier}.load_seconds", "tiering_read_time", tier=tier),
        _v(f"{tier}.bytes_stored", "tiering_write_bytes", tier=tier),
        _v(f"{tier}.store_seconds", "tiering_write_time", tier=tier))),
    _v("redis.lookup_keys_queried", "tiering_chunk_queries", tier="redis"),
    _v("redis.lookup_keys_found", "tiering_chunk_hits", tier="redis"),
    _h("load_bytes", "vllm:kv_offload_load_size", TRANSFER_SIZE_BUCKETS),
    _h("store_bytes", "vllm:kv_offload_store_size", TRANSFER_SIZE_BUCKETS),
    _h("lookup_call_seconds", "vllm:kv_offload_lookup_sync_delay_seconds",
       LOOKUP_CALL_BUCKETS),
    _h("allocation_blocks", "vllm:kv_offload_cpu_allocation_size", ALLOCATION_BUCKETS),
)

KVPORT_FAMILIES = (
    _k("requests.num_queried_tokens", "queried_tokens_total"),
    _k("host.hit_tokens", "hit_tokens_total", tier="host"),
    _k("disk.hit_tokens", "hit_tokens_total", tier="disk"),
    _k("redis.hit_tokens", "hit_tokens_total", tier="redis"),
    *(_k(f"decisions.prompt_tokens_{source}", "prompt_tokens_total", source=source)
      for source in ("device", "host", "disk", "redis", "computed")),
    *(_k(f"decisions.host_{outcome}_blocks", "store_blocks_total", tier="host", outcome=outcome)
      for outcome in ("stored", "present", "refused", "deferred", "failed")),
    _k("disk.blocks_stored", "store_blocks_total", tier="disk", outcome="stored"),
    _k("disk.already_present", "store_blocks_total", tier="disk", outcome="present"),
    _k("disk.skipped_stores", "store_blocks_total", tier="disk", outcome="skipped"),
    _k("redis.blocks_stored", "store_blocks_total", tier="redis", outcome="stored"),
    _k("redis.already_present", "store_blocks_total", tier="redis", outcome="present"),
    _k("redis.refused_stores", "store_blocks_total", tier="redis", outcome="refused"),
    _k("redis.skipped_stores", "store_blocks_total", tier="redis", outcome="skipped"),
    *(_h(f"lookup_seconds.{tier}", "vllm:kvport_lookup_seconds", TIER_LOOKUP_BUCKETS,
         tier=tier) for tier in ("host", "disk", "redis")),
    _k("host.evictions", "evicted_blocks_total", tier="host"),
    _k("disk.evictions", "evicted_blocks_total", tier="disk"),
    _k("requests.num_failed_loads", "failures_total", kind="load"),
    _k("requests.num_failed_stores", "failures_total", kind="store"),
    _k("disk.failures", "failures_total", kind="disk_io"),
    _k("redis.failures", "failures_total", kind="redis_load"),
    _k("requests.num_limited_hits", "limited_hits_total"),
    _k("requests.num_bad_transfer_params", "bad_transfer_params_total"),
    _k("requests.num_inflight_waits", "inflight_wait_answers_total"),
    _k("requests.num_inflight_timeouts", "inflight_wait_timeouts_total"),
    # Lower-tier I/O past its deadline (load_timeout_s, write_timeout_s): given up on.
    _k("worker.num_late_loads", "late_jobs_total", kind="load"),
    _k("worker.num_late_writes", "late_jobs_total", kind="write"),
    _k("worker.num_replaced_threads", "replaced_threads_total"),
    _k("host.occupancy_bytes", "occupancy_bytes", GAUGE, tier="host"),
    _k("disk.occupancy_bytes", "occupancy_bytes", GAUGE, tier="disk"),
    # What only a network store has.
    _k("redis.round_trips", "redis_round_trips_total", side="worker"),
    _k("redis.lookup_round_trips", "redis_round_trips_total", side="scheduler"),
    _k("redis.timeouts", "redis_problems_total", kind="timeout", side="worker"),
    _k("redis.lookup_timeouts", "redis_problems_total", kind="timeout", side="scheduler"),
    _k("redis.errors", "redis_problems_total", kind="error", side="worker"),
    _k("redis.lookup_errors", "redis_problems_total", kind="error", side="scheduler"),
    _k("redis.skipped_down", "redis_problems_total", kind="down", side="worker"),
    _k("redis.lookup_skipped_down", "redis_problems_total", kind="down", side="scheduler"),
    _k("redis.vanished", "redis_problems_total", kind="vanished", side="worker"),
    _k("redis.corrupt", "redis_problems_total", kind="corrupt", side="worker"),
)

METRICS = VLLM_FAMILIES + KVPORT_FAMILIES

DOC = {
    "vllm:kv_offload_load_bytes": "Bytes loaded from kvport's host tier into the KV cache.",
    "vllm:kv_offload_load_time": "Seconds of copies from kvport's host tier into the KV cache.",
    "vllm:kv_offload_store_bytes": "Bytes stored from the KV cache into kvport's host tier.",
    "vllm:kv_offload_store_time": "Seconds of copies from the KV cache into kvport's host tier.",
    "vllm:kv_offload_allocation_failure": "Stores that found no room in the host tier.",
    "vllm:kv_offload_stores_skipped": "Blocks not stored: their reuse count was below "
                                      "store_threshold.",
    "vllm:kv_offload_cpu_cache_usage_perc": "Fraction of host slots held by transfers in flight.",
    "vllm:kv_offload_cpu_cache_write_usage_perc": "Fraction of host slots being written.",
    "vllm:kv_offload_cpu_cache_read_usage_perc": "Fraction of host slots being read by loads.",
    "vllm:kv_offload_tiering_read_bytes": "Bytes read from disk or Redis into host memory.",
    "vllm:kv_offload_tiering_read_time": "Seconds of reads from disk or Redis.",
    "vllm:kv_offload_tiering_write_bytes": "Bytes written through to disk or Redis.",
    "vllm:kv_offload_tiering_write_time": "Seconds of writes to disk or Redis.",
    "vllm:kv_offload_tiering_chunk_queries": "Blocks the scheduler asked Redis about.",
    "vllm:kv_offload_tiering_chunk_hits": "Blocks Redis held when asked.",
    "vllm:kv_offload_load_size": "Bytes per load (host tier into the KV cache).",
    "vllm:kv_offload_store_size": "Bytes per store (KV cache into the host tier).",
    "vllm:kv_offload_lookup_sync_delay_seconds": "Seconds of one lookup call (every tier).",
    "vllm:kv_offload_cpu_allocation_size": "Blocks one host-tier allocation asked for.",
    "vllm:kvport_queried_tokens_total": "Prompt tokens beyond the engine's own prefix hit "
                                        "asked of kvport.",
    "vllm:kvport_hit_tokens_total": "Prompt tokens kvport loaded, by the tier they came from.",
    "vllm:kvport_prompt_tokens_total": "Admitted prompts' tokens by where their KV came from: "
                                       "the engine's own cache (device), a kvport tier, or "
                                       "computed.",
    "vllm:kvport_store_blocks_total": "Blocks offered to a tier, by outcome: stored, present "
                                      "already, refused (no room), deferred (admission), "
                                      "skipped (full or down), failed.",
    "vllm:kvport_lookup_seconds": "Seconds one tier took to say which blocks it holds.",
    "vllm:kvport_evicted_blocks_total": "Offload blocks evicted, by tier.",
    "vllm:kvport_failures_total": "Failed loads, stores, disk I/O and Redis loads.",
    "vllm:kvport_limited_hits_total": "Hits cut short by a request's kv_transfer_params.",
    "vllm:kvport_bad_transfer_params_total": "Requests whose kv_transfer_params kvport could "
                                             "not read: run with no load and no store.",
    "vllm:kvport_inflight_wait_answers_total": "Times a request was told to ask again because "
                                               "another request was writing its next blocks.",
    "vllm:kvport_inflight_wait_timeouts_total": "Requests that reached inflight_wait_s and "
                                                "computed the blocks still being written.",
    "vllm:kvport_late_jobs_total": "Loads and write-throughs from or to disk or Redis given up "
                                   "after load_timeout_s or write_timeout_s.",
    "vllm:kvport_replaced_threads_total": "Transfer threads started in place of stuck ones.",
    "vllm:kvport_occupancy_bytes": "Bytes held, by tier.",
    "vllm:kvport_redis_round_trips_total": "Pipelined round trips to Redis, by side.",
    "vllm:kvport_redis_problems_total": "Redis timeouts, errors, calls skipped while down, "
                                        "keys vanished before their load, corrupt values.",
}
