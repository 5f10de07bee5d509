"""kvport's OffloadingConnector as a vLLM KV connector.

One connector core, two engines: the scheduler half (`OffloadingScheduler`: hits, jobs, the
block-reuse fence), its manager, the tiers and the worker half (`OffloadingConnectorWorker`) are
the code that runs in kvport's engine. This class only translates: vLLM's requests, block lists
and scheduler output into kvport's views (objects.py), kvport's metadata into vLLM's metadata
classes, vLLM's layer-major KV caches into an EnginePool, kvport's events and stats into vLLM's.

What differs from kvport's engine, and why:
- Stores run with `sync_stores`: vLLM's in-process LLM stops stepping as soon as no request is
  unfinished, so a step's stores are copied (and known to the scheduler half) in that step, and
  written through to disk by the worker with no further step. `has_pending_push_work` keeps
  vLLM's engine-core loop stepping while write-throughs are unreported.
- Keys are vLLM's block hashes; the disk namespace adds what they lack (model identity,
  identity.py: revision, weights digest, quantization, overrides; dtype, page layout, hash
  algorithm, tensor-parallel rank). A model whose weights cannot be identified shares no tier
  unless the config names a `namespace`. With a shared tier, vLLM's kv_load_failure_policy
  "fail" is set to "recompute" (shared_tiers.py). A disk tier needs hashes that are equal
  across processes: vLLM's xxhash seeds them at random unless PYTHONHASHSEED is set, which is
  refused with a clear error.
- `requires_kv_delivery` is False: a lost store is a later miss, not an error.
- Completions: each tensor-parallel rank reports its own shard; a job is done when every rank
  reported it (the scheduler half counts `num_workers`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from kvport.config import KVTransferConfig
from kvport.connectors.base import KVCacheSpec, KVConnectorOutput
from kvport.connectors.factory import parse_extra_config
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import DISK, HOST, REDIS
from kvport.connectors.offloading.metadata import (
    OffloadingConnectorMetadata, OffloadingWorkerMetadata,
)
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler
from kvport.connectors.offloading.worker.half import OffloadingConnectorWorker
from kvport.vllm.compat import require_vllm
from kvport.vllm.objects import (
    RequestAdapter, adapt_scheduler_output, engine_pool, group0, hash_root, hashes_are_stable,
)
from kvport.vllm.shared_tiers import namespace_identity, per_rank, recompute_failed_loads
from kvport.vllm.stats import KvportPromMetrics, KvportStats, StatsDelta, flatten

require_vllm()

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput as VllmKVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
LAYOUT = "vllm-pages"  # host rows: an engine block's page of every layer, in layer order
MEDIUMS = {"HOST": "CPU", "DISK": "DISK"}  # kvport medium -> vLLM event medium


class OffloadingMetadata(KVConnectorMetadata):
    """Scheduler -> worker: kvport's metadata for the step, and whether the step has a forward
    (kvport's worker waits briefly for transfers on steps without one)."""

    def __init__(self, inner: OffloadingConnectorMetadata, did_forward: bool) -> None:
        self.inner = inner
        self.did_forward = did_forward


class OffloadingWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: kvport's job results; vLLM aggregates the ranks' with aggregate()."""

    def __init__(self, inner: OffloadingWorkerMetadata) -> None:
        self.inner = inner

    def aggregate(self, other: KVConnectorWorkerMetadata) -> OffloadingWorkerMeta:
        assert isinstance(other, OffloadingWorkerMeta), f"cannot aggregate {other!r}"
        return OffloadingWorkerMeta(self.inner.aggregate(other.inner))


class OffloadingConnector(KVConnectorBase_V1):
    """`{"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm"}`;
    `kv_connector_extra_config` takes kvport's OffloadingConnector keys (docs/offloading.md)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # the base class checked
        extra = dict(ktc.kv_connector_extra_config or {})
        if "record_trace" in extra:  # kvport's engine records it; inside vLLM, the wrapper does
            raise ValueError(
                "kvport.vllm OffloadingConnector: kv_connector_extra_config key 'record_trace' "
                "is kvport's engine's call recorder, which does not run inside vLLM; remove it, "
                "and record with kvport.vllm's RecordingConnector around this connector: "
                '{"kv_connector": "RecordingConnector", "kv_connector_module_path": '
                '"kvport.vllm", "kv_role": ..., "kv_connector_extra_config": {"record_trace": '
                '"trace.jsonl", "connector": {"kv_connector": "OffloadingConnector", '
                '"kv_connector_module_path": "kvport.vllm", "kv_connector_extra_config": '
                '{...without record_trace...}}}}')
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("kvport.vllm OffloadingConnector: pipeline parallelism "
                             f"(pipeline_parallel_size={parallel.pipeline_parallel_size}) is not "
                             "supported; use tensor parallelism")
        self._num_workers = parallel.tensor_parallel_size
        config = parse_extra_config(OffloadingConfig, KVTransferConfig(
            "OffloadingConnector", kv_connector_extra_config=extra))
        # cpu_bytes_to_use and the disk's max_bytes are the engine's: each rank holds a shard.
        self.offloading_config = per_rank(config, self._num_workers)
        if role == KVConnectorRole.SCHEDULER:  # vLLM reads the policy right after this
            recompute_failed_loads(ktc, config)
        if config.tiers:
            algo = vllm_config.cache_config.prefix_caching_hash_algo
            if not hashes_are_stable(algo):
                raise ValueError(
                    f"kvport.vllm OffloadingConnector: secondary_tiers has a shared tier, but "
                    f"vLLM's prefix_caching_hash_algo={algo!r} seeds block hashes at random in "
                    f"every process, so no other process would ever hit its entries; use "
                    f"--prefix-caching-hash-algo sha256 (vLLM's default) or set PYTHONHASHSEED")
        self._group = self._kv_cache_group(kv_cache_config)
        self._block_size = self._group.kv_cache_spec.block_size
        rank = 0 if role == KVConnectorRole.SCHEDULER else self._tp_rank()
        self._spec = self._kvport_spec(vllm_config, kv_cache_config, rank)
        self.geometry = OffloadGeometry.build(self.offloading_config, self._spec)
        self._scheduler: OffloadingScheduler | None = None
        self._worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = OffloadingScheduler(
                self.offloading_config, self.geometry, load=ktc.is_kv_consumer,
                store=ktc.is_kv_producer, num_workers=self._num_workers, sync_stores=True)
        else:
            self._worker = OffloadingConnectorWorker(self.offloading_config, sync_stores=True,
                                                     wait_sync_loads=True)
        self._step = 0
        self._hit_sources: dict[str, dict[CacheHitSource, int]] = {}
        self._stats_delta = StatsDelta()

    # ---- construction helpers --------------------------------------------------------------

    @staticmethod
    def _kv_cache_group(kv_cache_config: KVCacheConfig) -> Any:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"kvport.vllm OffloadingConnector: the model has {len(groups)} KV "
                             f"cache groups (a hybrid model); kvport offloads models with one")
        return groups[0]

    @staticmethod
    def _tp_rank() -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            return int(get_tensor_model_parallel_rank())
        except AssertionError:  # no tensor-parallel group: a single worker
            return 0

    def _kvport_spec(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                     rank: int) -> KVCacheSpec:
        spec = self._group.kv_cache_spec
        dtype = str(spec.dtype).removeprefix("torch.")
        layout = f"{LAYOUT}|tp{rank}of{self._num_workers}"
        kvport = KVCacheSpec(
            num_blocks=kv_cache_config.num_blocks, block_size=spec.block_size,
            num_layers=len(self._group.layer_names), num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size, dtype=dtype, layout=layout)
        if spec.page_size_bytes * kvport.num_layers != kvport.block_bytes:
            raise ValueError(f"kvport.vllm OffloadingConnector: vLLM's KV pages of "
                             f"{spec.page_size_bytes} bytes are not {kvport.num_layers} layers' "
                             f"K and V ({kvport.block_bytes // kvport.num_layers} bytes); "
                             f"padded or quantized KV pages are not supported")
        root = b""
        if self.offloading_config.tiers:  # shared with other processes: names the model
            root = hash_root(namespace_identity(vllm_config, self.offloading_config), dtype,
                             spec.block_size, layout,
                             vllm_config.cache_config.prefix_caching_hash_algo)
        return dataclasses.replace(kvport, hash_root=root)

    @property
    def scheduler_half(self) -> OffloadingScheduler:
        assert self._scheduler is not None, "kvport.vllm: not the scheduler-side connector"
        return self._scheduler

    @property
    def worker_half(self) -> OffloadingConnectorWorker:
        assert self._worker is not None, "kvport.vllm: not the worker-side connector"
        return self._worker

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: False. The worker half keeps views of the KV caches and copies from
        them on its own threads; following a remap of their memory is not implemented."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache, not a hand-off; a store lost to a preemption is a later miss."""
        return False

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_half.get_num_new_matched_tokens(
            RequestAdapter(request, self._block_size), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        half = self.scheduler_half
        view = RequestAdapter(request, self._block_size)
        half.update_state_after_alloc(view, group0(blocks.get_block_ids()), num_external_tokens)
        split = half.take_hit_split(view.request_id)
        # vLLM has no source for a remote store: Redis hits are EXTERNAL_UNSPECIFIED.
        sources = {CacheHitSource.HOST: split.get(HOST, 0),
                   CacheHitSource.DISK: split.get(DISK, 0),
                   CacheHitSource.EXTERNAL_UNSPECIFIED: split.get(REDIS, 0)}
        self._hit_sources[view.request_id] = {s: n for s, n in sources.items() if n > 0}

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Host hits as HOST, hits promoted from disk as DISK, from Redis as
        EXTERNAL_UNSPECIFIED (vLLM has no source for a remote store)."""
        sources = self._hit_sources.pop(str(request.request_id), {})
        if sum(sources.values()) != num_external_tokens:  # vLLM then reports it unspecified
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata:
        view = adapt_scheduler_output(scheduler_output, self._step)
        self._step += 1
        return OffloadingMetadata(self.scheduler_half.build_connector_meta(view),
                                  did_forward=view.total_num_scheduled_tokens > 0)

    def update_connector_output(self, connector_output: VllmKVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        assert isinstance(meta, OffloadingWorkerMeta), f"not kvport's worker metadata: {meta!r}"
        self.scheduler_half.update_connector_output(KVConnectorOutput(worker_meta=meta.inner))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(False, None): the blocks are freed now; with synchronous stores no job touches them
        after their step."""
        self._hit_sources.pop(str(request.request_id), None)
        held = self.scheduler_half.request_finished(RequestAdapter(request, self._block_size))
        assert not held, "a request held under synchronous stores"
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for e in self.scheduler_half.take_events():
            medium = MEDIUMS.get(e.medium, e.medium)
            hashes = list(e.block_hashes)
            if e.removed:
                out.append(BlockRemoved(block_hashes=hashes, medium=medium))
            else:
                out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                       block_size=self.geometry.offload_tokens, lora_id=None,
                                       medium=medium, lora_name=None))
        return out

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM's engine-core loop stepping while jobs (write-throughs) are unreported."""
        return self.scheduler_half.has_pending_work()

    def reset_cache(self) -> bool | None:
        """Drops the host tier, not the disk tier (other engines may share its directory)."""
        return self.scheduler_half.reset_cache()

    # ---- stats (vLLM calls get_kv_connector_stats on both sides, every step) -----------------

    def get_kv_connector_stats(self) -> KvportStats | None:
        """Scheduler side: the increase of kvport's counters since the last call (the workers'
        tier counters included: they arrive with the worker metadata). Worker side: None."""
        if self._scheduler is None:
            return None
        stats = KvportStats(data=self._stats_delta.take(flatten(self._scheduler.metrics())))
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvportStats:
        return KvportStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvportPromMetrics:
        return KvportPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pool = engine_pool(kv_caches, self._group.layer_names, self._spec.num_blocks)
        self.worker_half.register_kv_caches(pool, self.geometry)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker_half.handle_preemptions(_inner(kv_connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_half.start_load_kv(_inner(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: every load is asynchronous and complete before its request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """No-op: stores copy whole blocks (every layer) after the forward, in get_finished."""

    def wait_for_save(self) -> None:
        """No-op: stores are submitted in get_finished, which vLLM calls on every step."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        did_forward = isinstance(meta, OffloadingMetadata) and meta.did_forward
        sending, recving = self.worker_half.get_finished(
            _inner(meta) if meta is not None else None, did_forward)
        assert not sending, f"requests held under synchronous stores: {sending}"
        return None, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> OffloadingWorkerMeta | None:
        meta = self.worker_half.build_worker_meta()
        return OffloadingWorkerMeta(meta) if meta is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()


def _inner(meta: Any) -> OffloadingConnectorMetadata:
    if not isinstance(meta, OffloadingMetadata):
        raise TypeError(f"kvport.vllm: expected kvport's OffloadingMetadata, got "
                        f"{type(meta).__name__}")
    return meta.inner
