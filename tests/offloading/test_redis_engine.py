"""The Redis tier in the engine, against real redis-server processes (tests/redis_fixtures.py):
KV one process computed is loaded by another (sync, async, worker process, a three-node cluster),
prefill/decode split through the store, tenants kept apart, and every fault (Redis absent at start,
killed and restarted, slow, full, keys vanishing or corrupted between lookup and load) leaves the
output equal to no connector, the trace clean, nothing leaked, and the tier's metrics counting it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kvport import LLM, SamplingParams
from kvport.trace.checker import check_file
from offload_utils import (
    GREEDY, MODES, OFFLOAD_BLOCK, all_blocks_hit, assert_nothing_leaked, make_llm,
    offload_config, offloading_half, prompts, run, run_one_by_one, step_until,
)
from redis_fixtures import RedisServer, wait_for

HERE = Path(__file__).parent
# The distinct full offload blocks of prompts(): at least this many keys once they were computed
# (decoded tokens fill more blocks).
NUM_PROMPT_BLOCKS = len({tuple(p[:(j + 1) * OFFLOAD_BLOCK]) for p in prompts()
                         for j in range(len(p) // OFFLOAD_BLOCK)})


def redis_llm(redis: dict[str, Any], trace: Path | None = None, kv_role: str = "kv_both",
              **kwargs: Any) -> LLM:
    extra = {"record_trace": str(trace)} if trace is not None else {}
    return make_llm(offload_config(redis=redis, kv_role=kv_role, **extra), **kwargs)


def redis_metrics(llm: LLM) -> dict[str, Any]:
    return dict(llm.get_metrics()["connector"]["redis"])


def requests_metrics(llm: LLM) -> dict[str, Any]:
    return dict(llm.get_metrics()["connector"]["requests"])


def in_new_process(redis: dict[str, Any], kv_role: str = "kv_both", max_tokens: int = 6,
                   **kwargs: Any) -> list[list[int]]:
    """Another engine process on the same Redis computes prompts() (its host tier is its own,
    and it shuts down before this returns, so its write-throughs are done)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from kvport import SamplingParams
        from offload_utils import make_llm, offload_config, prompts
        llm = make_llm(offload_config(redis={redis!r}, kv_role={kv_role!r}), **{kwargs!r})
        params = SamplingParams(max_tokens={max_tokens}, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts(), params, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        m = llm.get_metrics()["connector"]["redis"]
        assert m["blocks_stored"] > 0 or {kv_role!r} == "kv_consumer", m
        llm.shutdown()
        print([o.outputs[0].token_ids for o in outs])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return eval(done.stdout.strip().splitlines()[-1])  # noqa: S307  # our own printed list


def finish(llm: LLM, trace: Path | None = None) -> None:
    """The end of every scenario: nothing leaked, the trace clean, a bounded shutdown."""
    assert_nothing_leaked(llm)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 15, "shutdown waited on Redis"
    if trace is not None:
        assert check_file(str(trace)) == []


# ---- sharing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_second_process_loads_what_the_first_computed(
    tmp_path: Path, reference: list[list[int]], redis_server: RedisServer, mode: str,
) -> None:
    redis = {"url": redis_server.url}
    assert in_new_process(redis) == reference
    assert redis_server.client().dbsize() >= NUM_PROMPT_BLOCKS
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm(redis, trace, **MODES[mode])
    tokens, cached = run_one_by_one(llm)
    assert tokens == reference and all_blocks_hit(cached), cached
    req, tier = requests_metrics(llm), redis_metrics(llm)
    assert req["num_host_hit_tokens"] == 0 and req["num_redis_hit_tokens"] > 0, req
    assert tier["blocks_loaded"] >= NUM_PROMPT_BLOCKS - 5 * 3, tier  # the rest: local hits
    assert tier["lookup_timeouts"] == tier["failures"] == tier["errors"] == 0, tier
    finish(llm, trace)


def test_a_cluster_is_shared_like_one_server(
    tmp_path: Path, reference: list[list[int]], redis_cluster: Any,
) -> None:
    redis = {"url": redis_cluster.url, "cluster": True}
    assert in_new_process(redis) == reference
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm(redis, trace)
    tokens, cached = run_one_by_one(llm)
    assert tokens == reference and all_blocks_hit(cached), cached
    assert requests_metrics(llm)["num_redis_hit_tokens"] > 0
    finish(llm, trace)


def test_disk_answers_first_and_redis_fills_the_rest(
    tmp_path: Path, reference: list[list[int]], redis_server: RedisServer,
) -> None:
    """Another machine's KV (Redis only) and this machine's disk in one hit run: each block comes
    from the highest tier that has it."""
    redis = {"url": redis_server.url}
    assert in_new_process(redis) == reference  # Redis has every block
    disk = tmp_path / "disk"
    disk.mkdir()
    first = make_llm(offload_config(disk_dir=disk))  # this machine: the first two prompts
    run(first, prompts()[:2])
    first.shutdown()
    llm = make_llm(offload_config(disk_dir=disk, redis=redis))
    tokens, cached = run_one_by_one(llm)
    assert tokens == reference and all_blocks_hit(cached), cached
    req = requests_metrics(llm)
    assert req["num_disk_hit_tokens"] > 0 and req["num_redis_hit_tokens"] > 0, req
    finish(llm)


def test_prefill_in_a_producer_decode_in_a_consumer(
    tmp_path: Path, reference: list[list[int]], redis_server: RedisServer,
) -> None:
    """Disaggregation through the store: a kv_producer computes the prompts (one token each), a
    kv_consumer loads their KV and decodes, with the output of one engine doing both."""
    redis = {"url": redis_server.url}
    in_new_process(redis, kv_role="kv_producer", max_tokens=1)
    trace = tmp_path / "trace.jsonl"
    consumer = redis_llm(redis, trace, kv_role="kv_consumer")
    tokens, cached = run_one_by_one(consumer)
    assert tokens == reference and all_blocks_hit(cached), cached
    assert redis_metrics(consumer)["blocks_stored"] == 0  # a consumer never writes
    finish(consumer, trace)


PAUSE_MS = 1500  # Redis holds every write this long: far longer than the engine's steps here


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_both"])
def test_a_producers_answer_comes_after_its_kv_is_in_redis(
    kv_role: str, redis_server: RedisServer,
) -> None:
    """A kv_producer's step ends once its stores are written through (sync_write_through), so a
    router that sends the request on to a decode instance when the answer comes finds the KV in
    Redis; kv_both answers at once and writes behind. Redis is made to hold writes for
    PAUSE_MS (CLIENT PAUSE ... WRITE), so "after" is not a matter of timing."""
    llm = redis_llm({"url": redis_server.url, "io_timeout_s": 10.0}, kv_role=kv_role)
    client = redis_server.client()
    client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
    start = time.monotonic()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reqs = [llm.engine.add_request(f"pd-{i}", p, params) for i, p in enumerate(prompts())]
    step_until(llm, lambda: all(r.is_finished for r in reqs))  # every answer is out
    answered_s = time.monotonic() - start
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    stored = client.dbsize()  # a read: served during the pause
    if kv_role == "kv_producer":
        assert stored == NUM_PROMPT_BLOCKS, (stored, answered_s)
        assert answered_s >= PAUSE_MS / 1000 * 0.9
    else:
        assert stored == 0 and answered_s < PAUSE_MS / 1000, (stored, answered_s)
    # the writes behind the answers (a step without work waits 2 ms for them)
    step_until(llm, lambda: not llm.engine.has_pending_work(), max_steps=20_000)
    assert redis_metrics(llm)["blocks_stored"] == client.dbsize() == NUM_PROMPT_BLOCKS
    finish(llm)


def test_tenants_with_different_salts_never_share(
    reference: list[list[int]], redis_server: RedisServer,
) -> None:
    in_new_process({"url": redis_server.url, "tenant_salt": "acme"})
    other = redis_llm({"url": redis_server.url, "tenant_salt": "globex"})
    tokens, _ = run_one_by_one(other)
    assert tokens == reference
    assert requests_metrics(other)["num_redis_hit_tokens"] == 0
    assert redis_metrics(other)["lookup_keys_found"] == 0
    finish(other)
    same = redis_llm({"url": redis_server.url, "tenant_salt": "acme"})
    tokens, cached = run_one_by_one(same)
    assert tokens == reference and all_blocks_hit(cached)
    finish(same)


# ---- faults -------------------------------------------------------------------------------------


def stored_once_up(llm: LLM, server: RedisServer, deadline_s: float = 30.0) -> None:
    """Feed new prompts until the tier writes to `server` again (its backoff has elapsed)."""
    seed = [100]

    def wrote() -> bool:
        seed[0] += 1
        assert run(llm, prompts(2, seed=seed[0]))[0]
        return int(server.client().dbsize()) > 0

    wait_for(wrote, "the Redis tier writing again", deadline_s)


def test_redis_absent_at_start_serves_and_recovers(
    tmp_path: Path, reference: list[list[int]], redis_server_factory: Any,
) -> None:
    server = redis_server_factory(start=False)
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm({"url": server.url}, trace)
    assert run(llm, prompts())[0] == reference  # stores skipped, lookups missed
    tier = redis_metrics(llm)
    assert tier["skipped_down"] + tier["errors"] > 0 and tier["blocks_stored"] == 0, tier
    server.start()
    stored_once_up(llm, server)
    assert redis_metrics(llm)["blocks_stored"] > 0
    finish(llm, trace)


def test_redis_killed_mid_run_then_restarted(
    tmp_path: Path, reference: list[list[int]], redis_server: RedisServer,
) -> None:
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm({"url": redis_server.url}, trace)
    assert run(llm, prompts())[0] == reference
    wait_for(lambda: redis_server.client().dbsize() >= NUM_PROMPT_BLOCKS, "write-throughs")
    redis_server.stop()
    llm.reset_prefix_cache(reset_connector=True)  # only Redis could answer now: it is gone
    tokens, cached = run_one_by_one(llm)
    assert tokens == reference
    assert requests_metrics(llm)["num_redis_hit_tokens"] == 0
    tier = redis_metrics(llm)
    assert tier["lookup_errors"] + tier["lookup_skipped_down"] > 0, tier
    redis_server.start()  # empty: no persistence
    stored_once_up(llm, redis_server)
    finish(llm, trace)


def test_a_slow_redis_is_a_miss_not_a_stall(
    tmp_path: Path, reference: list[list[int]], redis_server: RedisServer,
) -> None:
    redis = {"url": redis_server.url, "lookup_timeout_ms": 50}
    assert in_new_process(redis) == reference
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm(redis, trace)
    redis_server.client().execute_command("CLIENT", "PAUSE", 6000, "ALL")
    start = time.monotonic()
    req = llm.engine.add_request("slow", prompts()[0], GREEDY)
    step_until(llm, lambda: req.is_finished)
    # Answered without Redis: before the pause (6 s) ends, with room for a busy two-core CI (a
    # lookup waits 50 ms; the request's steps take tens of ms when idle).
    assert time.monotonic() - start < 5, "the request waited for a paused Redis"
    assert req.output_token_ids == reference[0] and req.num_cached_tokens == 0
    assert redis_metrics(llm)["lookup_timeouts"] >= 1
    # Its write-through waits for Redis in the background, bounded by io_timeout_s.
    step_until(llm, lambda: not llm.engine.has_pending_work(), max_steps=10**6)
    finish(llm, trace)


def test_a_full_redis_refuses_stores_and_serving_goes_on(
    tmp_path: Path, reference: list[list[int]], redis_server_factory: Any,
) -> None:
    server = redis_server_factory(maxmemory="1mb", maxmemory_policy="noeviction")
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm({"url": server.url}, trace, num_kv_blocks=96)
    assert run(llm, prompts(12, length=120))[0]  # far more KV than 1 MiB
    tier = redis_metrics(llm)
    assert tier["refused_stores"] > 0 and tier["skipped_stores"] >= tier["refused_stores"], tier
    llm.reset_prefix_cache(reset_connector=True)
    assert run(llm, prompts())[0] == reference
    finish(llm, trace)


def test_keys_vanishing_between_lookup_and_load_are_recomputed(
    tmp_path: Path, reference: list[list[int]], redis_server: RedisServer,
) -> None:
    """Redis owns eviction: a key found at scheduling time may be gone when the worker reads it.
    Those blocks fail to load and are recomputed; the output does not change."""
    redis = {"url": redis_server.url}
    assert in_new_process(redis) == reference
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm(redis, trace)
    lookup = offloading_half(llm).lower.redis
    assert lookup is not None
    found = lookup.exists

    def evicted_right_after(keys: list[bytes]) -> list[bool]:
        answer = found(keys)
        redis_server.client().flushall()  # as an LRU eviction could, between lookup and load
        return answer

    lookup.exists = evicted_right_after  # type: ignore[method-assign]
    tokens, _ = run_one_by_one(llm)
    assert tokens == reference
    tier, req = redis_metrics(llm), requests_metrics(llm)
    assert tier["vanished"] > 0 and req["num_failed_loads"] > 0, (tier, req)
    finish(llm, trace)


def test_corrupt_values_fail_their_load_and_are_removed(
    tmp_path: Path, reference: list[list[int]], redis_server: RedisServer,
) -> None:
    redis = {"url": redis_server.url}
    assert in_new_process(redis) == reference
    admin = redis_server.client()
    good = {key: admin.get(key) for key in admin.keys("*")}
    for i, (key, value) in enumerate(sorted(good.items())):  # bytes flipped, or cut short
        admin.set(key, value[:-7] if i % 2 else value[:-1] + bytes([value[-1] ^ 0xFF]))
    trace = tmp_path / "trace.jsonl"
    llm = redis_llm(redis, trace)
    tokens, _ = run_one_by_one(llm)
    assert tokens == reference
    tier = redis_metrics(llm)
    assert tier["corrupt"] >= NUM_PROMPT_BLOCKS - 5 * 3, tier  # all but the local hits
    finish(llm, trace)
    # Each value read was deleted (and the recompute's stores wrote it again); what is still
    # corrupt was never read (blocks only decoding filled, which no prompt here asks for).
    still_bad = [key for key, value in good.items() if admin.get(key) not in (None, value)]
    assert len(still_bad) == len(good) - tier["corrupt"], (len(still_bad), len(good), tier)
