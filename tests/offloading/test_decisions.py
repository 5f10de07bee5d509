"""The scheduler half's decision metrics in kvport's engine: every admitted prompt token counted
once, by where its KV came from; store outcomes per block; single measurements for histograms."""

from __future__ import annotations

from pathlib import Path

from kvport.connectors.offloading.scheduler.decisions import (
    ALLOCATION_BLOCKS, LOAD_BYTES, LOOKUP_CALL, STORE_BYTES, Observations, lookup_seconds,
)
from offload_utils import (
    assert_nothing_leaked, make_llm, offload_block_bytes, offload_config, offloading_half,
    prompts, run_one_by_one,
)


def test_prompt_tokens_by_source_add_up_and_store_outcomes_are_counted(tmp_path: Path) -> None:
    llm = make_llm(offload_config(disk_dir=tmp_path))
    half = offloading_half(llm)
    half.observations.take()
    ps = prompts()
    run_one_by_one(llm, ps)  # pairs share a 40-token prefix: the second's is the engine's own
    llm.reset_prefix_cache(reset_connector=True)  # now only the disk holds them
    run_one_by_one(llm, ps[:2])
    llm.reset_prefix_cache()  # the engine's own cache: the host tier serves them
    run_one_by_one(llm, ps[:2])
    d = llm.get_metrics()["connector"]["decisions"]
    sources = [d[f"prompt_tokens_{s}"] for s in ("device", "host", "disk", "redis", "computed")]
    assert sum(sources) == sum(len(p) for p in ps) + 2 * sum(len(p) for p in ps[:2])
    # the second of each pair: its 40 shared tokens are the engine's own, 16 more a tier's
    assert d["prompt_tokens_device"] >= 3 * 40 and d["prompt_tokens_disk"] == 56 + 16
    assert d["prompt_tokens_host"] == 56 + 16 and d["prompt_tokens_redis"] == 0
    assert d["host_stored_blocks"] > 0 and d["host_present_blocks"] > 0
    assert d["host_failed_blocks"] == 0 and d["host_usage"] == 0.0  # nothing in flight now
    seen = half.observations.take()
    for name in (LOOKUP_CALL, STORE_BYTES, LOAD_BYTES, ALLOCATION_BLOCKS,
                 lookup_seconds("HOST"), lookup_seconds("DISK")):
        assert seen.get(name), name
    assert set(seen[STORE_BYTES]) <= {n * offload_block_bytes() for n in range(1, 9)}
    assert half.observations.take() == {}  # taken
    assert_nothing_leaked(llm)


def test_observations_are_bounded_between_takes_and_kept_only_once_read() -> None:
    obs = Observations(max_per_name=3)
    obs.add("x", -1)
    assert obs.take() == {}  # nobody had asked: nothing kept
    for i in range(5):
        obs.add("x", i)
    assert obs.take() == {"x": [2, 3, 4]} and obs.num_dropped == 2


def test_a_preempted_request_counts_its_prompt_once() -> None:
    from kvport import SamplingParams

    llm = make_llm(offload_config(), num_kv_blocks=40)
    ps = prompts()
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ps, long, use_tqdm=False)  # 6 requests outgrow 40 blocks of 4 tokens
    assert all(o.error is None for o in outs)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    d = llm.get_metrics()["connector"]["decisions"]
    sources = [d[f"prompt_tokens_{s}"] for s in ("device", "host", "disk", "redis", "computed")]
    assert sum(sources) == sum(len(p) for p in ps)
    assert_nothing_leaked(llm)
