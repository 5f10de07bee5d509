"""OffloadingConnector races that real memory copies never lose, driven one by one through the
engine with a transfer tier the test controls (controlled_transfers): a store still in flight
when its blocks are handed out again (after a finish, after a preemption), a request re-admitted
while its own stores are in flight, a hit on keys another request is promoting from disk, a
write-through in flight when its slots are wanted again.

Each scenario checks the guard's outcome, not its mechanism: no transfer read bytes that changed
after it was submitted (`torn`), greedy output equal to no connector (also when the stored KV is
loaded back), and nothing leaked. Each fails when the guard is removed (tools/mutation_check.py).
The scenarios with a Redis tier run against a real redis-server (tests/redis_fixtures.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from controlled_transfers import ControlledTransfers
from kvport import LLM, SamplingParams
from kvport.connectors.offloading.mediums import DISK, ENGINE, HOST, REDIS
from kvport.connectors.offloading.worker.half import Stage, TransferKey
from kvport.engine.request import Request, RequestStatus
from offload_utils import (
    BLOCK_SIZE, assert_nothing_leaked, make_llm, offload_block_bytes, offload_config,
    offloading_half, prompts, run_bounded, step_until, worker_half,
)
from redis_fixtures import RedisServer


def controlled_llm(extra: dict[str, Any] | None = None, disk_dir: Path | None = None,
                   redis: dict[str, Any] | None = None,
                   **kwargs: Any) -> tuple[LLM, ControlledTransfers]:
    ktc = offload_config(disk_dir=disk_dir, redis=redis, **(extra or {}))
    ktc["kv_connector"] = "ControlledOffloadingConnector"
    ktc["kv_connector_module_path"] = "controlled_transfers"
    llm = make_llm(ktc, **kwargs)
    transfers = worker_half(llm).transfers
    assert isinstance(transfers, ControlledTransfers), transfers
    return llm, transfers


def reference(ps: list[list[int]], params: SamplingParams, **kwargs: Any) -> list[list[int]]:
    outs = make_llm(enable_prefix_caching=False, **kwargs).generate(ps, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def release_and_finish(llm: LLM, transfers: ControlledTransfers) -> None:
    """Release every held transfer, run the engine dry, and check the scenario left nothing."""
    transfers.release_all()
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert [job.id for job in transfers.torn] == [], "a transfer read bytes changed under it"
    assert_nothing_leaked(llm)


def two_prompts(seed: int, length: int = 40) -> list[list[int]]:
    """Two prompts sharing no block (prompts() pairs share a 40-token prefix)."""
    ps = prompts(4, seed=seed)
    return [ps[0][:length], ps[2][:length]]


def held_ids(llm: LLM) -> list[str]:
    return llm.engine.scheduler.xfer.held_request_ids


def test_a_finished_requests_blocks_are_held_while_its_stores_read_them() -> None:
    # 16 blocks: R (40 prompt tokens, 6 decoded) leaves 4 never used. It finishes with its
    # stores in flight: the engine holds its blocks (request_finished answered True) until the
    # worker reports the stores' copies ended, so Q, which needs 10 blocks, waits for them.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ps = two_prompts(seed=5)
    want = reference(ps, params, max_model_len=64, num_kv_blocks=16)
    llm, transfers = controlled_llm({"block_size": 4}, num_kv_blocks=16, max_model_len=64)
    transfers.hold((ENGINE, HOST))
    r = llm.engine.add_request("R", ps[0], params)
    step_until(llm, lambda: r.is_finished)
    assert transfers.in_flight((ENGINE, HOST)), "R's stores should still be in flight"
    q = llm.engine.add_request("Q", ps[1], params)
    for _ in range(3):
        llm.engine.step()
        assert held_ids(llm) == ["R"] and q.num_computed_tokens == 0  # Q waits for R's blocks
    release_and_finish(llm, transfers)
    assert [r.output_token_ids, q.output_token_ids] == want
    assert transfers.fenced == []  # nothing had to be flushed: the blocks were never reused
    llm.reset_prefix_cache()  # R's prompt comes back from the host tier, as R's store read it
    assert run_bounded(llm, ps[:1], params) == want[:1]
    assert offloading_half(llm).stats.num_host_hit_tokens > 0
    assert_nothing_leaked(llm)


def test_a_late_sync_loads_blocks_are_held_until_it_ends() -> None:
    """R's synchronous load is still in flight when its step gives up on it: R recomputes its
    blocks and finishes. Its blocks stay held until the late copy ended, so nothing can write
    them after another request computed them."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ps = two_prompts(seed=5)
    want = reference(ps, params, max_model_len=64, num_kv_blocks=16)
    llm, transfers = controlled_llm({"block_size": 4}, num_kv_blocks=16, max_model_len=64)
    assert run_bounded(llm, ps[:1], params) == want[:1]  # R's prompt into the host tier
    llm.reset_prefix_cache()
    transfers.hold((HOST, ENGINE))
    r = llm.engine.add_request("R", ps[0], params)
    step_until(llm, lambda: r.is_finished)  # the load is late: R recomputed its blocks
    assert transfers.in_flight((HOST, ENGINE)), "R's synchronous load should still be in flight"
    q = llm.engine.add_request("Q", ps[1], params)
    for _ in range(3):
        llm.engine.step()
        assert held_ids(llm) == ["R"] and q.num_computed_tokens == 0  # Q waits for R's blocks
    release_and_finish(llm, transfers)
    assert [r.output_token_ids, q.output_token_ids] == want
    assert offloading_half(llm).stats.num_sync_loads == 1


@dataclass
class Preempted:
    llm: LLM
    transfers: ControlledTransfers
    q: Request
    r: Request
    prompts: list[list[int]]
    want: list[list[int]]
    params: SamplingParams


def preempted_with_stores_in_flight() -> Preempted:
    """Q and R (40-token prompts, 24 decoded tokens each) fill a 24-block pool; R, the newer,
    is preempted when Q needs a block, and Q gets R's last block, whose store was planned in the
    step before. Every store is held until the test releases it."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ps = two_prompts(seed=3)
    want = reference(ps, params, max_model_len=96)
    llm, transfers = controlled_llm({"block_size": 4}, num_kv_blocks=24, max_model_len=96)
    transfers.hold((ENGINE, HOST))
    q = llm.engine.add_request("Q", ps[0], params)
    r = llm.engine.add_request("R", ps[1], params)
    step_until(llm, lambda: r.num_preemptions > 0)
    return Preempted(llm, transfers, q, r, ps, want, params)


def test_a_preempted_requests_blocks_wait_for_its_stores_in_flight() -> None:
    s = preempted_with_stores_in_flight()
    r_stores = set(offloading_half(s.llm)._reqs["R"].store_jobs)
    fenced = {job.id.job_id for job in s.transfers.fenced}  # type: ignore[attr-defined]
    step_until(s.llm, lambda: s.q.is_finished)
    release_and_finish(s.llm, s.transfers)
    assert [s.q.output_token_ids, s.r.output_token_ids] == s.want
    s.llm.reset_prefix_cache()  # the prompts come back from the host tier
    assert run_bounded(s.llm, s.prompts, s.params) == s.want
    assert_nothing_leaked(s.llm)
    # The race did happen: the preemption step's forward waited for R's stores, among them
    # the one planned in the step before (submitted in this very step): a preemption frees
    # blocks at once (no hold), so its jobs are flushed.
    assert fenced and fenced <= r_stores and max(r_stores) in fenced


def test_a_readmitted_request_waits_for_its_own_stores_then_loads_them() -> None:
    # R's stores were flushed at its preemption, but their results are reported in submission
    # order, behind Q's store that is still held: from the scheduler's side they are in flight.
    s = preempted_with_stores_in_flight()
    half = offloading_half(s.llm)
    step_until(s.llm, lambda: s.q.is_finished)
    assert half._reqs["R"].store_jobs, "R's stores should still be unreported"
    for _ in range(3):  # the pool has room now: only its own stores keep R waiting
        s.llm.engine.step()
    waited = s.r.status == RequestStatus.PREEMPTED
    release_and_finish(s.llm, s.transfers)
    assert [s.q.output_token_ids, s.r.output_token_ids] == s.want
    # R resumed from what its own stores wrote, loaded from the host tier, not recomputed.
    assert half.stats.num_load_jobs == 1 and half.stats.num_host_hit_tokens > 0
    assert waited and half.stats.num_busy_answers >= 3  # asked again while they were in flight


@dataclass
class Promoting:
    """A's load is promoting P's blocks from disk (held); B, with the same prompt, arrived
    after it."""

    llm: LLM
    transfers: ControlledTransfers
    a: Request
    b: Request
    promotion: Any  # the held DISK->HOST job
    want: list[int]
    clock: list[float]  # the inflight waits' time: the test moves it


def promoting(tmp_path: Path, wait_s: float, seed: int = 11) -> Promoting:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    p = prompts(1, seed=seed)[0]
    want = reference([p], params)[0]
    llm, transfers = controlled_llm({"inflight_wait_s": wait_s}, disk_dir=tmp_path)
    clock = [0.0]
    offloading_half(llm).waits.clock = lambda: clock[0]
    assert run_bounded(llm, [p], params) == [want]  # stored, and written through to disk
    assert llm.reset_prefix_cache(reset_connector=True)  # only the disk tier has P now
    transfers.hold((DISK, HOST))
    a = llm.engine.add_request("A", p, params)
    llm.engine.step()
    (promotion,) = transfers.in_flight((DISK, HOST))
    # The load's two stages run under one job id, told apart by a typed stage (no sign trick).
    load_id = offloading_half(llm)._reqs["A"].load_job
    assert promotion.id == TransferKey(load_id, Stage.PROMOTION, DISK)  # type: ignore[arg-type]
    b = llm.engine.add_request("B", p, params)
    return Promoting(llm, transfers, a, b, promotion, want, clock)


def test_a_hit_on_keys_being_promoted_waits_for_the_promotion_then_loads(
        tmp_path: Path) -> None:
    # B's hit run ends at keys A's promotion is writing to the host tier: B asks again each
    # step while it runs. Once A's load reported, A's blocks are in the engine's prefix cache:
    # B takes them from there (no copy of its own), and both prefill in one step.
    s = promoting(tmp_path, wait_s=30.0)
    half = offloading_half(s.llm)
    for _ in range(5):
        s.llm.engine.step()
    waited = s.b.status == RequestStatus.WAITING and half.waits.num_waits >= 5
    assert half.stats.num_load_jobs == 1  # A's only: B has no job of its own yet
    s.transfers.release(s.promotion)
    step_until(s.llm, lambda: s.b.status != RequestStatus.WAITING)
    forgotten = len(half.waits) == 0  # admitted: a later wait (after a preemption) starts anew
    step_until(s.llm, lambda: s.a.is_finished and s.b.is_finished)
    assert s.a.output_token_ids == s.want and s.b.output_token_ids == s.want
    assert s.a.num_cached_tokens >= 56 and s.b.num_cached_tokens >= 56  # neither computed P
    assert forgotten
    assert half.stats.num_load_jobs == 1 and half.stats.num_disk_hit_tokens >= 56  # A's load
    assert s.a.first_scheduled_time == s.b.first_scheduled_time  # prefilled in one step
    assert waited and half.waits.num_timeouts == 0
    release_and_finish(s.llm, s.transfers)


@pytest.mark.parametrize("wait_s", [0.0, 0.5])
def test_a_promotion_later_than_inflight_wait_s_is_computed(tmp_path: Path,
                                                            wait_s: float) -> None:
    # The same race with A's promotion held past B's wait (none at all with 0): B computes the
    # blocks while the promotion is still in flight, and gets no load error from A's job.
    s = promoting(tmp_path, wait_s)
    half = offloading_half(s.llm)
    for _ in range(3):
        s.llm.engine.step()
    waited = s.b.status == RequestStatus.WAITING and half.waits.num_waits >= 3
    s.clock[0] += wait_s + 0.01
    step_until(s.llm, lambda: s.b.is_finished)
    b_done_first = s.promotion.result is None and s.a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    release_and_finish(s.llm, s.transfers)
    m = s.llm.get_metrics()
    assert m["kv_transfer"]["num_invalid_blocks"] == 0
    assert m["connector"]["requests"]["num_failed_loads"] == 0
    assert s.b.output_token_ids == s.want and s.b.num_cached_tokens == 0  # computed, not loaded
    assert s.a.output_token_ids == s.want and s.a.num_cached_tokens >= 56  # loaded
    assert b_done_first and waited == (wait_s > 0)
    requests = m["connector"]["requests"]
    assert (requests["num_inflight_waits"] > 0) == (requests["num_inflight_timeouts"] == 1) \
        == (wait_s > 0), requests


def test_a_request_aborted_while_it_waits_leaves_nothing(tmp_path: Path) -> None:
    # B is aborted while it waits for A's promotion: its wait is dropped with it (the leak check
    # counts waits), and A still loads what it promoted.
    s = promoting(tmp_path, wait_s=30.0)
    half = offloading_half(s.llm)
    s.llm.engine.step()
    assert s.b.status == RequestStatus.WAITING and len(half.waits) == 1
    s.llm.engine.abort_requests(["B"])
    release_and_finish(s.llm, s.transfers)  # ends with the "nothing leaked" check
    assert s.a.output_token_ids == s.want and s.a.num_cached_tokens >= 56
    assert s.b.status == RequestStatus.FINISHED_ABORTED and half.waits.num_timeouts == 0


def test_a_failed_promotion_ends_the_wait_for_it(tmp_path: Path) -> None:
    # A is aborted while its promotion runs, and the promotion then fails: its keys leave the
    # host tier, so B stops waiting at once (its clock never moves, so not by the bound) and
    # promotes them from disk with a load of its own. Nothing of A's failure reaches B.
    s = promoting(tmp_path, wait_s=30.0, seed=23)
    half = offloading_half(s.llm)
    s.llm.engine.step()
    assert s.b.status == RequestStatus.WAITING and half.waits.num_waits >= 1
    s.llm.engine.abort_requests(["A"])
    s.llm.engine.step()
    assert s.b.status == RequestStatus.WAITING  # A's promotion is still being written
    s.transfers.gates[(DISK, HOST)].fail_next = 1
    s.transfers.hold((DISK, HOST), held=False)
    s.transfers.release(s.promotion)
    step_until(s.llm, lambda: s.b.is_finished)
    assert s.b.output_token_ids == s.want and s.b.num_cached_tokens >= 56
    assert half.stats.num_load_jobs == 2 and half.stats.num_failed_loads == 1
    assert half.stats.num_disk_hit_tokens >= 2 * 56  # A's hit, then B's own
    assert half.waits.num_timeouts == 0
    release_and_finish(s.llm, s.transfers)


def test_a_write_through_keeps_its_slots_until_it_reports(tmp_path: Path) -> None:
    # A 2-slot host tier: R1's two blocks are written through to disk (held) while R2 wants
    # slots for its own. The write-through's slots stay pinned, so R2's stores wait instead of
    # overwriting what the disk write still reads.
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ps = two_prompts(seed=7, length=20)  # two full offload blocks of 8 tokens each
    want = reference(ps, params)
    llm, transfers = controlled_llm({"cpu_bytes_to_use": 2 * offload_block_bytes()},
                                    disk_dir=tmp_path)
    transfers.hold((HOST, DISK))
    r1 = llm.engine.add_request("R1", ps[0], params)
    step_until(llm, lambda: r1.is_finished and bool(transfers.in_flight((HOST, DISK))))
    r2 = llm.engine.add_request("R2", ps[1], params)
    step_until(llm, lambda: r2.is_finished)
    raced = bool(transfers.in_flight((HOST, DISK)))  # R2 ran while R1's write was in flight
    release_and_finish(llm, transfers)
    assert [r1.output_token_ids, r2.output_token_ids] == want
    assert llm.reset_prefix_cache(reset_connector=True)  # R1's blocks come back from disk
    assert run_bounded(llm, ps[:1], params) == want[:1]
    assert offloading_half(llm).stats.num_disk_hit_tokens >= 16
    assert_nothing_leaked(llm)
    assert raced


def test_a_failed_promotion_is_reported_and_frees_its_slots(tmp_path: Path) -> None:
    # The promotion of P's blocks from disk fails as a whole: their engine blocks are reported as
    # load errors (the engine recomputes them), and their host slots are freed, not published.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    p = prompts(1, seed=13)[0]
    want = reference([p], params)
    llm, transfers = controlled_llm(disk_dir=tmp_path)
    assert run_bounded(llm, [p], params) == want
    assert llm.reset_prefix_cache(reset_connector=True)
    transfers.gates[(DISK, HOST)].fail_next = 1
    assert run_bounded(llm, [p], params) == want
    m = llm.get_metrics()
    assert m["kv_transfer"]["num_invalid_blocks"] > 0
    assert m["connector"]["requests"]["num_failed_loads"] == 1
    llm.reset_prefix_cache()  # what the host tier holds for P now is what the recompute stored
    assert run_bounded(llm, [p], params) == want
    assert offloading_half(llm).stats.num_host_hit_tokens >= 56
    release_and_finish(llm, transfers)


def test_slots_stay_pinned_until_every_lower_tiers_write_reported(
        tmp_path: Path, redis_server: RedisServer) -> None:
    # As above with disk and Redis below host: R1's disk write finishes, its Redis write is held.
    # The slots stay pinned until the Redis write too reported, so R2's stores wait instead of
    # overwriting what the Redis write still reads (a torn transfer otherwise).
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ps = two_prompts(seed=17, length=20)
    want = reference(ps, params)
    llm, transfers = controlled_llm({"cpu_bytes_to_use": 2 * offload_block_bytes()},
                                    disk_dir=tmp_path, redis={"url": redis_server.url})
    transfers.hold((HOST, REDIS))
    r1 = llm.engine.add_request("R1", ps[0], params)
    step_until(llm, lambda: r1.is_finished and bool(transfers.in_flight((HOST, REDIS))))
    assert not transfers.in_flight((HOST, DISK))  # the disk's write is done, Redis's is not
    r2 = llm.engine.add_request("R2", ps[1], params)
    step_until(llm, lambda: r2.is_finished)
    raced = bool(transfers.in_flight((HOST, REDIS)))
    release_and_finish(llm, transfers)
    assert [r1.output_token_ids, r2.output_token_ids] == want
    assert raced
    # R1's two blocks reached Redis whole; R2's found no free slot while R1's were pinned.
    assert redis_server.client().dbsize() == 2


def test_a_hit_from_disk_and_redis_fails_only_the_redis_blocks(
        tmp_path: Path, redis_server: RedisServer) -> None:
    # P's first blocks are on this machine's disk, all of them in Redis. One hit run promotes
    # from both tiers (disk first); the Redis promotion fails: exactly its blocks are load
    # errors (the engine recomputes from there), the disk ones are loaded, the output is equal.
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    p = prompts(1, seed=19)[0]
    want = reference([p], params)
    redis = {"url": redis_server.url}
    writer = make_llm(offload_config(redis=redis))  # another machine: Redis has every block
    assert run_bounded(writer, [p], params) == want
    writer.shutdown()
    local = make_llm(offload_config(disk_dir=tmp_path))  # this machine computed the first 24
    assert run_bounded(local, [p[:24]], SamplingParams(max_tokens=1, temperature=0.0)) != []
    local.shutdown()
    llm, transfers = controlled_llm(disk_dir=tmp_path, redis=redis)
    transfers.gates[(REDIS, HOST)].fail_next = 1
    assert run_bounded(llm, [p], params) == want
    req = offloading_half(llm).stats
    assert req.num_disk_hit_tokens == 24 and req.num_redis_hit_tokens >= 24, vars(req)
    assert req.num_failed_loads == 1
    m = llm.get_metrics()
    assert m["kv_transfer"]["num_invalid_blocks"] == req.num_redis_hit_tokens // BLOCK_SIZE, m
    release_and_finish(llm, transfers)


def disk_bytes(root: Path) -> int:
    """Bytes of the disk tier's run files (names of one run share its inode)."""
    return sum({p.stat().st_ino: p.stat().st_size for p in root.rglob("*.kvb")}.values())


def test_a_run_a_planned_promotion_reads_is_not_evicted_by_a_write_through(
        tmp_path: Path) -> None:
    # A's promotion of P from disk is planned and held. Q's write-through needs room on a disk
    # that holds P and little more: it may not evict P's run (skipped instead), so A's load
    # finds every entry when it runs.
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    p, q = two_prompts(seed=13)
    want = reference([p], params)
    first, _ = controlled_llm(disk_dir=tmp_path)
    assert run_bounded(first, [p], params) == want
    first.shutdown()
    size = disk_bytes(tmp_path)
    llm, transfers = controlled_llm({"disk_bytes": size * 3 // 2}, disk_dir=tmp_path)
    transfers.hold((DISK, HOST))
    a = llm.engine.add_request("A", p, params)
    llm.engine.step()
    assert len(transfers.in_flight((DISK, HOST))) == 1  # P's promotion, planned and held
    other = llm.engine.add_request("Q", q, params)
    step_until(llm, lambda: other.is_finished and not transfers.in_flight((HOST, DISK)))
    for _ in range(2):
        llm.engine.step()  # Q's write-through reports
    assert llm.get_metrics()["connector"]["disk"]["skipped_stores"] > 0  # Q's, not P's
    transfers.release_all()
    step_until(llm, lambda: a.is_finished)
    assert [list(a.output_token_ids)] == want
    assert offloading_half(llm).stats.num_failed_loads == 0 and a.num_cached_tokens >= 32
    release_and_finish(llm, transfers)


def test_a_promotion_only_queued_behind_a_stuck_job_gets_a_second_deadline(
        tmp_path: Path) -> None:
    # A promotion that never started (queued behind another job's stuck read) is not stuck
    # itself: at its deadline it gets a second one, and runs on the thread that replaced the
    # stuck one; only past that is it late (its blocks recomputed).
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    p = prompts(1, seed=11)[0]
    want = reference([p], params)
    llm, transfers = controlled_llm({"load_timeout_s": 5.0}, disk_dir=tmp_path)
    assert run_bounded(llm, [p], params) == want  # stored, and written through to disk
    assert llm.reset_prefix_cache(reset_connector=True)  # only the disk tier has P now
    worker, clock = worker_half(llm), [0.0]
    worker._deadlines._clock = lambda: clock[0]
    transfers.started = lambda job_ids: set()  # type: ignore[method-assign]  # all queued
    transfers.hold((DISK, HOST))
    a = llm.engine.add_request("A", p, params)
    llm.engine.step()  # its promotion: submitted, due at 5 s
    assert len(transfers.in_flight((DISK, HOST))) == 1
    clock[0] = 6.0
    llm.engine.step()
    assert worker.stats.snapshot().num_late_loads == 0  # only queued: a second deadline, at 11 s
    clock[0] = 12.0
    llm.engine.step()
    assert worker.stats.snapshot().num_late_loads == 1  # late now: recomputed
    release_and_finish(llm, transfers)
    assert [list(a.output_token_ids)] == want
