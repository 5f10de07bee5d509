"""vLLM's load-failure matrix, under vLLM's real Scheduler (harness.py): synchronous and
asynchronous host loads that fail at random blocks (load_faults.py), with both of vLLM's
kv_load_failure_policy values, plain, with an abort during the failing load, and with
preemptions (a pool too small for the requests).

What must hold:
- "recompute": every request finishes as if nothing failed; each block any running request
  holds has its prefix's KV (a failed block left unrecomputed holds garbage and is caught);
- "fail": exactly the requests whose loads failed finish with FINISHED_ERROR, the others
  finish normally, and the engine goes on serving (a later request loads and finishes);
- always: nothing leaked on vLLM's side (blocks, requests) nor kvport's (both halves).
"""

from __future__ import annotations

import random

import pytest
from harness import BLOCK_SIZE, Harness, offload_extra, waiting_for_load
from load_faults import FaultyLoads
from vllm.v1.request import Request, RequestStatus

PROMPT_BLOCKS = 4
SEEDS = (0, 1)


def _prompts(n: int, length: int) -> list[list[int]]:
    """Prompts that share no block (their first tokens differ)."""
    return [[3 + i] + [(t * 37 + 11 * i) % 250 + 3 for t in range(1, length)] for i in range(n)]


def _check_running_blocks(h: Harness, reqs: list[Request]) -> None:
    """Every full block of a running request past its prefill holds its prefix's KV."""
    for r in reqs:
        if r.status == RequestStatus.RUNNING and r.num_output_tokens > 0:
            for index in range(min(r.num_computed_tokens, r.num_prompt_tokens) // BLOCK_SIZE):
                h.check_block(r, index)


def _assert_worker_idle(h: Harness) -> None:
    w = h.worker.worker_half
    assert not w._loads and not w._in_flight and not w._ready and not w._load_errors


def _store_round(h: Harness, prompts: list[list[int]], max_tokens: int,
                 max_steps: int = 300) -> list[list[int]]:
    """Compute the prompts once (they are stored in host memory); their outputs."""
    first = [h.add(f"first{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    h.run(max_steps=max_steps)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in first)
    assert h.scheduler.reset_prefix_cache()  # the engine forgets; the host tier does not
    h.storage.zero_()
    return [list(r.output_token_ids) for r in first]


def _serve_on(h: Harness, prompt: list[int]) -> None:
    """The engine lives: a later request that loads from host memory finishes normally."""
    later = h.add("later", prompt, max_tokens=2)
    h.run()
    assert later.status == RequestStatus.FINISHED_LENGTH_CAPPED


def _judge(h: Harness, faults: FaultyLoads, reqs: list[Request], expected: list[list[int]],
           policy: str, aborted: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    assert faults.failed_requests, "no load failed: the test proves nothing"
    assert faults.failed_requests <= faults.faulty
    errored = {r.request_id for r in reqs if r.status == RequestStatus.FINISHED_ERROR}
    if policy == "fail":
        assert errored == faults.failed_requests - aborted
    else:
        assert not errored
    for r, want in zip(reqs, expected):
        if r.request_id in errored or r.request_id in aborted:
            continue
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED, (r.request_id, r.status)
        assert list(r.output_token_ids) == want[:len(r.output_token_ids)] and \
            len(r.output_token_ids) == r.max_tokens
    stats = h.connector.scheduler_half.stats
    assert stats.num_failed_loads >= 1


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("sync", [True, False])
def test_loads_failed_at_random_blocks(monkeypatch: pytest.MonkeyPatch, sync: bool,
                                       policy: str, seed: int) -> None:
    rng = random.Random(seed)
    h = Harness.build(offload_extra(sync_host_loads=sync), policy=policy)
    h.check_reads = not sync  # a failed sync load's step reads its garbage, then discards it
    prompts = _prompts(4, PROMPT_BLOCKS * BLOCK_SIZE + 5)
    expected = _store_round(h, prompts, max_tokens=6)
    faulty = set(rng.sample([f"r{i}" for i in range(4)], 2))
    faults = FaultyLoads(h, faulty, rng).install(monkeypatch)
    reqs = [h.add(f"r{i}", p, max_tokens=6) for i, p in enumerate(prompts)]
    for _ in range(100):
        if not h.scheduler.has_requests():
            break
        h.step()
        _check_running_blocks(h, reqs)
    _judge(h, faults, reqs, expected, policy)
    faults.faulty.clear()
    h.check_reads = True
    _serve_on(h, prompts[0])
    h.assert_nothing_leaked()
    _assert_worker_idle(h)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("sync", [True, False])
def test_an_abort_during_the_failing_load(monkeypatch: pytest.MonkeyPatch, sync: bool,
                                          policy: str) -> None:
    """Async: the request is aborted while its failing load is in flight (its failure is
    reported after the abort). Sync: aborted in the step after the failed load, while vLLM
    recomputes it (recompute) or after it failed (fail: a no-op)."""
    rng = random.Random(7)
    h = Harness.build(offload_extra(sync_host_loads=sync), policy=policy)
    h.check_reads = not sync
    prompts = _prompts(3, PROMPT_BLOCKS * BLOCK_SIZE + 3)
    expected = _store_round(h, prompts, max_tokens=4)
    faults = FaultyLoads(h, {"r0", "r1"}, rng).install(monkeypatch)
    reqs = [h.add(f"r{i}", p, max_tokens=4) for i, p in enumerate(prompts)]
    h.step()  # every load submitted (and, sync, failed) in this step
    assert faults.failed_requests == {"r0", "r1"}
    if not sync:
        assert waiting_for_load(reqs[0])
    h.scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    h.run()
    _check_running_blocks(h, reqs)
    _judge(h, faults, reqs, expected, policy, aborted={"r0"})
    faults.faulty.clear()
    h.check_reads = True
    _serve_on(h, prompts[0])
    h.assert_nothing_leaked()
    _assert_worker_idle(h)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("sync", [True, False])
def test_failing_loads_with_preemptions(monkeypatch: pytest.MonkeyPatch, sync: bool,
                                        policy: str) -> None:
    """A pool too small for the requests: they are preempted and resumed (and load again)
    while loads fail; failed blocks are never served, and nothing leaks."""
    rng = random.Random(3)
    h = Harness.build(offload_extra(host_blocks=64, sync_host_loads=sync), num_blocks=14,
                      max_num_seqs=4, policy=policy)
    h.check_reads = not sync
    prompts = _prompts(4, 50)
    expected = _store_round(h, prompts, max_tokens=20, max_steps=500)
    faults = FaultyLoads(h, {"r1", "r2"}, rng).install(monkeypatch)
    reqs = [h.add(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    for _ in range(500):
        if not h.scheduler.has_requests():
            break
        h.step()
        _check_running_blocks(h, reqs)
    assert any(r.num_preemptions for r in reqs), "no preemption: the pool was not small enough"
    _judge(h, faults, reqs, expected, policy)
    faults.faulty.clear()
    h.check_reads = True
    _serve_on(h, prompts[0])
    h.assert_nothing_leaked()
    _assert_worker_idle(h)
