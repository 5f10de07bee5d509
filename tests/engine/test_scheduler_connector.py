"""The scheduler's connector paths, driven by the mock connector and the real worker driver:
sync and async loads, None retries, failed loads, delayed sends, aborts while loading, stray
completions. The fake model's token depends only on the sequence length, so every path must
produce the same tokens as a run without a connector. Every test ends with nothing leaked."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import (
    FakeWorker, assert_scheduler_empty, make_request, make_scheduler, mock_connector_config,
)

from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorOutput
from kvport.engine.connector_setup import trace_header
from kvport.engine.request import RequestStatus
from kvport.engine.scheduler import Scheduler
from kvport.engine.step import ModelRunnerOutput
from kvport.trace.checker import check_file
from kvport.trace.events import CALL_ORDERS

PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks of 4 + 2


def expected_tokens(prompt_len: int, n: int) -> list[int]:
    return [1 + (prompt_len + j) % 97 for j in range(n)]


def setup(num_blocks: int = 32, policy: str = "recompute", **extra: object) -> tuple[Scheduler, FakeWorker]:
    sched = make_scheduler(num_blocks, kv_transfer_config=mock_connector_config(policy, **extra))
    return sched, FakeWorker(sched)


def drain(sched: Scheduler, worker: FakeWorker, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not sched.has_pending_work():
            return
        worker.step(sched)
    raise AssertionError("engine did not drain")


def test_sync_load_skips_the_loaded_tokens() -> None:
    sched, worker = setup(hit_blocks=2)
    req = make_request("a", PROMPT, max_tokens=3)
    sched.add_request(req)
    out, _ = worker.step(sched)
    assert out.num_scheduled_tokens == {"a": 14 - 8}
    assert req.num_cached_tokens == 8 and req.num_external_computed_tokens == 8
    drain(sched, worker)
    assert req.output_token_ids == expected_tokens(14, 3)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("hit_blocks, is_async", [(2, False), (2, True), (0, False)])
def test_only_the_step_that_admits_a_sync_load_has_sync_kv_loads(hit_blocks: int,
                                                                 is_async: bool) -> None:
    sched, worker = setup(hit_blocks=hit_blocks, is_async=is_async)
    sched.add_request(make_request("a", PROMPT, max_tokens=3))
    flags = []
    for _ in range(200):
        if not sched.has_pending_work():
            break
        out, _ = worker.step(sched)
        flags.append(out.has_sync_kv_loads)
    # A sync load is read by the forward of the step that admits its request (the first), and
    # only then; an async load is read by steps after it reported.
    sync = hit_blocks > 0 and not is_async
    assert flags == [sync] + [False] * (len(flags) - 1), flags
    assert_scheduler_empty(sched)


def test_none_answer_retries_next_step_without_allocating() -> None:
    sched, worker = setup(hit_blocks=1, num_defers=2)
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    for _ in range(2):
        out, _ = worker.step(sched)
        assert out.total_num_scheduled_tokens == 0
        assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    out, _ = worker.step(sched)
    assert out.num_scheduled_tokens == {"a": 10}
    drain(sched, worker)
    assert_scheduler_empty(sched)


def test_a_request_retried_for_room_is_counted_once() -> None:
    """The connector is asked again each step a matched request finds no room in the pool; its
    queried and hit tokens count once, at admission (as the engine's prefix-cache stats do)."""
    sched, worker = setup(num_blocks=6, hit_blocks=1)
    asked: list[str] = []
    connector = sched.connector
    assert connector is not None
    original = connector.get_num_new_matched_tokens

    def counting(req, num_local):  # type: ignore[no-untyped-def]
        asked.append(req.request_id)
        return original(req, num_local)

    connector.get_num_new_matched_tokens = counting  # type: ignore[method-assign]
    big = make_request("big", PROMPT, max_tokens=6)  # 14 + 6 tokens: 5 of the 6 blocks
    late = make_request("late", [50 + t for t in PROMPT], max_tokens=2)  # needs 4 blocks
    sched.add_request(big)
    sched.add_request(late)
    drain(sched, worker)
    assert asked.count("late") > 1  # really retried
    assert sched.xfer.stats.num_queried_tokens == 14 + 14
    assert sched.xfer.stats.num_hit_tokens == 4 + 4
    assert late.output_token_ids == expected_tokens(14, 2)
    assert_scheduler_empty(sched)


def test_async_load_parks_the_request_until_finished_recving() -> None:
    sched, worker = setup(hit_blocks=3, is_async=True, recv_delay_steps=2)
    req = make_request("a", PROMPT, max_tokens=2)
    sched.add_request(req)
    for _ in range(3):  # admitted (blocks allocated, not published) and waiting for the load
        out, _ = worker.step(sched)
        assert out.total_num_scheduled_tokens == 0
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert sched.kv.pool.num_cached_blocks == 0
    out, _ = worker.step(sched)  # finished_recving was reported: resumes with 12 tokens loaded
    assert out.num_scheduled_tokens == {"a": 2}
    assert req.num_cached_tokens == 12
    drain(sched, worker)
    assert req.output_token_ids == expected_tokens(14, 2)
    assert_scheduler_empty(sched)


def test_load_of_the_whole_prompt_still_computes_one_token() -> None:
    prompt = list(range(1, 13))  # exactly 3 blocks
    for is_async in (False, True):
        sched, worker = setup(hit_blocks=3, is_async=is_async, leave_one_token=False)
        req = make_request("a", prompt, max_tokens=2)
        sched.add_request(req)
        drain(sched, worker)
        assert req.num_cached_tokens == (8 if not is_async else 11)
        assert req.output_token_ids == expected_tokens(12, 2)
        if not is_async:
            assert sched.xfer.stats.num_bad_answers == 1  # corrected, counted
        assert_scheduler_empty(sched)


def test_abort_while_loading_frees_blocks_only_after_the_load_reports() -> None:
    sched, worker = setup(hit_blocks=3, is_async=True, recv_delay_steps=3)
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    worker.step(sched)
    used = sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks
    assert used == 3
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.xfer.held_request_ids == ["a"]  # the load may still write the blocks
    worker.step(sched)
    assert sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks == 3
    drain(sched, worker)
    assert_scheduler_empty(sched)


def test_delayed_send_keeps_blocks_until_finished_sending() -> None:
    sched, worker = setup(send_delay_steps=3)
    req = make_request("a", PROMPT, max_tokens=1)
    sched.add_request(req)
    _, finished = worker.step(sched)
    assert finished == [req]
    assert sched.xfer.held_request_ids == ["a"]
    assert sched.kv.pool.num_free_blocks < sched.kv.pool.num_blocks
    assert sched.has_pending_work()  # the engine keeps stepping with no requests
    drain(sched, worker)
    assert_scheduler_empty(sched)


def test_failed_sync_load_recomputes_from_the_last_good_block() -> None:
    sched, worker = setup(hit_blocks=3, fail_first_load_block=1)
    req = make_request("a", PROMPT, max_tokens=3)
    sched.add_request(req)
    worker.step(sched)  # loads blocks 0..2, block 1 fails: back to 4 computed tokens
    assert req.num_computed_tokens == 4 and req.output_token_ids == []
    assert sched.xfer.stats.num_invalid_blocks == 2
    out, _ = worker.step(sched)
    assert out.num_scheduled_tokens == {"a": 10}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]  # runner state re-sent in full
    drain(sched, worker)
    assert req.output_token_ids == expected_tokens(14, 3)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("failed_block, cached", [
    (2, 8),  # resumes from the last good block
    (0, 0),  # nothing usable arrived: starts over without the connector
])
def test_failed_async_load_resumes_from_the_last_good_block(failed_block: int,
                                                            cached: int) -> None:
    sched, worker = setup(hit_blocks=3, is_async=True, fail_first_load_block=failed_block)
    req = make_request("a", PROMPT, max_tokens=2)
    sched.add_request(req)
    drain(sched, worker)
    assert req.num_cached_tokens == cached
    assert req.output_token_ids == expected_tokens(14, 2)
    assert_scheduler_empty(sched)


def test_fail_policy_fails_the_request_alone() -> None:
    sched, worker = setup(policy="fail", hit_blocks=2, fail_first_load_block=0)
    bad = make_request("bad", PROMPT, max_tokens=2)
    good = make_request("good", [50, 51, 52], max_tokens=2)
    sched.add_request(bad)
    sched.add_request(good)
    drain(sched, worker)
    assert bad.status == RequestStatus.FINISHED_ERROR and "kv_load_failure_policy=fail" in (bad.error or "")
    assert good.output_token_ids == expected_tokens(3, 2)
    assert_scheduler_empty(sched)


def test_late_duplicate_and_unknown_completions_are_ignored_and_counted() -> None:
    sched, worker = setup(send_delay_steps=0)
    sched.add_request(make_request("a", PROMPT, max_tokens=1))
    drain(sched, worker)
    out = sched.schedule()
    stray = ModelRunnerOutput(kv_connector_output=KVConnectorOutput(
        finished_sending={"a", "never-existed"}, finished_recving={"a"}))
    sched.update_from_output(out, stray)
    assert sched.xfer.stats.num_ignored_completions == 3
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("answer", [(0, True), (-4, False), (True, False), (2.5, False)])
def test_answers_outside_the_contract_are_corrected_and_counted(answer: tuple[object, bool]) -> None:
    """(0, True) would park the request for a load that never reports; a negative or non-integer
    count would corrupt num_computed_tokens. Each is corrected to (0, False)."""
    sched, worker = setup(hit_blocks=2)
    connector = sched.connector
    assert connector is not None
    original = connector.get_num_new_matched_tokens

    def bad(req, num_local):  # type: ignore[no-untyped-def]
        return answer if req.request_id == "bad" else original(req, num_local)

    connector.get_num_new_matched_tokens = bad  # type: ignore[method-assign]
    req = make_request("bad", PROMPT, max_tokens=2)
    sched.add_request(req)
    drain(sched, worker)
    assert req.num_cached_tokens == 0 and req.output_token_ids == expected_tokens(14, 2)
    assert sched.xfer.stats.num_bad_answers == 1
    assert_scheduler_empty(sched)


def step_with(sched: Scheduler, worker: FakeWorker, **extra: set[str]) -> None:
    """One step whose connector output also carries the given (stray) completions."""
    out = sched.schedule()
    runner_out = worker.execute(sched, out)
    kv_out = runner_out.kv_connector_output
    for name, ids in extra.items():
        getattr(kv_out, name).update(ids)
    sched.update_from_output(out, runner_out)


def test_a_completion_of_the_other_kind_keeps_the_blocks_held() -> None:
    """Aborted while loading: only finished_recving may release the blocks (the load still
    writes them); a stray finished_sending is ignored and counted."""
    sched, worker = setup(hit_blocks=3, is_async=True, recv_delay_steps=3)
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    worker.step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    step_with(sched, worker, finished_sending={"a"})
    assert sched.xfer.held_request_ids == ["a"]
    assert sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks == 3
    assert sched.xfer.stats.num_ignored_completions == 1
    drain(sched, worker)
    assert_scheduler_empty(sched)


def test_a_duplicate_finished_recving_before_the_resume_is_counted() -> None:
    """a's load is reported done, but a cannot resume while r holds the only seat; a second
    report of the same load (a connector bug) is ignored and counted."""
    sched = make_scheduler(32, max_num_seqs=1, kv_transfer_config=mock_connector_config(
        hit_blocks=3, is_async=True))
    worker = FakeWorker(sched)
    a = make_request("a", PROMPT, max_tokens=2)
    sched.add_request(a)
    sched.add_request(make_request("r", [60, 61], max_tokens=6))
    worker.step(sched)  # a parks (its load reports at once), r takes the seat
    step_with(sched, worker, finished_recving={"a"})
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # not resumed yet
    assert sched.xfer.stats.num_ignored_completions == 1
    drain(sched, worker)
    assert a.output_token_ids == expected_tokens(14, 2)
    assert_scheduler_empty(sched)


def cached_prefix_tokens(sched: Scheduler, prompt: list[int]) -> int:
    """Tokens of `prompt` that the engine's prefix cache would hand a new request."""
    return sched.kv.get_computed_blocks(make_request("probe", prompt))[1]


def test_failed_load_blocks_leave_the_cache_even_when_their_request_is_gone() -> None:
    """The request is aborted while its step (a sync load, block 1 failing) is in flight, as
    under async scheduling. Its blocks were published when scheduled; the failed ones must be
    withdrawn although no request holds them any more."""
    sched, worker = setup(hit_blocks=3, fail_first_load_block=1)
    sched.add_request(make_request("a", PROMPT, max_tokens=3))
    out = sched.schedule()
    runner_out = worker.execute(sched, out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(out, runner_out)
    assert cached_prefix_tokens(sched, PROMPT) == 4  # block 0 only
    drain(sched, worker)
    assert_scheduler_empty(sched)


def test_blocks_computed_from_a_failed_load_are_withdrawn_with_it() -> None:
    """Blocks 2 and 3 are computed in the step whose load of block 1 failed: they hold KV
    computed from garbage and leave the prefix cache with block 1, until recomputed."""
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    sched, worker = setup(hit_blocks=2, fail_first_load_block=1)
    a = make_request("a", prompt, max_tokens=2)
    sched.add_request(a)
    worker.step(sched)
    pool = sched.kv.pool
    assert pool.get_cached_block(a.block_hashes[0]) is not None
    assert [pool.get_cached_block(h) for h in a.block_hashes[1:4]] == [None, None, None]
    drain(sched, worker)
    assert a.output_token_ids == expected_tokens(17, 2)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("hit_blocks", [0, 2])
def test_a_failed_step_withdraws_the_blocks_it_computed_or_loaded(hit_blocks: int) -> None:
    sched, worker = setup(hit_blocks=hit_blocks)
    a = make_request("a", PROMPT, max_tokens=2)
    sched.add_request(a)
    out = sched.schedule()
    runner_out = worker.execute(sched, out)
    runner_out.failed_req_ids["a"] = "RuntimeError: the forward crashed half-way"
    sched.update_from_output(out, runner_out)
    assert a.status == RequestStatus.FINISHED_ERROR
    assert cached_prefix_tokens(sched, PROMPT) == 0  # nothing of that step is trusted
    drain(sched, worker)
    assert_scheduler_empty(sched)


def test_async_scheduling_drops_the_token_of_a_step_in_flight_behind_a_failed_load() -> None:
    """Step 0 loads a's blocks (block 1 fails) and samples; step 1, a decode, is already in
    flight when step 0's output rewinds a. Both steps' tokens were computed from bad KV."""
    sched, worker = setup(hit_blocks=3, fail_first_load_block=1)
    a = make_request("a", PROMPT, max_tokens=2)
    sched.add_request(a)
    out0 = sched.schedule()
    out1 = sched.schedule()  # a's next decode, behind its output placeholder
    assert out1.num_scheduled_tokens == {"a": 1}
    run0 = worker.execute(sched, out0)
    run1 = worker.execute(sched, out1)
    run1.sampled_token_ids["a"] = [99]  # a token the fake model never samples
    sched.update_from_output(out0, run0)
    assert a.num_computed_tokens == 4 and a.output_token_ids == []
    sched.update_from_output(out1, run1)
    assert a.output_token_ids == []  # 99 was computed from the bad blocks
    drain(sched, worker)
    assert a.output_token_ids == expected_tokens(14, 2)
    assert_scheduler_empty(sched)


def test_blocks_an_async_load_writes_are_never_reclaimed_for_another_request() -> None:
    """r runs out of blocks while a's load still writes a's; reclaiming from the waiting queue
    must skip a (r is preempted instead), or r would compute into blocks being loaded."""
    sched, worker = setup(num_blocks=7, hit_blocks=3, is_async=True, recv_delay_steps=20)
    r = make_request("r", [60, 61, 62], max_tokens=16)  # no hit (too short); grows to 5 blocks
    a = make_request("a", PROMPT, max_tokens=2)
    sched.add_request(r)
    sched.add_request(a)
    parked: list[int] = []
    for _ in range(200):
        if not sched.has_pending_work():
            break
        worker.step(sched)
        if a.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            parked = parked or sched.kv.get_block_ids("a")[0]
            assert sched.kv.get_block_ids("a")[0] == parked, "a's blocks were taken mid-load"
    assert len(parked) == 3 and r.num_preemptions >= 1  # the pressure was real
    assert r.output_token_ids == expected_tokens(3, 16)
    assert a.output_token_ids == expected_tokens(14, 2)
    assert_scheduler_empty(sched)


class RaisingConnectorHooks:
    """Patch helpers: make one scheduler-side hook raise for one request."""

    @staticmethod
    def patch(sched: Scheduler, hook: str, bad_id: str) -> None:
        connector = sched.connector
        original = getattr(connector, hook)

        def wrapped(req, *args):  # type: ignore[no-untyped-def]
            if req.request_id == bad_id:
                raise RuntimeError(f"{hook} exploded")
            return original(req, *args)

        setattr(connector, hook, wrapped)


def test_a_raising_scheduler_hook_fails_only_its_request() -> None:
    for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"):
        sched, worker = setup(hit_blocks=1)
        RaisingConnectorHooks.patch(sched, hook, "bad")
        bad = make_request("bad", PROMPT, max_tokens=2)
        good = make_request("good", PROMPT[:6], max_tokens=2)
        sched.add_request(bad)
        sched.add_request(good)
        drain(sched, worker)
        assert good.output_token_ids == expected_tokens(6, 2), hook
        if hook == "request_finished":  # raised at the very end: the request had its output
            assert bad.output_token_ids == expected_tokens(14, 2)
        else:
            assert bad.status == RequestStatus.FINISHED_ERROR and hook in (bad.error or "")
        assert sched.xfer.stats.num_hook_errors == 1
        assert_scheduler_empty(sched)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(8, 24),
    budget=st.integers(2, 24),
    hit_blocks=st.integers(0, 4),
    is_async=st.booleans(),
    num_defers=st.integers(0, 2),
    fail_first_load_block=st.integers(-1, 2),
    recv_delay=st.integers(0, 3),
    send_delay=st.integers(-1, 3),
    policy=st.sampled_from(["recompute", "fail"]),
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    aborts=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 5)), max_size=3),
    call_order=st.sampled_from(CALL_ORDERS),
)
def test_random_connector_schedules_leak_nothing(
    num_blocks: int, budget: int, hit_blocks: int, is_async: bool, num_defers: int,
    fail_first_load_block: int, recv_delay: int, send_delay: int, policy: str,
    prompts: list[int], aborts: list[tuple[int, int]], call_order: str,
) -> None:
    trace_dir = tempfile.TemporaryDirectory(prefix="kvport-trace-")
    trace = os.path.join(trace_dir.name, "trace.jsonl")
    ktc = mock_connector_config(
        policy, hit_blocks=hit_blocks, is_async=is_async, num_defers=num_defers,
        fail_first_load_block=fail_first_load_block, recv_delay_steps=recv_delay,
        send_delay_steps=send_delay, record_trace=trace)
    # As the engine does: its recorders' header names the order its worker driver follows.
    header = trace_header(EngineConfig(kv_connector_call_order=call_order))
    sched = make_scheduler(num_blocks, max_num_batched_tokens=budget, max_model_len=32,
                           kv_transfer_config=ktc, header=header)
    worker = FakeWorker(sched, header=header)
    worker.driver.call_order = call_order
    reqs = [make_request(str(i), [(i * 5 + j) % 90 + 1 for j in range(n)], max_tokens=3)
            for i, n in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    for step in range(400):
        for at, idx in aborts:
            if at == step and idx < len(reqs):
                sched.finish_requests([str(idx)], RequestStatus.FINISHED_ABORTED)
        out, _ = worker.step(sched)
        assert out.total_num_scheduled_tokens <= budget
        sched.kv.pool.check_integrity()
        if not sched.has_pending_work():
            break
    assert not sched.has_pending_work(), "did not drain in 400 steps"
    for r in reqs:
        if r.status.finish_reason == "length":
            assert r.output_token_ids == expected_tokens(r.num_prompt_tokens, 3)
    assert_scheduler_empty(sched)
    assert check_file(trace) == []  # both halves kept the connector contract
    trace_dir.cleanup()
