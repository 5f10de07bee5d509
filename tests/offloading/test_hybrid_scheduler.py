"""The scheduler half on two KV cache groups (a sliding window of 9 tokens, then full attention;
blocks of 4 tokens, so a hit needs the 2 blocks before it in the sliding group), driven with
hand-built scheduler outputs: per-group keys, the hit every group can load, the stores a
sliding group keeps, and the flush of a store whose blocks left the window."""

from __future__ import annotations

import pytest

from kvport import SamplingParams
from kvport.connectors.base import KVCacheGroupSpec, KVCacheSpec, KVConnectorOutput
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.metadata import JobResult, OffloadingWorkerMetadata
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler
from kvport.connectors.views import CachedRequestRecord, NewRequestRecord, SchedulerOutputRecord
from kvport.engine.request import Request

BLOCK = 4
SPEC = KVCacheSpec(num_blocks=64, block_size=BLOCK, num_layers=2, num_kv_heads=1, head_dim=8,
                   dtype="float32", layout="blocks-layers-kv-tokens-heads-dim", hash_root=b"r",
                   groups=(KVCacheGroupSpec((0,), 9), KVCacheGroupSpec((1,), None)))
PARAMS = SamplingParams(max_tokens=4)


def half(**config: object) -> OffloadingScheduler:
    config.setdefault("cpu_bytes_to_use", 1 << 20)
    cfg = OffloadingConfig(**config)  # type: ignore[arg-type]
    return OffloadingScheduler(cfg, OffloadGeometry.build(cfg, SPEC))


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, PARAMS, frozenset(), BLOCK, b"r")


def tables(first: int, n: int) -> tuple[list[int], list[int]]:
    """Block tables of n blocks: the sliding group's from `first`, the full group's after."""
    return list(range(first, first + n)), list(range(first + 100, first + 100 + n))


def stored_keys(sched: OffloadingScheduler, req: Request, n: int) -> None:
    """Run a request's n-block prefill in one step and report its stores copied."""
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, tables(0, n), 0)
    meta = sched.build_connector_meta(SchedulerOutputRecord(
        [NewRequestRecord(req.request_id, tables(0, n), 0)], [],
        {req.request_id: req.num_tokens}, req.num_tokens, set(), set(), 0))
    for job in meta.stores:
        sched.update_connector_output(KVConnectorOutput(worker_meta=OffloadingWorkerMetadata(
            [JobResult(job.job_id, True)])))
    sched.request_finished(req)


def groups_of(sched: OffloadingScheduler) -> list[int]:
    counts = [0, 0]
    for key, _ in sched.manager._blocks():
        counts[int.from_bytes(key[-4:], "little")] += 1
    return counts


def test_a_sliding_group_stores_the_windows_a_hit_can_use() -> None:
    # 41 tokens, 10 blocks: the prompt's last hit boundary is 10 blocks, and the default
    # interval is 4 windows = 36 tokens = 9 blocks; the windows before 9 and 10 are 7, 8, 9.
    sched = half()
    stored_keys(sched, request("a", list(range(41))), 10)
    assert groups_of(sched) == [3, 10]
    dense = half(sliding_store_interval=0)
    stored_keys(dense, request("a", list(range(41))), 10)
    assert groups_of(dense) == [10, 10]


def test_a_hit_ends_where_every_group_holds_its_blocks() -> None:
    sched = half(sliding_store_interval=0, sync_host_loads=True)
    stored_keys(sched, request("a", list(range(41))), 10)
    same = request("b", list(range(41)))
    assert sched.get_num_new_matched_tokens(same, 0) == (40, False)
    # Drop the sliding group's block 8: a hit at 10 or 9 would need it; 8 needs 6 and 7.
    key8 = next(k for k, _ in sched.manager._blocks() if k.startswith(same.block_hashes[8])
                and k.endswith((0).to_bytes(4, "little")))
    sched.manager._remove(key8, evicted=True)
    assert sched.get_num_new_matched_tokens(same, 0) == (32, False)
    sched.update_state_after_alloc(same, tables(20, 11), 32)
    (load,) = sched.build_connector_meta(SchedulerOutputRecord(
        [NewRequestRecord("b", tables(20, 11), 32)], [], {"b": 9}, 9, set(), set(), 1)).loads
    # Every full block before 8, and the sliding group's 6 and 7.
    assert sorted(load.dst.block_ids) == [26, 27, *range(120, 128)]


def test_a_store_reading_blocks_the_window_left_is_flushed() -> None:
    sched = half(sliding_store_interval=0)
    req = request("a", list(range(41)))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, tables(0, 4), 0)
    meta = sched.build_connector_meta(SchedulerOutputRecord(
        [NewRequestRecord("a", tables(0, 4), 0)], [], {"a": 16}, 16, set(), set(), 0))
    (store,) = meta.stores
    assert meta.jobs_to_flush == set()
    # Next chunk, 16 tokens computed: the window (9) reads back to token 8, so the engine freed
    # sliding blocks 0 and 1, which the store (not copied yet) reads.
    req.num_computed_tokens = 16
    meta = sched.build_connector_meta(SchedulerOutputRecord(
        [], [CachedRequestRecord("a", ([4, 5, 6], [104, 105, 106]), 16)], {"a": 12}, 12,
        set(), set(), 1))
    assert meta.jobs_to_flush == {store.job_id}
    # The next store: blocks 4-6 of both groups.
    (second,) = meta.stores
    assert second.src.block_ids == [4, 104, 5, 105, 6, 106]


def test_a_deferred_store_skips_blocks_the_window_left() -> None:
    # Four host slots (a block of one layer is 256 bytes): the first chunk's store takes blocks
    # 0 and 1 of both groups; blocks 2 and 3 wait for slots. When they get them, the window has
    # moved past sliding blocks 2-4 (28 tokens computed reads back to token 20): the engine
    # freed them, so only the full group's are stored (the four slots' worth: full 2-4, then
    # block 5 of both groups would be five).
    sched = half(sliding_store_interval=0, cpu_bytes_to_use=4 * 256)
    req = request("a", list(range(41)))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, tables(0, 4), 0)
    (store,) = sched.build_connector_meta(SchedulerOutputRecord(
        [NewRequestRecord("a", tables(0, 4), 0)], [], {"a": 16}, 16, set(), set(), 0)).stores
    assert store.src.block_ids == [0, 100, 1, 101]
    sched.update_connector_output(KVConnectorOutput(worker_meta=OffloadingWorkerMetadata(
        [JobResult(store.job_id, True)])))
    meta = sched.build_connector_meta(SchedulerOutputRecord(
        [], [CachedRequestRecord("a", ([4, 5, 6], [104, 105, 106]), 28)], {"a": 4}, 4,
        set(), set(), 1))
    (later,) = meta.stores
    assert later.src.block_ids == [102, 103, 104]


def test_several_groups_refuse_a_larger_offload_block() -> None:
    cfg = OffloadingConfig(cpu_bytes_to_use=1 << 20, block_size=2 * BLOCK)
    with pytest.raises(ValueError, match="block_size=8 with 2 KV cache groups"):
        OffloadGeometry.build(cfg, SPEC)
