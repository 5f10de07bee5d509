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

from kvport.connectors.base import KVConnectorOutput
from kvport.engine.outputs import ModelRunnerOutput
from kvport.engine.request import RequestStatus
from kvport.engine.scheduler import Scheduler
from kvport.trace.checker import check_file

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
)
def test_random_connector_schedules_leak_nothing(
    num_blocks: int, budget: int, hit_blocks: int, is_async: bool, num_defers: int,
    fail_first_load_block: int, recv_delay: int, send_delay: int, policy: str,
    prompts: list[int], aborts: list[tuple[int, int]],
) -> None:
    trace_dir = tempfile.TemporaryDirectory(prefix="kvport-trace-")
    trace = os.path.join(trace_dir.name, "trace.jsonl")
    ktc = mock_connector_config(
        policy, hit_blocks=hit_blocks, is_async=is_async, num_defers=num_defers,
        fail_first_load_block=fail_first_load_block, recv_delay_steps=recv_delay,
        send_delay_steps=send_delay, record_trace=trace)
    sched = make_scheduler(num_blocks, max_num_batched_tokens=budget, max_model_len=32,
                           kv_transfer_config=ktc)
    worker = FakeWorker(sched)
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
