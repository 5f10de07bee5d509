"""Scheduler with a fake runner: budgets, chunked prefill, prefix hits, preemption, aborts."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_scheduler_empty, make_request, make_scheduler, run_step

from kvport.engine.request import RequestStatus


def test_prompt_is_chunked_by_the_token_budget() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=6)
    sched.add_request(make_request("a", list(range(1, 15)), max_tokens=2))  # 14 prompt tokens
    chunks = []
    while sched.requests:
        out, _ = run_step(sched)
        chunks.append(out.num_scheduled_tokens.get("a", 0))
    assert chunks == [6, 6, 2, 1]  # three prefill chunks, then one decode token
    assert_scheduler_empty(sched)


def test_decodes_and_prefill_share_one_budget() -> None:
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    run_step(sched)  # a: prefill of 3 tokens, samples its first token
    sched.add_request(make_request("b", list(range(1, 21)), max_tokens=1))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # decode first, prefill takes the rest
    while sched.requests:
        run_step(sched)
    assert_scheduler_empty(sched)


def test_prefix_hit_at_admission_counts_cached_tokens() -> None:
    sched = make_scheduler(num_blocks=16)
    prompt = list(range(1, 12))  # 11 tokens: 2 full blocks + 3
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("b", prompt[:9] + [50, 51], max_tokens=1))
    out, finished = run_step(sched)
    assert out.num_scheduled_tokens == {"b": 3}  # 8 tokens were hits, 3 computed
    assert finished[0].num_cached_tokens == 8
    run_step(sched)
    assert_scheduler_empty(sched)


def test_full_prompt_hit_still_computes_one_token() -> None:
    sched = make_scheduler(num_blocks=16)
    prompt = list(range(1, 9))  # exactly 2 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"b": 4}  # only block 0 counts: the last token must run
    run_step(sched)
    assert_scheduler_empty(sched)


def test_preemption_takes_the_newest_request_and_frees_its_blocks() -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    sched.add_request(make_request("old", [1, 2, 3], max_tokens=8))
    sched.add_request(make_request("new", [4, 5, 6], max_tokens=8))
    preempted_at = None
    steps = 0
    while sched.requests:
        out, _ = run_step(sched)
        steps += 1
        if out.preempted_req_ids and preempted_at is None:
            preempted_at = steps
            assert out.preempted_req_ids == {"new"}
            assert sched.requests["new"].status == RequestStatus.PREEMPTED
            assert sched.requests["new"].num_computed_tokens == 0
            assert sched.kv.get_block_ids("new") == ([],)
            assert sched.waiting[0].request_id == "new"
    assert preempted_at is not None
    assert_scheduler_empty(sched)


def test_abort_frees_everything_in_every_state() -> None:
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    for rid in "abc":
        sched.add_request(make_request(rid, list(range(1, 10)), max_tokens=4))
    run_step(sched)  # a is mid-prefill, b and c are waiting
    sched.finish_requests(["a", "c"], RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(sched)
    assert out.finished_req_ids == {"a", "c"}  # delivered to the worker side, seen or not
    sched.finish_requests(["b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert_scheduler_empty(sched)


def test_max_num_seqs_limits_running_requests() -> None:
    sched = make_scheduler(num_blocks=32, max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(str(i), [1 + i, 2, 3], max_tokens=3))
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"0", "1"}
    while sched.requests:
        out, _ = run_step(sched)
        assert len(out.num_scheduled_tokens) <= 2
    assert_scheduler_empty(sched)


def test_stop_on_eos_stop_token_and_max_model_len() -> None:
    sched = make_scheduler(num_blocks=16, max_model_len=8)
    sched.add_request(make_request("eos", [5, 6], max_tokens=10))
    sched.add_request(make_request("stop", [5, 7], max_tokens=10, stop_token_ids=[42]))
    sched.add_request(make_request("len", [5, 8, 9], max_tokens=10))
    tokens = {"eos": [3, 0], "stop": [42], "len": [1] * 10}
    done = {}
    while sched.requests:
        _, finished = run_step(sched, next_token=lambda r: tokens[r.request_id][r.num_output_tokens])
        done.update({r.request_id: r for r in finished})
    assert done["eos"].output_token_ids == [3, 0] and done["eos"].status.finish_reason == "stop"
    assert done["stop"].stop_reason == 42
    assert done["len"].num_tokens == 8 and done["len"].status.finish_reason == "length"
    assert_scheduler_empty(sched)


# KV cache groups: one full group (every non-hybrid model), or hybrids of full and sliding groups
GROUP_WINDOWS = [(None,), (None,), (None, 6), (6, None, 6), (3, None), (None, 9)]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    windows=st.sampled_from(GROUP_WINDOWS),
    num_blocks=st.integers(4, 24),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
    prompts=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=14), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 6), min_size=8, max_size=8),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=4),
)
def test_random_workloads_finish_and_leak_nothing(
    windows: tuple[int | None, ...], num_blocks: int, budget: int, max_num_seqs: int,
    caching: bool, prompts: list[list[int]], max_tokens: list[int],
    aborts: list[tuple[int, int]],
) -> None:
    # A hybrid request holds a table per group: room for one 16-token request in every group
    extra = 4 * (len(windows) - 1) + (len(windows) > 1)
    sched = make_scheduler(num_blocks=num_blocks + extra, max_num_batched_tokens=budget,
                           max_num_seqs=max_num_seqs, max_model_len=16,
                           enable_prefix_caching=caching, group_windows=windows)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(str(i), p, max_tokens=max_tokens[i]))
    outputs: dict[str, list[int]] = {}
    null = sched.kv.pool.null_block
    for step in range(500):
        for at, idx in aborts:
            if at == step:
                sched.finish_requests([str(idx)], RequestStatus.FINISHED_ABORTED)
        out, finished = run_step(sched)
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.num_scheduled_tokens) <= max_num_seqs
        sched.kv.pool.check_integrity()
        for req in sched.running:  # every block the next token reads is real, in every group
            for g, table in enumerate(sched.kv.req_to_blocks[req.request_id]):
                first = sched.kv.first_needed_block(g, req.num_computed_tokens)
                assert null is None or null not in table[first:], (g, req.num_computed_tokens)
        for r in finished:
            outputs[r.request_id] = r.output_token_ids
        if not sched.requests:
            break
    assert not sched.requests, "workload did not finish in 500 steps"
    # The fake model's token depends only on the sequence length: preemption, chunking and
    # prefix hits must not change what a request generates.
    for rid, toks in outputs.items():
        n = len(prompts[int(rid)])
        assert toks == [1 + (n + j) % 97 for j in range(len(toks))]
    assert_scheduler_empty(sched)
