"""The Redis tier on a Redis Cluster that is down, partly served, moving slots, failing over or
losing nodes (real redis-server processes, tests/redis_fixtures.py).

D1: a cluster nobody answers, and slots nobody serves, are misses (counted, down state), never
an exception; several startup nodes. D6: MOVED and ASK followed within the call, a down state
per server (a dead master costs its slots only). Chaos: reshard, CLUSTER FAILOVER and the URL's
node killed during a workload of kvport's engine: outputs equal, hits come back, connections
bounded, nothing leaked.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot
from redis_fixtures import HOST, RedisClusterServers, RedisServer, free_port, wait_for
from redis_tier_utils import (
    filled_host, key, load, loaded_exactly, store, tier_and_lookup, untouched,
)

from kvport import LLM
from kvport.connectors.offloading.config import RedisTierConfig
from kvport.connectors.offloading.tiers.redis.tier import RedisTier
from offload_utils import (
    assert_nothing_leaked, host_metrics, make_llm, offload_config, prompts, run,
)

SLACK_S = 1.0  # a busy two-core CI
MAX_ROUNDS = 40  # workload rounds while one chaos step runs (a bound instead of a hang)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """3 masters, no replicas, for this module (tests move slots; none kills a node)."""
    c = RedisClusterServers(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield c
    finally:
        c.stop()


def cluster_config(url: str, *nodes: str, **kw: Any) -> RedisTierConfig:
    kw.setdefault("lookup_timeout_ms", 200)
    kw.setdefault("io_timeout_s", 1.0)
    if nodes:
        kw["startup_nodes"] = tuple(nodes)
    return RedisTierConfig(url, cluster=True, **kw)


def node_of(c: RedisClusterServers, tier: RedisTier, i: int) -> RedisServer:
    return c.master_of_slot(key_slot(tier.key(key(i))))


def move_slot(c: RedisClusterServers, slot: int, src: RedisServer, dst: RedisServer,
              finalize: bool = True) -> None:
    """What redis-cli reshard does for one slot: IMPORTING, MIGRATING, MIGRATE its keys, and
    (finalize) the new owner announced to every master."""
    c.admin(dst).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", c.node_id(src))
    c.admin(src).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", c.node_id(dst))
    keys = c.admin(src).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        c.admin(src).execute_command("MIGRATE", HOST, dst.port, "", 0, 5000, "KEYS", *keys)
    if finalize:
        for n in c.masters():
            c.admin(n).execute_command("CLUSTER", "SETSLOT", slot, "NODE", c.node_id(dst))


# --- D1: nobody answers, slots nobody serves, several startup nodes ------------------------------


def test_a_cluster_nobody_answers_is_a_miss_counted_and_down() -> None:
    cfg = cluster_config(f"redis://{HOST}:{free_port()}/0", f"{HOST}:{free_port()}",
                         lookup_timeout_ms=100, io_timeout_s=0.5)
    tier, lookup = tier_and_lookup(cfg)
    host = filled_host(3)
    start = time.monotonic()
    for _ in range(5):
        assert lookup.exists([key(0), key(1), key(2)]) == [False] * 3
    assert store(tier, host, [0, 1, 2]).failed_indices == [0, 1, 2]
    assert load(tier, host, [0, 1, 2], [8, 9, 10]).failed_indices == [0, 1, 2]
    assert time.monotonic() - start < 0.5 + SLACK_S
    ls = lookup.stats()
    # One attempt at a map (then its down state paces them); every call counted as skipped.
    assert ls.map_refreshes == 1 and ls.skipped_down == 5, ls
    assert lookup._conn.down and tier._conn.down
    assert tier.stats.snapshot().failures == 3 and untouched(host, [8, 9, 10])


def test_an_engine_on_a_cluster_nobody_answers_serves_every_request(
    reference: list[list[int]],
) -> None:
    redis = {"url": f"redis://{HOST}:{free_port()}/0", "cluster": True,
             "startup_nodes": [f"{HOST}:{free_port()}"], "lookup_timeout_ms": 50}
    llm = make_llm(offload_config(redis=redis))
    assert run(llm, prompts())[0] == reference
    tier = dict(llm.get_metrics()["connector"]["redis"])
    assert tier["lookup_skipped_down"] >= 1 and tier["blocks_stored"] == 0, tier
    assert_nothing_leaked(llm)
    llm.shutdown()


def test_slots_nobody_serves_miss_and_the_served_ones_hit(
    redis_server_factory: Any,
) -> None:
    server = redis_server_factory(cluster=True,
                                  extra_args=("--cluster-require-full-coverage", "no"))
    server.client().execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 8191)
    wait_for(lambda: server.client().cluster("INFO")["cluster_state"] == "ok", "one-node cluster")
    tier, lookup = tier_and_lookup(cluster_config(server.url))
    ids = list(range(12))
    served = [i for i in ids if key_slot(tier.key(key(i))) <= 8191]
    assert 0 < len(served) < len(ids)
    host = filled_host(12)
    failed = store(tier, host, ids).failed_indices
    assert failed == [i for i in ids if i not in served]
    assert lookup.exists([key(i) for i in ids]) == [i in served for i in ids]
    assert loaded_exactly(tier, host, served, [16 + i for i in range(len(served))])
    assert tier.stats.snapshot().skipped_down >= 1 and lookup.stats().skipped_down >= 1


def test_the_urls_node_gone_a_startup_node_reaches_the_cluster(
    cluster: RedisClusterServers,
) -> None:
    cluster.flush()
    dead = f"redis://{HOST}:{free_port()}/0"
    cfg = cluster_config(dead, *[f"{HOST}:{n.port}" for n in cluster.nodes[1:]])
    tier, lookup = tier_and_lookup(cfg)
    host = filled_host(8)
    assert store(tier, host, list(range(8))).failed_indices == []
    assert lookup.exists([key(i) for i in range(8)]) == [True] * 8
    assert loaded_exactly(tier, host, list(range(8)), list(range(8, 16)))


# --- D6: MOVED and ASK followed in the call, one server down on its own ---------------------------


def test_a_moved_slot_is_followed_within_the_call(cluster: RedisClusterServers) -> None:
    cluster.flush()
    tier, lookup = tier_and_lookup(cluster_config(cluster.url))
    host = filled_host(2)
    assert store(tier, host, [0, 1]).failed_indices == []
    slot, src = key_slot(tier.key(key(0))), node_of(cluster, tier, 0)
    dst = next(n for n in cluster.masters() if n is not src)
    move_slot(cluster, slot, src, dst)
    refreshes = tier._conn.map_refreshes
    assert loaded_exactly(tier, host, [0], [8])  # MOVED, then the new owner: one call
    s = tier.stats.snapshot()
    assert s.redirects == 1 and tier._conn.map_refreshes == refreshes, s
    assert lookup.exists([key(0)]) == [True]
    assert loaded_exactly(tier, host, [0], [9])  # the slot's owner learned: no redirect
    assert tier.stats.snapshot().redirects == 1


def test_an_ask_during_a_slots_migration_is_followed_with_asking(
    cluster: RedisClusterServers,
) -> None:
    cluster.flush()
    tier, _ = tier_and_lookup(cluster_config(cluster.url))
    host = filled_host(1)
    assert store(tier, host, [0]).failed_indices == []
    slot, src = key_slot(tier.key(key(0))), node_of(cluster, tier, 0)
    dst = next(n for n in cluster.masters() if n is not src)
    move_slot(cluster, slot, src, dst, finalize=False)  # the key moved, the slot not yet
    try:
        assert loaded_exactly(tier, host, [0], [8])
        assert tier.stats.snapshot().redirects == 1
        assert loaded_exactly(tier, host, [0], [9])  # ASK moves nothing: asked again
        assert tier.stats.snapshot().redirects == 2
    finally:
        for n in cluster.masters():
            cluster.admin(n).execute_command("CLUSTER", "SETSLOT", slot, "NODE",
                                             cluster.node_id(dst))


def test_a_dead_master_costs_its_slots_only(tmp_path: Path) -> None:
    c = RedisClusterServers(tmp_path / "c").start()
    try:
        cfg = cluster_config(c.url, *[f"{HOST}:{n.port}" for n in c.nodes[1:]],
                             io_timeout_s=0.5)
        tier, lookup = tier_and_lookup(cfg)
        ids = list(range(24))
        host = filled_host(24, slots=48)
        assert store(tier, host, ids).failed_indices == []
        victim = node_of(c, tier, 0)
        lost = [i for i in ids if node_of(c, tier, i) is victim]
        kept = [i for i in ids if i not in lost]
        assert lost and kept
        order = kept + lost  # the dead server's answer is handled last: it cannot hide its fall
        c.kill(victim)
        for _ in range(3):  # the first call finds it dead; the next ones skip it alone
            out = load(tier, host, order, list(range(24, 48)))
            assert out.failed_indices == list(range(len(kept), len(order)))
            assert lookup.exists([key(i) for i in order]) == [i in kept for i in order]
        assert loaded_exactly(tier, host, kept, list(range(24, 24 + len(kept))))
        s = tier.stats.snapshot()
        assert s.errors + s.timeouts >= 1 and s.skipped_down >= 2, s
    finally:
        c.stop()


# --- chaos: reshard, failover, the URL's node killed, during a workload -------------------------


def redis_hits(llm: LLM) -> int:
    return int(host_metrics(llm)["num_redis_hit_tokens"])


ROUND = 3  # prompts per workload round (of prompts(): pairs share a prefix)


def one_round(llm: LLM, reference: list[list[int]]) -> int:
    """The first ROUND prompts, one at a time, with only Redis to answer: outputs equal; the
    Redis hits."""
    llm.reset_prefix_cache(reset_connector=True)
    before = redis_hits(llm)
    tokens = []
    for p in prompts()[:ROUND]:
        tokens += run(llm, [p])[0]  # run() asserts no request failed
    assert tokens == reference[:ROUND]
    return redis_hits(llm) - before


def test_reshard_failover_and_the_urls_node_killed_during_a_workload(
    tmp_path: Path, reference: list[list[int]],
) -> None:
    c = RedisClusterServers(tmp_path / "c", replicas=1, node_timeout_ms=1000).start()
    try:
        a, b, d = c.masters()
        assert a is c.nodes[0]  # the URL's node is a master: killing it needs a failover
        redis = {"url": c.url, "cluster": True, "lookup_timeout_ms": 200, "io_timeout_s": 1.0,
                 "startup_nodes": [f"{HOST}:{n.port}" for n in c.nodes[1:]]}
        llm = make_llm(offload_config(redis=redis))
        assert run(llm, prompts())[0] == reference
        wait_for(lambda: sum(int(c.admin(m).dbsize()) for m in c.masters()) >= 20,
                 "write-throughs")
        connections = c.connections_received()
        assert one_round(llm, reference) > 0

        reshard = c.reshard(a, b, 1000)  # slots and their keys move while requests run
        rounds = 0
        while reshard.poll() is None:
            assert rounds < MAX_ROUNDS, "the reshard did not end"
            one_round(llm, reference)
            rounds += 1
        assert reshard.wait() == 0, (tmp_path / "c" / "reshard.log").read_text()[-2000:]
        c.wait_ok()
        assert one_round(llm, reference) > 0

        replica = c.replica_of(d)
        c.failover(replica)
        for _ in range(MAX_ROUNDS):
            if c.role(replica) == "master":
                break
            one_round(llm, reference)
        c.wait_ok()
        wait_for(lambda: one_round(llm, reference) > 0, "hits after the failover", 20)
        churn = c.connections_received() - connections

        c.kill(a)  # the URL's node; its replica takes over after the node timeout
        for _ in range(MAX_ROUNDS):
            if len(c.masters()) == 3:
                break
            one_round(llm, reference)
        c.wait_ok()
        wait_for(lambda: one_round(llm, reference) > 0, "hits after the URL's node died", 20)
        tier = dict(llm.get_metrics()["connector"]["redis"])
        assert rounds >= 1, "the reshard ended before the workload met it"
        assert tier["corrupt"] == tier["forged"] == 0, tier
        # Reconnects per server failure and per new owner, not per redirect or per call.
        assert churn < 60, churn
        assert_nothing_leaked(llm)
        llm.shutdown()
    finally:
        c.stop()
