"""Synchronous host hits (issue 13): a hit held wholly in host memory is copied in start_load_kv,
before the step's forward, so its request prefills in the step that admits it, batched with the
others; a copy that is late fails over to recomputing exactly the blocks it did not copy; and at
the default granularity (the engine's own block) no token is recomputed that the engine's own
prefix cache would have kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import faulty_connector
from kvport import LLM
from kvport.connectors.offloading.worker import sync_parts
from kvport.connectors.offloading.mediums import ENGINE, HOST
from kvport.engine.request import Request
from kvport.trace.checker import check_file
from offload_utils import (
    BLOCK_SIZE, GREEDY, assert_nothing_leaked, host_metrics, make_llm, offload_config,
    offloading_half, prompts, run, step_until, worker_half,
)

STEPS_TO_FIRST_TOKEN_WITHOUT_SYNC = 2  # the admitting step loads, a later one prefills


pytestmark = pytest.mark.usefixtures("no_faults")


def warmed(sync: bool = True, **kw: Any) -> LLM:
    """An engine whose host tier holds every prompt's blocks and whose own cache is empty."""
    llm = make_llm(offload_config(sync_host_loads=sync, **kw))
    run(llm, prompts())
    llm.reset_prefix_cache()
    return llm


def steps_to_first_token(llm: LLM, reqs: list[Request]) -> list[int]:
    steps, firsts = 0, [0] * len(reqs)
    while not all(firsts):
        llm.engine.step()
        steps += 1
        firsts = [f or (steps if r.output_token_ids else 0) for f, r in zip(firsts, reqs)]
        assert steps < 50, "no first token after 50 steps"
    return firsts


@pytest.mark.parametrize("sync", [True, False])
def test_a_host_hit_prefills_in_the_step_that_admits_it(
        reference: list[list[int]], sync: bool) -> None:
    llm = warmed(sync)
    req = llm.engine.add_request("hit", prompts()[0], GREEDY)
    first = steps_to_first_token(llm, [req])
    assert first == [1 if sync else STEPS_TO_FIRST_TOKEN_WITHOUT_SYNC]
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert req.output_token_ids == reference[0] and req.num_cached_tokens == 56
    assert host_metrics(llm)["num_sync_loads"] == (1 if sync else 0)
    assert_nothing_leaked(llm)
    llm.shutdown()


def test_two_concurrent_hits_prefill_in_one_batched_step(reference: list[list[int]]) -> None:
    llm = warmed()
    reqs = [llm.engine.add_request(f"hit{i}", p, GREEDY) for i, p in enumerate(prompts()[:2])]
    assert steps_to_first_token(llm, reqs) == [1, 1]  # one forward computed both suffixes
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert [r.output_token_ids for r in reqs] == reference[:2]
    assert host_metrics(llm)["num_sync_loads"] == 2
    assert_nothing_leaked(llm)
    llm.shutdown()


def faulty_warmed(tmp_path: Path, faults: dict[tuple[str, str], dict[str, Any]],
                  connector: str = "FaultyOffloadingConnector") -> LLM:
    """warmed(), with the transfers of faulty_connector (FAULTS counts calls from the build)."""
    faulty_connector.FAULTS.update(faults)
    ktc = offload_config(record_trace=str(tmp_path / "trace.jsonl"))
    ktc["kv_connector_module_path"] = "faulty_connector"
    ktc["kv_connector"] = connector
    llm = make_llm(ktc)
    run(llm, prompts()[:1])  # stores only: no HOST->ENGINE call yet
    llm.reset_prefix_cache()
    return llm


def test_a_sync_copy_that_hangs_fails_over_to_recompute(
        tmp_path: Path, reference: list[list[int]]) -> None:
    llm = faulty_warmed(tmp_path, {(HOST, ENGINE): {"hold_on": {1}}})
    gate = faulty_connector.WRAPPERS[(HOST, ENGINE)]
    req = llm.engine.add_request("held", prompts()[0], GREEDY)
    llm.engine.step()  # the copy hangs past its deadline: its blocks are recomputed
    assert gate.started == {1} and not gate.finished
    step_until(llm, lambda: req.is_finished)  # served while the copy still hangs
    assert req.output_token_ids == reference[0]
    assert llm.get_metrics()["kv_transfer"]["num_invalid_blocks"] == 14  # 56 tokens, 4 a block
    assert host_metrics(llm)["num_failed_loads"] == 0  # the job still runs: its slots pinned
    assert offloading_half(llm).manager.num_pinned == 7
    gate.release_all()  # it wakes up after its deadline: it writes nothing, and reports
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert host_metrics(llm)["num_failed_loads"] == 1
    # The slots it pinned are free again: the next hit loads normally.
    llm.reset_prefix_cache()
    again = llm.engine.add_request("again", prompts()[0], GREEDY)
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert again.output_token_ids == reference[0] and again.num_cached_tokens == 56
    assert_nothing_leaked(llm)
    llm.shutdown()
    assert check_file(str(tmp_path / "trace.jsonl")) == []


def test_a_late_copy_recomputes_exactly_the_blocks_it_did_not_copy(
        tmp_path: Path, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of one offload block each: part 1 copies, part 2 hangs, parts 3.. never start."""
    llm = faulty_warmed(tmp_path, {(HOST, ENGINE): {"hold_on": {2}}})
    slot_bytes = worker_half(llm).geometry.slot_bytes  # type: ignore[union-attr]
    monkeypatch.setattr(sync_parts, "SYNC_PART_BYTES", slot_bytes)
    gate = faulty_connector.WRAPPERS[(HOST, ENGINE)]
    # The prompt's offload blocks sit in slots 0, 1, ... (fresh slots, in token order). Poison
    # all but the first: only the copy that runs in time may be used.
    worker_half(llm).host.buffer[1:].fill_(0xFF)  # type: ignore[union-attr]  # NaN as float
    req = llm.engine.add_request("late", prompts()[0], GREEDY)
    llm.engine.step()
    assert gate.started == {1, 2} and gate.finished == {1}
    # 7 offload blocks of 2 engine blocks: the first one copied, the other 6 recomputed
    assert llm.get_metrics()["kv_transfer"]["num_invalid_blocks"] == 12
    step_until(llm, lambda: req.is_finished)
    assert req.output_token_ids == reference[0]
    gate.release_all()  # part 2 starts after its deadline: it must not write its blocks
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert gate.num_calls == 2  # parts 3.. were cancelled before they started
    # The engine's own cache kept the recomputed blocks: they are intact.
    assert run(llm, prompts()[:1]) == (reference[:1], [60])
    assert_nothing_leaked(llm)
    llm.shutdown()
    assert check_file(str(tmp_path / "trace.jsonl")) == []


@pytest.mark.parametrize("length", [37, 40, 41, 47, 48, 52, 61])
def test_no_token_recomputed_that_the_engines_own_cache_would_keep(length: int) -> None:
    """At the default granularity a repeated prompt, served from the host tier after the
    engine's cache was dropped, computes exactly what the engine's own prefix cache leaves
    (never more than a block minus one token beyond it)."""
    first, longer = prompts(1, length=61)[0][:length - 8], prompts(1, length=61)[0][:length]
    cfg = offload_config()
    del cfg["kv_connector_extra_config"]["block_size"]  # the default: the engine's block
    with_connector = make_llm(cfg)
    engine_only = make_llm()
    for llm in (with_connector, engine_only):
        run(llm, [first])
    with_connector.reset_prefix_cache()
    (_, (from_host,)) = run(with_connector, [longer])
    (_, (from_engine,)) = run(engine_only, [longer])
    assert from_host == from_engine
    assert length - from_host <= (length - from_engine) + BLOCK_SIZE - 1
    assert host_metrics(with_connector)["num_host_hit_tokens"] == from_host
    for llm in (with_connector, engine_only):
        llm.shutdown()


@pytest.mark.parametrize("wait", [False, True])
def test_inside_vllm_a_slow_sync_copy_is_waited_for(wait: bool) -> None:
    """vLLM 0.32 keeps a failed synchronous load's blocks in its prefix cache (and serves them if
    the request is aborted or preempted before recomputing them), so its worker waits for the
    copy (wait_sync_loads) where kvport's engine bounds it."""
    kind = "WaitSyncLoadsControlledConnector" if wait else "ControlledOffloadingConnector"
    ktc = offload_config()
    ktc.update(kv_connector=kind, kv_connector_module_path="controlled_transfers")
    llm = make_llm(ktc)
    run(llm, prompts()[:1])
    llm.reset_prefix_cache()
    transfers = worker_half(llm).transfers
    transfers.hold((HOST, ENGINE))  # a copy that does not end by itself in the step's bound
    req = llm.engine.add_request("slow", prompts()[0], GREEDY)
    llm.engine.step()
    invalid = llm.get_metrics()["kv_transfer"]["num_invalid_blocks"]
    assert invalid == (0 if wait else 14)  # 56 tokens in blocks of 4, recomputed when bounded
    transfers.release_all()
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("connector", ["FaultyOffloadingConnector", "SyncStoresFaultyConnector"])
def test_a_failed_sync_load_stores_nothing_computed_on_it(tmp_path: Path, connector: str) -> None:
    """The step's forward runs on the blocks of a synchronous load that failed (the engine
    learns of it after the step, and recomputes them): what that forward computed for the
    request is never stored, so a later hit cannot load KV computed on garbage. With stores
    copied within their step the race is decided: an unguarded store reads the garbage before
    the recompute overwrites it."""
    llm = faulty_warmed(tmp_path, {(HOST, ENGINE): {"fail_on": {1}}}, connector)
    q = prompts()[0][:40] + prompts(1, seed=9)[0][:24]  # a 40-token hit, then 3 new blocks
    want = run(make_llm(), [q])[0]
    llm.engine.runner.kv_cache.fill_(float("nan"))  # what the failed copy leaves in the pool
    assert run(llm, [q])[0] == want  # load failed: the hit was recomputed
    assert host_metrics(llm)["num_failed_loads"] == 1
    llm.reset_prefix_cache()
    tokens, cached = run(llm, [q])
    assert tokens == want
    assert_nothing_leaked(llm)
    llm.shutdown()
    assert check_file(str(tmp_path / "trace.jsonl")) == []
