"""kvport's OffloadingConnector under vLLM's real Scheduler (fake model, layer-major pool): store
and load round trips byte for byte, the block-reuse fence under preemption, aborts during a load,
same-step prefix sharing, failed loads, and the leak oracle of both sides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import BLOCK_SIZE, Harness, offload_extra, waiting_for_load
from vllm.v1.request import RequestStatus

from kvport.connectors.offloading.mediums import ENGINE, HOST

PROMPT = [(t * 37) % 250 + 3 for t in range(70)]  # 4 full 16-token blocks and 6 tokens


def stored_blocks(h: Harness) -> int:
    return h.connector.scheduler_half.manager.stats.num_stored_blocks


@pytest.mark.parametrize("sync", [True, False])
def test_store_then_load_back_into_other_blocks(sync: bool) -> None:
    h = Harness.build(offload_extra(sync_host_loads=sync))
    a = h.add("a", PROMPT)
    h.run()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and stored_blocks(h) == 4
    assert h.scheduler.reset_prefix_cache()  # the engine forgets; the host tier does not
    h.storage.zero_()
    b = h.add("b", PROMPT)
    h.step()  # sync: loaded before the forward, which read it (check_reads) and prefilled
    assert waiting_for_load(b) is not sync
    assert len(b.output_token_ids) == (1 if sync else 0)
    h.run()
    stats = h.connector.scheduler_half.stats
    assert stats.num_load_jobs == 1 and stats.num_host_hit_tokens == 64
    assert stats.num_sync_loads == (1 if sync else 0)
    assert list(b.output_token_ids) == list(a.output_token_ids)
    h.assert_nothing_leaked()


def test_loaded_blocks_hold_exactly_the_stored_bytes() -> None:
    h = Harness.build(offload_extra())
    h.add("a", PROMPT, max_tokens=1)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.storage.zero_()
    b = h.add("b", PROMPT, max_tokens=40)  # long enough to inspect before it finishes
    for _ in range(4):
        h.step()
    assert b.status == RequestStatus.RUNNING
    assert h.connector.scheduler_half.stats.num_host_hit_tokens == 64
    for index in range(4):
        h.check_block(b, index)
    h.run()
    h.assert_nothing_leaked()


def test_preemption_with_stores_pending_keeps_every_stored_byte_right() -> None:
    """A pool too small for all requests: preemptions hand out blocks whose stores may still be
    pending; every block any request later loads must hold exactly its prefix's KV."""
    h = Harness.build(offload_extra(host_blocks=64), num_blocks=14, max_num_seqs=4)
    prompts = [[(t * 13 + 7 * i) % 250 + 3 for t in range(50)] for i in range(4)]
    reqs = [h.add(f"r{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    h.run(max_steps=500)
    assert any(r.num_preemptions for r in reqs), "no preemption: the pool was not small enough"
    h.scheduler.reset_prefix_cache()
    h.storage.zero_()
    again = [h.add(f"again{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    for _ in range(8):
        h.step()
    for r in again:  # loaded or computed, every full block holds its prefix's KV
        if r.status == RequestStatus.RUNNING:
            for index in range(r.num_computed_tokens // BLOCK_SIZE):
                h.check_block(r, index)
    h.run(max_steps=500)
    assert h.connector.scheduler_half.stats.num_host_hit_tokens > 0
    assert [list(r.output_token_ids) for r in again] == [list(r.output_token_ids)[:12] for r in reqs]
    h.assert_nothing_leaked()


def test_an_abort_during_a_load_frees_the_blocks_once_the_load_reports() -> None:
    h = Harness.build(offload_extra(sync_host_loads=False))
    h.add("a", PROMPT, max_tokens=1)
    h.run()
    h.scheduler.reset_prefix_cache()
    b = h.add("b", PROMPT)
    h.step()
    assert waiting_for_load(b)
    h.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    h.run()
    h.assert_nothing_leaked()


def test_prefix_shared_by_requests_computed_in_the_same_step_is_stored_once() -> None:
    h = Harness.build(offload_extra())
    shared = PROMPT[:64]
    reqs = [h.add(f"s{i}", shared + [200 + i] * 5) for i in range(3)]
    h.run()
    assert stored_blocks(h) == 4  # the shared prefix once, whoever computed it
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    h.assert_nothing_leaked()


@pytest.mark.parametrize("sync", [True, False])
def test_a_failed_load_is_recomputed(monkeypatch: pytest.MonkeyPatch, sync: bool) -> None:
    h = Harness.build(offload_extra(sync_host_loads=sync))
    # A failed synchronous load: vLLM runs the step's forward over the blocks it failed to fill,
    # then throws its output away and recomputes them. A failed async load: vLLM puts the
    # request back to waiting, and must not be offered the same load again (kvport answers 0).
    h.check_reads = not sync
    a = h.add("a", PROMPT, max_tokens=2)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.storage.zero_()
    transfers = h.worker.worker_half.transfers
    assert transfers is not None

    def broken_load(src, dst):  # type: ignore[no-untyped-def]
        raise OSError("host memory went away")

    monkeypatch.setattr(transfers._handlers[(HOST, ENGINE)], "_transfer", broken_load)
    b = h.add("b", PROMPT, max_tokens=2)
    h.run()
    assert list(b.output_token_ids) == list(a.output_token_ids)  # recomputed, not loaded
    assert h.connector.scheduler_half.stats.num_failed_loads == 1
    h.assert_nothing_leaked()


def test_stores_reach_the_disk_with_no_step_after_the_last_request(tmp_path: Path) -> None:
    h = Harness.build(offload_extra(disk_dir=tmp_path))
    h.add("a", PROMPT, max_tokens=1)
    while h.scheduler.requests:  # vLLM's in-process LLM: stop when no request is left
        h.step()
    assert stored_blocks(h) == 4  # in the host tier, and the scheduler half knows it
    h.worker.shutdown()  # drains the write-throughs
    assert len(list(tmp_path.rglob("*.kvb"))) == 4
    assert torch.count_nonzero(h.storage) > 0


@pytest.mark.parametrize("sync", [True, False])
def test_a_block_aligned_prompt_held_wholly_in_host_memory_computes_its_last_token(
        sync: bool) -> None:
    """Every block of the prompt is in host memory. vLLM's scheduler asserts that a request
    with a synchronous load still computes a token (its logits give the first output), so the
    sync hit must end a block early; an async hit may cover the prompt (vLLM recomputes its
    last token itself)."""
    aligned = PROMPT[:4 * BLOCK_SIZE]
    h = Harness.build(offload_extra(sync_host_loads=sync))
    a = h.add("a", aligned, max_tokens=2)
    h.run()
    assert stored_blocks(h) == 4
    assert h.scheduler.reset_prefix_cache()
    h.storage.zero_()
    b = h.add("b", aligned, max_tokens=2)
    h.step()  # vLLM's schedule() would fail its assert on a sync hit of the whole prompt
    if sync:
        assert b.num_computed_tokens == 4 * BLOCK_SIZE and len(b.output_token_ids) == 1
    h.run()
    stats = h.connector.scheduler_half.stats
    assert stats.num_host_hit_tokens == (3 if sync else 4) * BLOCK_SIZE
    assert stats.num_sync_loads == (1 if sync else 0)
    assert list(b.output_token_ids) == list(a.output_token_ids)
    h.assert_nothing_leaked()
