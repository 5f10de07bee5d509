"""The Redis tier behind a loopback fault proxy (tests/redis_proxy.py) in front of a real
redis-server: latency, throttling, trickled replies, a reset in the middle of a pipeline, a
half-open connection; and Redis evicting (maxmemory below the working set, allkeys-lru).

Each fault: every call ends within its bound (the whole call's deadline, not a socket timeout
per read), the counters equal what was injected, and what is loaded is exactly what was stored
or nothing. In the engine: outputs equal to no connector, nothing leaked.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_fixtures import RedisServer, wait_for
from redis_proxy import FaultProxy
from redis_tier_utils import (
    PAYLOAD, filled_host, key, load, loaded_exactly, store, tier_and_lookup, untouched,
)

from kvport import LLM
from kvport.connectors.offloading.config import RedisTierConfig
from offload_utils import (
    assert_nothing_leaked, host_metrics, make_llm, offload_block_bytes, offload_config,
    offloading_half, prompts, run,
)

IO_S = 0.5  # the tier's deadline per call
LOOKUP_MS = 100
SLACK_S = 2.0  # a busy two-core CI: scheduling, not Redis
RECOVER_S = 10.0
# One request in the engine: its lookup's bound, one load's deadline, and compute, which takes
# up to a few seconds on a loaded two-core CI (measured: 0.01-2 s a request at load 6-8). Each
# fault unbounded would take minutes (a trickle) or forever (half-open without a deadline).
ENGINE_BOUND_S = LOOKUP_MS / 1000 + IO_S + 10.0
Factory = Callable[..., RedisServer]


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    p = FaultProxy(redis_server.port).start()
    try:
        yield p
    finally:
        p.stop()


def config(proxy: FaultProxy) -> RedisTierConfig:
    return RedisTierConfig(proxy.url, io_timeout_s=IO_S, lookup_timeout_ms=LOOKUP_MS)


def within(limit_s: float, fn: Callable[[], Any]) -> Any:
    """fn() on a thread, which must end within limit_s (else the test fails at once, and the
    proxy's stop at teardown ends the call)."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive() and box, f"the call outlived its bound ({limit_s} s)"
    return box[0]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    out = fn()
    return out, time.monotonic() - start


# --- the tier itself -------------------------------------------------------------------------


def test_latency_within_the_deadline_serves_beyond_it_times_out_once(proxy: FaultProxy) -> None:
    tier, lookup = tier_and_lookup(config(proxy))
    host, ids = filled_host(4), [0, 1, 2, 3]
    assert lookup.exists([key(0)]) == [False]  # connected (its handshake is 2 round trips)
    proxy.set(latency_s=0.02)
    assert store(tier, host, ids).failed_indices == []
    assert lookup.exists([key(i) for i in ids]) == [True] * 4
    assert loaded_exactly(tier, host, ids, [8, 9, 10, 11])
    proxy.set(latency_s=IO_S + 0.5)
    out, elapsed = timed(lambda: load(tier, host, ids, [12, 13, 14, 15]))
    assert out.failed_indices == ids and elapsed < IO_S + SLACK_S, elapsed
    assert untouched(host, [12, 13, 14, 15])
    found, elapsed = timed(lambda: lookup.exists([key(0)]))
    assert found == [False] and elapsed < LOOKUP_MS / 1000 + SLACK_S, elapsed
    s, ls = tier.stats.snapshot(), lookup.stats()
    assert (s.timeouts, s.errors, s.failures) == (1, 0, 4), s
    assert (ls.timeouts, ls.errors) == (1, 0), ls
    proxy.clear()
    wait_for(lambda: loaded_exactly(tier, host, ids, [12, 13, 14, 15]), "recovery", RECOVER_S)


def test_a_trickled_reply_is_cut_at_the_whole_calls_deadline(proxy: FaultProxy) -> None:
    """One byte every 2 ms: each socket read returns well within the socket timeout, so only
    the call's own deadline (the watchdog) ends the load; 64 KiB would take two minutes."""
    tier, lookup = tier_and_lookup(config(proxy))
    host, ids = filled_host(4), [0, 1, 2, 3]
    assert store(tier, host, ids).failed_indices == []
    proxy.set(trickle_s=0.002, min_bytes=1024)  # the GET replies, not the EXISTS replies
    assert lookup.exists([key(i) for i in ids]) == [True] * 4
    out = within(IO_S + SLACK_S, lambda: load(tier, host, ids, [8, 9, 10, 11]))
    assert out.failed_indices == ids and untouched(host, [8, 9, 10, 11])
    s = tier.stats.snapshot()
    assert (s.timeouts, s.errors, s.round_trips) == (1, 0, 3), s  # EXISTS, SET, GET
    proxy.clear()
    wait_for(lambda: loaded_exactly(tier, host, ids, [8, 9, 10, 11]), "recovery", RECOVER_S)


def test_throttled_a_small_job_fits_a_large_one_times_out(proxy: FaultProxy) -> None:
    tier, _ = tier_and_lookup(config(proxy))
    host = filled_host(16)
    assert store(tier, host, list(range(16))).failed_indices == []
    proxy.set(rate_bps=256 * 1024)  # 256 KiB/s: 2 values in 0.13 s, 16 in 1 s
    assert loaded_exactly(tier, host, [0, 1], [16, 17])
    out, elapsed = timed(lambda: load(tier, host, list(range(16)), list(range(16, 32))))
    assert len(out.failed_indices) == 16 and elapsed < IO_S + SLACK_S, elapsed
    s = tier.stats.snapshot()
    assert (s.timeouts, s.errors, s.blocks_loaded) == (1, 0, 2), s


def test_a_reset_in_the_middle_of_a_get_pipeline_fails_that_round_trip_only(
    proxy: FaultProxy,
) -> None:
    tier, _ = tier_and_lookup(config(proxy))
    host, ids = filled_host(8), list(range(8))
    assert store(tier, host, ids).failed_indices == []
    proxy.reset_after(PAYLOAD * 5 // 2)  # two and a half values into the replies
    out = load(tier, host, ids, list(range(8, 16)))
    assert out.failed_indices == ids and untouched(host, list(range(8, 16)))
    s = tier.stats.snapshot()
    assert (s.errors, s.timeouts, proxy.resets) == (1, 0, 1), s
    # A new connection, nothing of the cut reply read by it: exact bytes once the backoff ends.
    wait_for(lambda: loaded_exactly(tier, host, ids, list(range(8, 16))), "recovery", RECOVER_S)
    assert proxy.connections == 2


def test_a_reset_in_the_middle_of_a_set_pipeline_stores_whole_values_or_none(
    proxy: FaultProxy, redis_server: RedisServer,
) -> None:
    tier, _ = tier_and_lookup(config(proxy))
    host, ids = filled_host(8), list(range(8))
    assert store(tier, host, [0]).failed_indices == []  # the connection exists: EXISTS, SET
    proxy.reset_after(PAYLOAD * 7 // 2 + 2000, direction="up")  # past the EXISTS, in the SETs
    assert store(tier, host, ids[1:]).failed_indices == list(range(7))
    s = tier.stats.snapshot()
    assert (s.errors, s.timeouts, proxy.resets) == (1, 0, 1), s
    # What Redis holds is whole and exact (it runs complete commands only); the rest is absent.
    wait_for(lambda: load(tier, host, [0], [8]).failed_indices == [], "recovery", RECOVER_S)
    held = [i for i in ids if redis_server.client().exists(tier.key(key(i)))]
    assert 1 <= len(held) < 8, held
    assert loaded_exactly(tier, host, held, list(range(16, 16 + len(held))))


def test_a_half_open_connection_costs_one_timeout_then_skips(proxy: FaultProxy) -> None:
    """The server vanished without a FIN: the first call waits out its deadline, the next ones
    skip at once (the down state) and open no connection, until the backoff's probe."""
    tier, lookup = tier_and_lookup(config(proxy))
    host = filled_host(2)
    assert store(tier, host, [0, 1]).failed_indices == []
    assert lookup.exists([key(0)]) == [True]
    proxy.set(half_open=True)
    connections = proxy.connections
    answers, elapsed = timed(lambda: [lookup.exists([key(0), key(1)]) for _ in range(20)])
    assert answers == [[False, False]] * 20
    assert elapsed < LOOKUP_MS / 1000 + SLACK_S, elapsed
    ls = lookup.stats()
    assert ls.timeouts == 1 and ls.skipped_down >= 18, ls  # 20 unless CI stalled > 0.2 s
    out, elapsed = timed(lambda: load(tier, host, [0, 1], [8, 9]))
    assert out.failed_indices == [0, 1] and elapsed < IO_S + SLACK_S, elapsed
    assert tier.stats.snapshot().timeouts == 1
    assert proxy.connections - connections <= 2, "a probe per call while down"
    proxy.clear()
    wait_for(lambda: lookup.exists([key(0)]) == [True], "lookup recovery", RECOVER_S)
    wait_for(lambda: loaded_exactly(tier, host, [0, 1], [8, 9]), "tier recovery", RECOVER_S)


# --- in the engine ---------------------------------------------------------------------------


def proxied_llm(proxy: FaultProxy, **kwargs: Any) -> LLM:
    redis = {"url": proxy.url, "io_timeout_s": IO_S, "lookup_timeout_ms": LOOKUP_MS}
    return make_llm(offload_config(redis=redis), **kwargs)


def redis_metrics(llm: LLM) -> dict[str, Any]:
    return dict(llm.get_metrics()["connector"]["redis"])


def filled_through(llm: LLM, server: RedisServer, reference: list[list[int]]) -> int:
    """prompts() computed and written through (a clean proxy); then only Redis holds them."""
    assert run(llm, prompts())[0] == reference
    n = len({tuple(p[:(j + 1) * 8]) for p in prompts() for j in range(len(p) // 8)})
    wait_for(lambda: int(server.client().dbsize()) >= n, "write-throughs")
    llm.reset_prefix_cache(reset_connector=True)
    return n


FAULTS: dict[str, Callable[[FaultProxy], None]] = {
    "latency": lambda p: p.set(latency_s=LOOKUP_MS / 1000 + 0.2),  # lookups miss
    "trickle": lambda p: p.set(trickle_s=0.002, min_bytes=1024),  # loads cut at the deadline
    "reset": lambda p: p.reset_after(offload_block_bytes() * 3 // 2),  # one GET pipeline cut
    "half_open": lambda p: p.set(half_open=True),  # one timeout each, then down
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_in_the_engine_bounded_equal_outputs_counted(
    fault: str, reference: list[list[int]], redis_server: RedisServer, proxy: FaultProxy,
) -> None:
    llm = proxied_llm(proxy)
    filled_through(llm, redis_server, reference)
    FAULTS[fault](proxy)
    tokens = []
    for p in prompts():
        (out, _), elapsed = timed(lambda p=p: run(llm, [p]))
        tokens += out
        # A lookup's bound, a load's deadline, compute: never a wait on the fault itself.
        assert elapsed < ENGINE_BOUND_S, (fault, elapsed)
    assert tokens == reference
    tier, req = redis_metrics(llm), host_metrics(llm)
    if fault == "latency":
        assert tier["lookup_timeouts"] >= 1 and req["num_redis_hit_tokens"] == 0, tier
        assert tier["failures"] == 0, tier  # nothing found: nothing to load
    elif fault == "trickle":
        assert tier["timeouts"] >= 1 and tier["lookup_timeouts"] == 0, tier
        assert req["num_failed_loads"] >= 1, req
    elif fault == "reset":
        assert tier["errors"] == proxy.resets == 1 and tier["timeouts"] == 0, tier
        # The cut load, and any tried while its server was down (skipped, never waited).
        assert 1 <= req["num_failed_loads"] <= 1 + tier["skipped_down"], (tier, req)
        assert req["num_redis_hit_tokens"] > 0, req
    else:
        # One wait per probe (the backoff doubles), the other lookups skipped: at most one wait
        # per request.
        assert 1 <= tier["lookup_timeouts"] <= len(prompts()), tier
        assert tier["lookup_skipped_down"] >= 1, tier
        assert req["num_redis_hit_tokens"] == 0, req
    proxy.clear()
    assert_nothing_leaked(llm)
    (_, elapsed) = timed(llm.shutdown)
    assert elapsed < 15, "shutdown waited on the fault"


# --- Redis evicting ----------------------------------------------------------------------------


def test_eviction_below_the_working_set_counts_vanished_keys_outputs_equal(
    reference: list[list[int]], redis_server_factory: Factory,
) -> None:
    """maxmemory far below what the prompts store, allkeys-lru: keys the lookup found are
    evicted (by Redis, to make room for other writes) before the load reads them."""
    server = redis_server_factory(maxmemory="4mb", maxmemory_policy="allkeys-lru")
    llm = make_llm(offload_config(redis={"url": server.url}))
    filled_through(llm, server, reference)
    lookup = offloading_half(llm).lower.redis
    assert lookup is not None
    found, admin, gone = lookup.exists, server.client(), []

    def evicting_right_after(keys: list[bytes]) -> list[bool]:
        answer = found(keys)
        run = len(list(itertools.takewhile(bool, answer)))  # a hit run ends at the first miss
        held = [lookup.keyspace.key(k) for k in keys[:run]]
        filler = b"x" * 65536
        for i in range(80):  # 5 MiB of other writes: Redis evicts the least recently used
            admin.set(f"filler:{len(gone)}:{i}", filler)
        gone.append(sum(1 for k in held if not admin.exists(k)))
        return answer

    lookup.exists = evicting_right_after  # type: ignore[method-assign]
    tokens = []
    for p in prompts():
        tokens += run(llm, [p])[0]
    assert tokens == reference
    tier, req = redis_metrics(llm), host_metrics(llm)
    evicted = int(admin.info("stats")["evicted_keys"])
    # Every key of a hit run evicted between its lookup and its load is a vanished block (a
    # failed load recomputed), and nothing else is; but for the run's last block, which a
    # request leaves to compute when it holds the prompt's last token (one per request at most).
    assert evicted > 0 and sum(gone) > 0, (tier, gone)
    assert sum(gone) - len(prompts()) <= tier["vanished"] <= sum(gone), (tier, gone)
    assert tier["corrupt"] == tier["errors"] == 0 and req["num_failed_loads"] > 0, (tier, req)
    assert_nothing_leaked(llm)
    llm.shutdown()
