"""A store's stages: its copy reports in the step that computed its blocks when the worker runs
with sync_stores (as inside vLLM, whose in-process loop stops stepping when no request is left),
and its write-through to disk starts from the worker, with no further step of the scheduler. A
stopped engine therefore loses no store. With several workers (tensor-parallel ranks), a stage is
done when every worker reported it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from offload_utils import (
    assert_nothing_leaked, make_llm, offload_config, offloading_half, prompts, step_until,
)

from kvport import LLM, SamplingParams
from kvport.connectors.base import KVCacheSpec, KVConnectorOutput
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import DISK, ENGINE, HOST
from kvport.connectors.offloading.metadata import JobResult, OffloadingWorkerMetadata, Stage
from kvport.connectors.offloading.scheduler import OffloadingScheduler
from view_records import ViewNewRequest, ViewRequest, ViewSchedulerOutput

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def controlled(kind: str, disk_dir: Path | None = None) -> tuple[LLM, Any]:
    ktc = offload_config(disk_dir=disk_dir)
    ktc.update(kv_connector=kind, kv_connector_module_path="controlled_transfers")
    llm = make_llm(ktc)
    return llm, llm.engine.runner.driver.connector.worker_half.transfers  # type: ignore[union-attr]


@pytest.mark.parametrize("sync", [False, True])
def test_sync_stores_report_in_the_step_that_computed_them(sync: bool) -> None:
    kind = "SyncStoresControlledConnector" if sync else "ControlledOffloadingConnector"
    llm, transfers = controlled(kind)
    transfers.hold((ENGINE, HOST))
    llm.engine.add_request("A", prompts(1)[0][:40], PARAMS)  # 5 full offload blocks
    llm.engine.step()  # the prefill computes them and plans their store
    stored = offloading_half(llm).manager.stats.num_stored_blocks
    assert stored == (5 if sync else 0)
    assert bool(transfers.in_flight((ENGINE, HOST))) is not sync
    transfers.release_all()
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert_nothing_leaked(llm)


def test_an_engine_that_stops_stepping_loses_no_store(tmp_path: Path) -> None:
    """Step only while requests are unfinished (vLLM's in-process LLM loop), never again:
    every full block is ready in the host tier, and after shutdown on disk for a new engine."""
    ps = [p[:40] for p in prompts(4, seed=4)[::2]]  # two prompts sharing no block
    ktc = offload_config(disk_dir=tmp_path)
    ktc.update(kv_connector="SyncStoresOffloadingConnector",
               kv_connector_module_path="controlled_transfers")
    llm = make_llm(ktc)
    reqs = [llm.engine.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(ps)]
    step_until(llm, lambda: all(r.is_finished for r in reqs))
    half = offloading_half(llm)
    for r in reqs:
        keys = half.geometry.keys(r.block_hashes[:40 // 4])
        assert half.manager.lookup(keys) == len(keys) == 5  # ready, with no further step
    llm.shutdown()  # lets the write-throughs finish
    fresh = make_llm(offload_config(disk_dir=tmp_path))
    outs = fresh.generate(ps, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [list(r.output_token_ids) for r in reqs]
    assert offloading_half(fresh).stats.num_disk_hit_tokens == 2 * 40  # every block
    assert_nothing_leaked(fresh)


def test_shutdown_lets_the_write_throughs_finish(tmp_path: Path) -> None:
    llm, transfers = controlled("SyncStoresControlledConnector", disk_dir=tmp_path)
    transfers.hold((HOST, DISK))
    req = llm.engine.add_request("A", prompts(1)[0][:40], PARAMS)
    step_until(llm, lambda: req.is_finished)
    assert len(transfers.in_flight((HOST, DISK))) == 1  # the write-through, held
    llm.shutdown()
    assert not transfers.in_flight((HOST, DISK))
    assert len(list(tmp_path.rglob("*.kvb"))) == 5  # every offload block reached the disk


# ---- several workers, at the scheduler half ---------------------------------------------------


def two_worker_half(disk_dir: Path | None) -> OffloadingScheduler:
    extra: dict[str, Any] = {"cpu_bytes_to_use": 1 << 20, "block_size": 4}
    if disk_dir is not None:
        extra["secondary_tiers"] = [{"type": "disk", "root_dir": str(disk_dir), "max_bytes": 1 << 30}]
    config = OffloadingConfig(**extra)
    spec = KVCacheSpec(num_blocks=16, block_size=4, num_layers=2, num_kv_heads=1, head_dim=8,
                       dtype="float32", layout="test", hash_root=b"root")
    return OffloadingScheduler(config, OffloadGeometry.build(config, spec), num_workers=2)


def report(half: OffloadingScheduler, *results: JobResult) -> None:
    half.update_connector_output(KVConnectorOutput(worker_meta=OffloadingWorkerMetadata(
        list(results))))


@pytest.mark.parametrize("disk", [False, True])
def test_a_store_is_done_when_every_worker_reported_it(tmp_path: Path, disk: bool) -> None:
    half = two_worker_half(tmp_path if disk else None)
    req = ViewRequest("A", list(range(9)), 4)  # 2 full blocks
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    half.update_state_after_alloc(req, [3, 4, 5], 0)
    meta = half.build_connector_meta(ViewSchedulerOutput([ViewNewRequest("A", [3, 4, 5], 0)], {"A": 9}))
    (store,) = meta.stores
    keys = req.block_hashes
    report(half, JobResult(store.job_id, False, [1]))  # rank 0: block 1 failed
    assert half.manager.lookup(keys) == 0  # rank 1 has not reported: nothing is ready
    report(half, JobResult(store.job_id, True))  # rank 1: all written
    assert half.manager.lookup(keys) == 1  # block 1 failed on one rank: not ready anywhere
    assert half._jobs.readers_of({3, 4}) == set()  # the fence no longer waits for it
    if disk:
        # rank 1 may still be writing block 1's slot to disk: it stays reserved, block 0 pinned
        assert half.manager.num_being_written == 1 and half.manager.num_pinned == 1
        report(half, JobResult(store.job_id, True, stage=Stage.WRITE))
        assert half.manager.num_being_written == 1  # one worker's write is still running
        report(half, JobResult(store.job_id, True, stage=Stage.WRITE))
    assert half.manager.num_being_written == 0 and half.manager.num_pinned == 0
    half.request_finished(req)
    half.check_no_leaks()


def test_a_load_is_done_when_every_worker_reported_it() -> None:
    half = two_worker_half(None)
    req = ViewRequest("A", list(range(9)), 4)
    half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, [3, 4, 5], 0)
    (store,) = half.build_connector_meta(ViewSchedulerOutput([ViewNewRequest("A", [3, 4, 5], 0)], {"A": 9})).stores
    report(half, JobResult(store.job_id, True), JobResult(store.job_id, True))
    half.request_finished(req)
    again = ViewRequest("B", list(range(9)), 4)
    assert half.get_num_new_matched_tokens(again, 0) == (8, False)  # host hits: a synchronous load
    half.update_state_after_alloc(again, [6, 7, 8], 8)
    (load,) = half.build_connector_meta(ViewSchedulerOutput([], {})).loads
    report(half, JobResult(load.job_id, True))
    assert half.manager.num_pinned == 2  # rank 1 may still be copying from the slots
    report(half, JobResult(load.job_id, False, [7]))
    assert half.manager.num_pinned == 0 and half.stats.num_failed_loads == 1
    half.request_finished(again)
    half.check_no_leaks()
