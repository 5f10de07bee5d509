"""vLLM's objects read as kvport's connector views, the pool geometry, and the namespace of a
persistent tier (what vLLM's block hashes lack)."""

from __future__ import annotations

import dataclasses
import typing

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness import BLOCK_SIZE, kv_cache_config, offload_extra, vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvport.connectors.views import RequestView, SchedulerOutputView
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.vllm import stats
from kvport.vllm.connector import OffloadingConnector
from kvport.vllm.objects import (
    RequestAdapter, adapt_scheduler_output, hash_root, hashes_are_stable, kvport_view,
)


def test_a_resumed_request_is_new_with_its_whole_block_table() -> None:
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="n", block_ids=([1, 2],), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["c", "r"], resumed_req_ids={"r"}, new_block_ids=[None, ([5, 6, 7],)],
            num_computed_tokens=[33, 0]),
        num_scheduled_tokens={"n": 20, "c": 1, "r": 40}, total_num_scheduled_tokens=61,
        preempted_req_ids=None, finished_req_ids={"f"})
    view = adapt_scheduler_output(so, step=4)
    assert isinstance(view, SchedulerOutputView)
    assert [(r.req_id, r.block_ids) for r in view.scheduled_new_reqs] == [("n", [1, 2]),
                                                                         ("r", [5, 6, 7])]
    assert [(r.req_id, r.new_block_ids) for r in view.scheduled_cached_reqs] == [("c", [])]
    assert view.preempted_req_ids == set() and view.step == 4


def test_a_request_reads_live_through_the_view() -> None:
    req = SimpleNamespace(request_id=7, prompt_token_ids=None, num_prompt_tokens=3,
                          num_tokens=3, num_computed_tokens=0, block_hashes=[],
                          all_token_ids=[1, 2, 3])
    view = RequestAdapter(req, BLOCK_SIZE)
    assert isinstance(view, RequestView) and view.request_id == "7"
    assert list(view.prompt_token_ids) == []  # prompt embeddings: no token ids
    req.block_hashes.append(b"h")
    assert list(view.block_hashes) == [b"h"]


def test_vllms_cpu_pages_are_kvports_pool_layout_without_a_copy() -> None:
    """[blocks, heads, block_size, 2 * head_dim], K of every token of a head, then V."""
    blocks, heads, block, dim = 5, 3, 4, 8
    storage = torch.arange(3 * blocks * heads * block * 2 * dim, dtype=torch.float32)
    layers = storage.view(3, blocks, heads, block, 2 * dim)
    view = kvport_view({f"l{i}": layers[i] for i in range(3)}, ["l0", "l1", "l2"], blocks)
    assert view.shape == (blocks, 3, 2, block, heads, dim)
    assert view.data_ptr() == storage.data_ptr()  # the same memory
    # K of token t, head h of layer i, block b: page (b, h), row t of the page's first half.
    pages = layers.view(3, blocks, heads, 2, block, dim)
    assert torch.equal(view[2, 1, 0, 3, 1], pages[1, 2, 1, 0, 3])
    assert torch.equal(view[4, 2, 1, 0, 2], pages[2, 4, 2, 1, 0])
    pool = EnginePool.of(view)  # the host tier copies each layer's page as it lies in memory
    assert len(pool.segments) == 3
    assert pool.segments[1].view(torch.float32)[2].tolist() == layers[1, 2].flatten().tolist()


def test_pools_with_k_and_v_first_are_two_segments_per_layer() -> None:
    storage = torch.zeros((3, 2, 10, 4, 1, 8))  # [2, blocks, block_size, heads, head_dim]
    kv_first = {f"l{i}": storage[i] for i in range(3)}
    assert len(EnginePool.of(kvport_view(kv_first, ["l0", "l1", "l2"], 10)).segments) == 6
    with pytest.raises(ValueError, match=r"shape \(3, 10, 4\).*not supported"):
        kvport_view({"l0": torch.zeros((3, 10, 4))}, ["l0"], 10)
    with pytest.raises(ValueError, match="lacks layers"):
        kvport_view(kv_first, ["l0", "lx"], 10)
    apart = {f"l{i}": torch.zeros((2, 10, 4, 1, 8)) for i in range(2)}  # two allocations
    with pytest.raises(ValueError, match="not at one stride in one allocation"):
        kvport_view(apart, ["l0", "l1"], 10)


def test_the_namespace_carries_what_vllms_hashes_lack(monkeypatch: pytest.MonkeyPatch) -> None:
    base = hash_root("checkpoint:abc", "float32", 128, "vllm-pages|tp0of1", "sha256")
    assert base != hash_root("checkpoint:abd", "float32", 128, "vllm-pages|tp0of1", "sha256")
    assert base != hash_root("checkpoint:abc", "bfloat16", 128, "vllm-pages|tp0of1", "sha256")
    assert base != hash_root("checkpoint:abc", "float32", 128, "vllm-pages|tp1of2", "sha256")
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    seeded = hash_root("checkpoint:abc", "float32", 128, "vllm-pages|tp0of1", "xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "2")
    assert seeded != hash_root("checkpoint:abc", "float32", 128, "vllm-pages|tp0of1", "xxhash")
    assert hashes_are_stable("xxhash") and hashes_are_stable("sha256")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert not hashes_are_stable("xxhash") and hashes_are_stable("sha256_cbor")


def test_a_disk_tier_with_process_random_hashes_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = vllm_config(offload_extra(disk_dir=tmp_path))
    config.cache_config.prefix_caching_hash_algo = "xxhash"
    with pytest.raises(ValueError, match=r"prefix_caching_hash_algo='xxhash'.*PYTHONHASHSEED"):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(16))
    OffloadingConnector(vllm_config(offload_extra()), KVConnectorRole.SCHEDULER,
                        kv_cache_config(16))  # no disk tier: the host tier is per process


def test_bad_extra_config_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['cpu_byts'\]"):
        OffloadingConnector(vllm_config({"cpu_byts": 1}), KVConnectorRole.SCHEDULER,
                            kv_cache_config(16))
    with pytest.raises(ValueError, match="'record_trace'.*remove it"):
        OffloadingConnector(vllm_config({"cpu_bytes_to_use": 1 << 20, "record_trace": "t.jsonl"}),
                            KVConnectorRole.SCHEDULER, kv_cache_config(16))


def test_every_prometheus_metric_has_its_documentation() -> None:
    """`vllm serve` builds every family at start: a name without its help text stops it."""
    from kvport.vllm.metric_names import DOC

    assert {m.name for m in stats.METRICS} - set(DOC) == set()


def test_every_prometheus_metric_names_a_field_of_the_connectors_metrics() -> None:
    """A renamed field fails here, instead of silently dropping its Prometheus metric."""
    from kvport.connectors.offloading import metrics

    from kvport.connectors.offloading.mediums import DISK, HOST, REDIS
    from kvport.connectors.offloading.scheduler import decisions
    from kvport.vllm.metric_names import HISTOGRAM, OBSERVATIONS

    sections = typing.get_type_hints(metrics.ConnectorMetrics)
    measured = {decisions.LOOKUP_CALL, decisions.STORE_BYTES, decisions.LOAD_BYTES,
                decisions.ALLOCATION_BLOCKS, *map(decisions.lookup_seconds, (HOST, DISK, REDIS))}
    for m in stats.METRICS:
        section, field = m.path
        if m.kind == HISTOGRAM:
            assert section == OBSERVATIONS and field in measured and m.buckets, m
            continue
        assert section in sections, f"{m.name}: ConnectorMetrics has no section {section!r}"
        record = next(t for t in typing.get_args(sections[section]) or (sections[section],)
                      if dataclasses.is_dataclass(t))
        names = {f.name for f in dataclasses.fields(record)}
        assert field in names, f"{m.name}: {record.__name__} has no field {field!r}"


def test_flatten_reads_each_metric_from_the_record() -> None:
    from kvport.connectors.offloading import metrics

    record = metrics.ConnectorMetrics(
        16, metrics.HostMetrics(bytes_stored=5, hit_tokens=3), metrics.RequestMetrics(),
        metrics.WorkerMetrics(num_late_loads=2),
        redis=metrics.RedisMetrics(lookup_round_trips=7, round_trips=1))
    flat = stats.flatten(record)
    assert flat["host.bytes_stored"] == 5 and flat["host.hit_tokens"] == 3
    assert flat["worker.num_late_loads"] == 2
    assert flat["redis.lookup_round_trips"] == 7 and flat["redis.round_trips"] == 1
    assert not any(key.startswith("disk.") for key in flat)  # no disk tier: absent
