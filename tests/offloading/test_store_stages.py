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
    assert_nothing_leaked, make_llm, offload_block_bytes, offload_config, offloading_half, prompts,
    step_until,
)

from kvport import LLM, SamplingParams
from kvport.connectors.base import KVCacheSpec, KVConnectorOutput
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.mediums import DISK, ENGINE, HOST
from kvport.connectors.offloading.metadata import JobResult, OffloadingWorkerMetadata, Stage
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler
from kvport.connectors.offloading.scheduler.stores import WRITE_THROUGH_SHARE
from view_records import ViewNewRequest, ViewRequest, ViewSchedulerOutput, chain_hashes

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def controlled(kind: str, disk_dir: Path | None = None, **extra: Any) -> tuple[LLM, Any]:
    ktc = offload_config(disk_dir=disk_dir, **extra)
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


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_tokens, whole", [(19, 6), (18, 5)])
def test_the_block_a_final_step_completes_is_stored(async_scheduling: bool, max_tokens: int,
                                                    whole: int) -> None:
    """A 30-token prompt and 19 tokens: the final step computes token 47, completing offload
    block 5 (tokens 40-47). Under async scheduling that step was scheduled before token 47 was
    sampled, so no hash named the block then: it is offered when the request finishes, and the
    request's blocks are held until the copy ended. With 18 tokens token 47 is the last sampled
    one, never computed: its block is not stored."""
    llm = make_llm(offload_config(), async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = llm.engine.add_request("A", prompts(1)[0][:30], params)
    step_until(llm, lambda: not llm.engine.has_pending_work())
    half = offloading_half(llm)
    keys = half.geometry.keys(req.block_hashes[:48 // 4])
    assert half.manager.lookup(keys) == whole
    assert half.stats.num_final_block_stores == (whole == 6 and async_scheduling)
    assert_nothing_leaked(llm)


def test_shutdown_lets_the_write_throughs_finish(tmp_path: Path) -> None:
    llm, transfers = controlled("SyncStoresControlledConnector", disk_dir=tmp_path)
    transfers.hold((HOST, DISK))
    req = llm.engine.add_request("A", prompts(1)[0][:40], PARAMS)
    step_until(llm, lambda: req.is_finished)
    assert len(transfers.in_flight((HOST, DISK))) == 1  # the write-through, held
    llm.shutdown()
    assert not transfers.in_flight((HOST, DISK))
    assert len(list(tmp_path.rglob("*.kvb"))) == 5  # every offload block reached the disk


def test_shutdown_writes_through_a_copy_that_ended_after_the_last_step(tmp_path: Path) -> None:
    """kvport's engine runs without sync_stores: the last step's store copies may end after its
    last poll (Ctrl-C in generate(), a server stepping the engine itself). Shutdown polls them
    and writes them through before it stops."""
    llm, transfers = controlled("ControlledOffloadingConnector", disk_dir=tmp_path)
    transfers.hold((ENGINE, HOST))
    req = llm.engine.add_request("A", prompts(1)[0][:40], PARAMS)
    step_until(llm, lambda: req.is_finished)
    assert len(transfers.in_flight((ENGINE, HOST))) == 1  # the store's copy, held
    transfers.release_all()  # it ends now, and no step polls it
    worker = llm.engine.runner.driver.connector.worker_half  # type: ignore[union-attr]
    llm.shutdown()
    assert len(list(tmp_path.rglob("*.kvb"))) == 5  # every offload block reached the disk
    assert worker.stats.snapshot().num_dropped_at_shutdown == 0


def test_shutdown_drops_what_runs_past_its_deadline_and_says_what(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    llm, transfers = controlled("SyncStoresControlledConnector", disk_dir=tmp_path,
                                shutdown_timeout_s=0.3)
    transfers.hold((HOST, DISK))
    req = llm.engine.add_request("A", prompts(1)[0][:40], PARAMS)
    step_until(llm, lambda: req.is_finished)
    worker = llm.engine.runner.driver.connector.worker_half  # type: ignore[union-attr]
    llm.shutdown()  # the write-through stays held: a disk that does not answer
    assert worker.stats.snapshot().num_dropped_at_shutdown == 1
    assert "shutdown dropped 1 transfers" in caplog.text and "write to DISK" in caplog.text
    assert not list(tmp_path.rglob("*.kvb"))


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
    assert half._reqs["A"].engine_jobs() == set()  # no longer reads the engine's blocks
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


def test_block_hashes_of_another_block_size_are_neither_loaded_nor_stored() -> None:
    """A hash per 2 tokens for KV blocks of 4: key i would name a shorter prefix than the bytes
    stored under it, so the request is left alone (and counted), never stored or loaded."""
    config = OffloadingConfig(cpu_bytes_to_use=1 << 20, block_size=4)
    spec = KVCacheSpec(num_blocks=16, block_size=4, num_layers=2, num_kv_heads=1, head_dim=8,
                       dtype="float32", layout="test", hash_root=b"root")
    half = OffloadingScheduler(config, OffloadGeometry.build(config, spec))
    tokens = list(range(9))
    for rid, hashes in (("A", chain_hashes(tokens, 2)), ("B", chain_hashes(tokens, 4))):
        req = ViewRequest(rid, tokens, 4, block_hashes=hashes)
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)
        half.update_state_after_alloc(req, [3, 4, 5], 0)
        meta = half.build_connector_meta(ViewSchedulerOutput([ViewNewRequest(rid, [3, 4, 5], 0)],
                                                             {rid: 9}))
        assert len(meta.stores) == (0 if rid == "A" else 1)
    assert half.stats.num_mismatched_hashes == 1



def test_write_throughs_behind_a_stuck_tier_leave_host_room_for_new_stores(tmp_path: Path) -> None:
    """A disk that takes no write: stores writing through hold at most WRITE_THROUGH_SHARE of
    the host slots; later stores stay in host memory only (counted), and hits still come."""
    slots = 24
    llm, transfers = controlled("ControlledOffloadingConnector", disk_dir=tmp_path,
                                cpu_bytes=slots * offload_block_bytes())
    transfers.hold((HOST, DISK))
    ps = prompts(6, seed=3)
    llm.generate(ps, PARAMS, use_tqdm=False)
    half = offloading_half(llm)
    assert 0 < half.manager.num_pinned <= slots * WRITE_THROUGH_SHARE
    assert half.stats.num_skipped_write_throughs > 0
    assert half.manager.stats.num_rejected_stores == 0
    llm.reset_prefix_cache()
    cached = [o.num_cached_tokens for o in llm.generate(ps[-2:], PARAMS, use_tqdm=False)]
    assert min(cached) > 0  # the last stores, kept in host memory only, are hits
    transfers.release_all()
    step_until(llm, lambda: half.manager.num_pinned == 0)  # the writes report in a step
    assert_nothing_leaked(llm)
