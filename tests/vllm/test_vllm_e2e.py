"""kvport's OffloadingConnector inside vLLM's CPU build, end to end, on SmolLM2-135M in float32:
greedy tokens and logprobs equal with and without the connector; after reset_prefix_cache() the
prompts come back from the host tier; a second process on the same disk root gets disk hits, and
one on the same Redis gets Redis hits; a KV space small enough to force preemption still gives
equal output. The engines run in the session's engine pool (conftest.py), a fresh engine per
configuration; a "second process" is one that has not run the first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from engine_pool import EnginePool
from redis_fixtures import RedisServer

PREFIX_TOKENS = 640  # the shared prefix: 5 of vLLM's 128-token CPU blocks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         engine_pool: EnginePool) -> dict[str, dict[str, Any]]:
    disk = str(tmp_path_factory.mktemp("kv-disk"))
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    pd_redis = RedisServer(tmp_path_factory.mktemp("pd-redis")).start()  # nothing else on it

    def run_chain(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Engines one after another (a later one reads what the first stored), each later
        one in another process than the first: "a second process" is one."""
        done: dict[str, dict[str, Any]] = {}
        first: set[int] = set()
        for name, cfg in configs.items():
            done[name], pid = engine_pool.run("e2e", cfg, not_in=first)
            first = first or {pid}
        return done

    chains = [
        {"plain": {"num_prompts": 4},
         # 4 requests share 5 prefix blocks and grow past their own block while decoding:
         # 5 + 4 * 2 blocks do not fit in 11.
         "small_kv": {"connector": True, "num_prompts": 4, "max_num_seqs": 4,
                      "num_gpu_blocks_override": 11, "max_tokens": 140, "rounds": 2}},
        {"host": {"connector": True, "disk_dir": disk, "rounds": 3, "num_prompts": 4},
         "second_process": {"connector": True, "disk_dir": disk, "num_prompts": 4}},
        {"redis_first": {"connector": True, "redis_url": redis.url, "num_prompts": 4},
         "redis_second": {"connector": True, "redis_url": redis.url, "num_prompts": 4},
         # prefill/decode split through Redis: a consumer only loads what others computed
         "redis_consumer": {"connector": True, "redis_url": redis.url, "num_prompts": 4,
                            "kv_role": "kv_consumer"}},
        # prefill/decode disaggregation through Redis: a producer prefills (one token each),
        # a consumer in another process decodes from what it stored
        {"pd_prefill": {"connector": True, "redis_url": pd_redis.url, "num_prompts": 4,
                        "kv_role": "kv_producer", "max_tokens": 1},
         "pd_decode": {"connector": True, "redis_url": pd_redis.url, "num_prompts": 4,
                       "kv_role": "kv_consumer"}},
    ]
    try:
        with ThreadPoolExecutor(len(chains)) as pool:
            return {name: run for done in pool.map(run_chain, chains)
                    for name, run in done.items()}
    finally:
        redis.stop()
        pd_redis.stop()


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal greedy tokens and logprobs (over the shorter of the two generations)."""
    n = min(len(a["tokens"][0]), len(b["tokens"][0]))
    assert [t[:n] for t in a["tokens"]] == [t[:n] for t in b["tokens"]]
    diff = max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"])
               for x, y in zip(la[:n], lb[:n]))
    # A hit prefills only the suffix: other matmul shapes, another float32 summation order
    # (measured up to 1.4e-5 with one thread per engine; the tokens are equal).
    assert diff <= 1e-4, f"logprobs differ by {diff}"


def test_outputs_equal_with_and_without_the_connector(runs: dict[str, dict[str, Any]]) -> None:
    reference = runs["plain"]["rounds"][0]
    for rnd in runs["host"]["rounds"]:
        assert_same(rnd, reference)


def test_the_layout_asked_is_the_cpu_backends_and_names_the_disk_namespace(
        runs: dict[str, dict[str, Any]]) -> None:
    """kvport asks LBHNC, vLLM's CPU backend's only layout: vLLM resolves it without a warning
    (a wish it cannot grant is dropped with one), and kvport's disk namespace names it."""
    layout = runs["host"]["layout"]
    assert layout == {"asked": "LBHNC", "resolved": "LBHNC", "kv_cache_config": "LBHNC",
                      "spec": "vllm-LBHNC|tp0of1", "warnings": []}


def test_repeated_prompts_are_served_from_the_host_tier(runs: dict[str, dict[str, Any]]) -> None:
    host = runs["host"]
    for rnd in host["rounds"][1:]:  # after reset_prefix_cache(): the engine's cache is empty
        assert rnd["num_cached_tokens"] == [PREFIX_TOKENS] * 4
    # The prefix is a synchronous host hit of the first request admitted in a round; vLLM
    # gives the others, admitted in the same step, the blocks it loads (same-step sharing).
    assert host["stats"]["num_host_hit_tokens"] == 2 * PREFIX_TOKENS
    assert host["stats"]["num_sync_loads"] == host["stats"]["num_load_jobs"] == 2
    assert host["metrics"]["host"]["blocks_stored"] == 5  # the shared prefix, stored once
    assert host["stats"]["num_failed_loads"] == 0


def test_a_second_process_on_the_same_disk_root_gets_disk_hits(
        runs: dict[str, dict[str, Any]]) -> None:
    second = runs["second_process"]
    assert second["stats"]["num_disk_hit_tokens"] >= PREFIX_TOKENS
    assert second["metrics"]["disk"]["blocks_loaded"] >= 5
    assert_same(second["rounds"][0], runs["plain"]["rounds"][0])
    # The first request admitted promotes the prefix from disk; the other three, whose hit run
    # ends at the keys it is writing to the host tier, wait for it (asked again each step) and
    # then get the prefix from vLLM's prefix cache: nobody computes it.
    assert second["rounds"][0]["num_cached_tokens"] == [PREFIX_TOKENS] * 4
    assert second["stats"]["num_load_jobs"] == 1
    requests = second["metrics"]["requests"]
    assert requests["num_inflight_waits"] >= 3 and requests["num_inflight_timeouts"] == 0


def test_a_second_process_on_the_same_redis_gets_redis_hits(
        runs: dict[str, dict[str, Any]]) -> None:
    first, second = runs["redis_first"], runs["redis_second"]
    assert first["metrics"]["redis"]["blocks_stored"] >= 5, first["metrics"]["redis"]
    assert second["stats"]["num_redis_hit_tokens"] >= PREFIX_TOKENS
    assert second["stats"]["num_host_hit_tokens"] == 0
    assert second["metrics"]["redis"]["blocks_loaded"] >= 5
    assert second["metrics"]["redis"]["lookup_round_trips"] >= 1
    for run in (first, second):
        assert_same(run["rounds"][0], runs["plain"]["rounds"][0])


def test_a_kv_consumer_on_redis_loads_and_never_stores(runs: dict[str, dict[str, Any]]) -> None:
    consumer = runs["redis_consumer"]
    assert consumer["stats"]["num_redis_hit_tokens"] >= PREFIX_TOKENS
    assert consumer["metrics"]["redis"]["blocks_stored"] == 0
    assert consumer["stats"]["num_store_jobs"] == 0
    assert_same(consumer["rounds"][0], runs["plain"]["rounds"][0])


def test_prefill_and_decode_split_through_redis(runs: dict[str, dict[str, Any]]) -> None:
    """A kv_producer prefills, a kv_consumer in another process decodes with the prompts' KV
    loaded: it computes at most the last, partial block of each prompt, and says what one
    instance doing both says."""
    prefill, decode, plain = runs["pd_prefill"], runs["pd_decode"], runs["plain"]
    # (the producer's Redis writes may end after its last step: its counters need not show them)
    assert prefill["stats"]["num_load_jobs"] == 0 and prefill["stats"]["num_store_jobs"] > 0
    assert decode["stats"]["num_store_jobs"] == 0
    lens = decode["prompt_lens"]
    cached = decode["rounds"][0]["num_cached_tokens"]
    assert all(c >= n - 128 for c, n in zip(cached, lens, strict=True)), (cached, lens)
    assert decode["stats"]["num_redis_hit_tokens"] > 0
    assert_same(decode["rounds"][0], plain["rounds"][0])
    assert [t[:1] for t in prefill["rounds"][0]["tokens"]] == \
        [t[:1] for t in plain["rounds"][0]["tokens"]]


def test_a_kv_space_that_forces_preemption_gives_equal_output(
        runs: dict[str, dict[str, Any]]) -> None:
    small = runs["small_kv"]
    assert small["preemptions"] > 0, "the KV space was not small enough to preempt"
    for rnd in small["rounds"]:
        assert_same(rnd, runs["plain"]["rounds"][0])
