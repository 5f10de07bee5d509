"""OffloadingConnector in the engine: repeated prefixes come back from the host tier (after the
engine pool evicted them, after reset_prefix_cache), from disk (after host eviction, in a new
process), with greedy output equal to no connector, and nothing leaked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvport import SamplingParams
from kvport.connectors.offloading.geometry import offload_keys
from kvport.connectors.offloading.metadata import OffloadingConnectorMetadata
from kvport.engine.step import SchedulerOutput
from offload_utils import (
    MODES, OFFLOAD_BLOCK, all_blocks_hit, assert_nothing_leaked, host_metrics, make_llm,
    offload_block_bytes, offload_config, offloading_half, prompts, run, run_bounded,
    run_one_by_one, worker_half,
)


@pytest.mark.parametrize("mode", MODES)
def test_host_tier_serves_prefixes_the_pool_evicted(reference: list[list[int]], mode: str) -> None:
    # 48 blocks of 4 tokens hold three 61-token requests: later prompts evict earlier ones.
    llm = make_llm(offload_config(), **MODES[mode])
    tokens, _ = run(llm, prompts())
    assert tokens == reference
    tokens, cached = run(llm, prompts())  # the pool kept only the last prompts
    assert tokens == reference
    assert all_blocks_hit(cached), cached  # every full offload block came back
    assert host_metrics(llm)["num_host_hit_tokens"] > 0
    assert_nothing_leaked(llm)
    llm.reset_prefix_cache()
    tokens, cached = run(llm, prompts())
    assert tokens == reference and all_blocks_hit(cached), cached
    assert_nothing_leaked(llm)
    llm.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_disk_tier_serves_what_the_host_tier_evicted(
    tmp_path: Path, reference: list[list[int]], mode: str,
) -> None:
    # The host tier holds 8 offload blocks: one prompt's 7, far from all 42.
    llm = make_llm(offload_config(cpu_bytes=8 * offload_block_bytes(), disk_dir=tmp_path),
                   **MODES[mode])
    for p, want in zip(prompts(), reference):  # one at a time: every block fits the host tier
        assert run(llm, [p])[0] == [want]
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm)  # each finds all its blocks on disk
    assert tokens == reference
    assert all_blocks_hit(cached), cached
    llm.reset_prefix_cache()
    assert run(llm, prompts())[0] == reference  # a batch: promotions compete for the slots
    m = host_metrics(llm)
    assert m["num_disk_hit_tokens"] > 0 and m["num_failed_loads"] == 0, m
    assert_nothing_leaked(llm)
    llm.shutdown()


def test_a_hit_larger_than_the_host_tier_promotes_what_fits(
    tmp_path: Path, reference: list[list[int]],
) -> None:
    # 4 host slots, 7 offload blocks per prompt: stores go a part per step (all reach disk),
    # a hit promotes the first 4 and computes the rest.
    llm = make_llm(offload_config(cpu_bytes=4 * offload_block_bytes(), disk_dir=tmp_path))
    for p, want in zip(prompts(), reference):
        assert run(llm, [p])[0] == [want]
    llm.reset_prefix_cache()
    for p, want in zip(prompts(), reference):
        tokens, cached = run(llm, [p])
        assert tokens == [want] and cached[0] >= 4 * OFFLOAD_BLOCK, cached
    llm.reset_prefix_cache()
    assert run(llm, prompts())[0] == reference  # a batch: promotions compete for the slots
    assert_nothing_leaked(llm)


def test_host_reset_leaves_the_disk_tier(tmp_path: Path, reference: list[list[int]]) -> None:
    llm = make_llm(offload_config(disk_dir=tmp_path))
    outputs, _ = run(llm, prompts())
    # Every full offload block whose KV was computed (the last output token's never is).
    stored = {k for p, out in zip(prompts(), outputs)
              for k in offload_keys(_hashes(llm, p + out[:-1]), OFFLOAD_BLOCK // 4)}
    host = llm.get_metrics()["connector"]["host"]
    assert host["occupancy_blocks"] == len(stored)
    assert host["occupancy_bytes"] == host["occupancy_blocks"] * offload_block_bytes()
    assert llm.reset_prefix_cache(reset_connector=True) is True
    assert offloading_half(llm).manager.num_free_slots == offloading_half(llm).geometry.num_slots
    assert llm.get_metrics()["connector"]["host"]["occupancy_blocks"] == 0
    tokens, cached = run_one_by_one(llm)
    assert tokens == reference and all_blocks_hit(cached), cached
    assert host_metrics(llm)["num_host_hit_tokens"] == 0  # all from disk
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("mode", MODES)
def test_a_new_process_reads_the_disk_tier(
    tmp_path: Path, reference: list[list[int]], mode: str,
) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from offload_utils import make_llm, offload_config, prompts, run
        llm = make_llm(offload_config(disk_dir={str(tmp_path)!r}))
        print(run(llm, prompts())[0])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(reference)
    llm = make_llm(offload_config(disk_dir=tmp_path), **MODES[mode])
    tokens, cached = run_one_by_one(llm)
    assert tokens == reference and all_blocks_hit(cached), cached
    assert host_metrics(llm)["num_disk_hit_tokens"] >= 3 * 56  # the rest are local hits
    assert_nothing_leaked(llm)
    llm.shutdown()


@pytest.mark.parametrize("variant", ["stock", "one-step-late"])
def test_no_store_is_lost_when_every_other_step_has_no_forward(
    reference: list[list[int]], variant: str,
) -> None:
    # Async scheduling, and a token budget of 0 on every other step: those steps skip
    # wait_for_save, and requests finish while they are processed. The stock connector plans
    # stores only on steps with a forward; the one-step-late variant (late_store_connector)
    # hands them to the worker a step later, so some arrive on steps without one.
    ktc = offload_config()
    if variant == "one-step-late":
        ktc["kv_connector"] = "OneStepLateOffloadingConnector"
        ktc["kv_connector_module_path"] = "late_store_connector"
    llm = make_llm(ktc, async_scheduling=True, num_kv_blocks=200)  # no block is reused
    sched = llm.engine.scheduler
    budget = sched.config.max_num_batched_tokens
    schedule = sched.schedule
    empty_steps = 0

    def alternate() -> object:
        nonlocal empty_steps
        if sched.step_id % 2:
            object.__setattr__(sched.config, "max_num_batched_tokens", 0)
            empty_steps += 1
        try:
            return schedule()
        finally:
            object.__setattr__(sched.config, "max_num_batched_tokens", budget)

    sched.schedule = alternate  # type: ignore[method-assign]
    assert run_bounded(llm, prompts()) == reference and empty_steps >= 5
    half = offloading_half(llm)
    assert half.stats.num_store_jobs > 0 and half.stats.num_failed_stores == 0
    if variant == "one-step-late":  # the case the test is about did happen
        assert half.num_stores_on_empty_steps > 0  # type: ignore[attr-defined]
    for p in prompts():  # every full offload block of every prompt reached the host tier
        req_keys = offload_keys(_hashes(llm, p), OFFLOAD_BLOCK // 4)
        assert all(half.manager.contains(k) for k in req_keys)
    assert_nothing_leaked(llm)


def test_preempted_request_flushes_its_stores_and_loads_them_back() -> None:
    # Two 40-token prompts fit a pool of 24 blocks (4 tokens each), but not while they decode
    # 24 tokens each: the newest is preempted when the oldest needs a block, which is when the
    # store of the newest one's last full block (offload block = engine block) is pending.
    ps = [p[:40] for p in prompts(4, seed=3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in make_llm(max_model_len=96).generate(
        ps, params, use_tqdm=False)]
    llm = make_llm(offload_config(block_size=4), num_kv_blocks=24, max_model_len=96)
    half = offloading_half(llm)
    build = half.build_connector_meta
    checked = 0

    def checked_build(so: SchedulerOutput) -> OffloadingConnectorMetadata:
        nonlocal checked
        # Expected from the scheduler's output alone: the preempted requests' jobs that still
        # read or write their blocks (stores, late synchronous-load parts), and nothing else.
        expected = {j for rid in so.preempted_req_ids if rid in half._reqs
                    for j in half._reqs[rid].engine_jobs()}
        meta = build(so)
        assert meta.jobs_to_flush == expected
        checked += bool(so.preempted_req_ids and expected)
        return meta

    half.build_connector_meta = checked_build  # type: ignore[method-assign]
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0 and checked > 0
    assert half.stats.num_host_hit_tokens > 0  # a preempted request loaded its blocks back
    assert_nothing_leaked(llm)


def _hashes(llm: object, prompt: list[int]) -> list[bytes]:
    from kvport.engine.hashing import hash_blocks

    out: list[bytes] = []
    hash_blocks(llm.engine.hash_root, prompt, 4, out)  # type: ignore[attr-defined]
    return out


def test_the_torch_copy_path_serves_hits_as_the_native_one_does(
    tmp_path: Path, reference: list[list[int]],
) -> None:
    """`host_copy: "torch"` (a GPU pool's path, run on CPU): the engine's copies run on the
    stream handler, stores hand over to disk write-through, and hits from host and disk give the
    outputs the native copy gives."""
    llm = make_llm(offload_config(cpu_bytes=8 * offload_block_bytes(), disk_dir=tmp_path,
                                  host_copy="torch"))
    host = worker_half(llm).host
    assert host is not None and host.strategy == "torch"
    ps = prompts()
    for p, want in zip(ps, reference):  # one at a time: the host tier keeps the last prompt's
        assert run(llm, [p])[0] == [want]
    llm.reset_prefix_cache()
    for i, source in ((len(ps) - 1, "num_host_hit_tokens"), (0, "num_disk_hit_tokens")):
        tokens, cached = run(llm, [ps[i]])
        assert tokens == [reference[i]] and cached[0] > 0, (i, cached)
        assert host_metrics(llm)[source] > 0, host_metrics(llm)
    assert host_metrics(llm)["num_failed_loads"] == 0
    assert_nothing_leaked(llm)
    llm.shutdown()
