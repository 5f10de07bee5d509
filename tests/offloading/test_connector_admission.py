"""Admission control (store_threshold) through the engine: a request counts once per admission,
however often the scheduler matched it before, and promotions from disk are never held back."""

from __future__ import annotations

from pathlib import Path

from kvport import SamplingParams
from kvport.connectors.offloading.geometry import offload_keys
from kvport.engine.hashing import hash_blocks
from offload_utils import (
    BLOCK_SIZE, OFFLOAD_BLOCK, assert_nothing_leaked, host_metrics, make_llm, offload_config,
    offloading_half, prompts, run_bounded,
)

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def keys_of(llm: object, prompt: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    hash_blocks(llm.engine.hash_root, prompt, BLOCK_SIZE, hashes)  # type: ignore[attr-defined]
    return offload_keys(hashes, OFFLOAD_BLOCK // BLOCK_SIZE)


def test_a_retried_request_counts_once_for_admission() -> None:
    # A (100 tokens) holds 25 of the 32 blocks, so B (40 tokens, 10 blocks) cannot be allocated
    # until A finishes: the scheduler matches B on every step until then. With
    # store_threshold=2, B alone is one request: its blocks are deferred, not stored.
    llm = make_llm(offload_config(store_threshold=2), num_kv_blocks=32)
    half = offloading_half(llm)
    matched: list[str] = []
    match = half.get_num_new_matched_tokens

    def counting_match(request, num_local):  # type: ignore[no-untyped-def]
        matched.append(request.request_id)
        return match(request, num_local)

    half.get_num_new_matched_tokens = counting_match  # type: ignore[method-assign]
    a, b = prompts(1, length=100, seed=1)[0], prompts(1, length=40, seed=2)[0]
    assert run_bounded(llm, [a, b], PARAMS) == run_bounded(make_llm(), [a, b], PARAMS)
    assert matched.count("bounded-1") >= 3, matched  # B was matched again and again
    assert not any(half.manager.contains(k) for k in keys_of(llm, b))
    host = llm.get_metrics()["connector"]["host"]
    assert host["lookups"] == 2 and host["num_deferred_blocks"] > 0  # two admissions
    llm.reset_prefix_cache()  # B's prompt again, not a local hit: a second request asks
    run_bounded(llm, [b], PARAMS)
    assert all(half.manager.contains(k) for k in keys_of(llm, b))
    assert llm.get_metrics()["connector"]["host"]["lookups"] == 3
    assert_nothing_leaked(llm)


def test_disk_hits_are_promoted_whatever_the_admission_count(tmp_path: Path) -> None:
    # The first engine stores P on the second request for it (written through to disk). A new
    # engine on the same directory has seen P once when it promotes P's blocks: they are hits,
    # promoted whatever admission control thinks of them.
    p = prompts(1, seed=4)[0]
    cfg = offload_config(disk_dir=tmp_path, store_threshold=2)
    first = make_llm(cfg)
    want = run_bounded(first, [p], PARAMS)
    first.reset_prefix_cache()
    assert run_bounded(first, [p], PARAMS) == want
    assert all(offloading_half(first).manager.contains(k) for k in keys_of(first, p))
    assert_nothing_leaked(first)
    first.shutdown()
    second = make_llm(cfg)
    assert run_bounded(second, [p], PARAMS) == want
    m = second.get_metrics()
    assert host_metrics(second)["num_disk_hit_tokens"] >= 7 * OFFLOAD_BLOCK - 1
    assert host_metrics(second)["num_failed_loads"] == 0
    assert m["kv_transfer"]["num_invalid_blocks"] == 0
    assert_nothing_leaked(second)
