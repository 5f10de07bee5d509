"""RedisTier and RedisLookup against real redis-server processes (tests/redis_fixtures.py)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

import pytest
import torch
from redis_fixtures import RedisClusterServers, RedisServer, TlsFiles, free_port, wait_for

from kvport.connectors.offloading.config import RedisTierConfig
from kvport.connectors.offloading.mediums import HostBlocks, RedisBlocks
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.tiers.redis.client import RedisKeyspace, redis_namespace
from kvport.connectors.offloading.metrics import RedisLookupMetrics
from kvport.connectors.offloading.tiers.redis.lookup import RedisLookup
from kvport.connectors.offloading.tiers.redis.tier import RedisTier
from kvport.connectors.offloading.tiers.value_format import HEADER, MAGIC

NS = b"kvport-disk-v1|root|float32|layout|16|4|2|32|256"  # a geometry namespace
PAYLOAD = 4096
RECOVER_S = 10.0
PAUSE_MS = 1000  # CLIENT PAUSE: long enough to outlast the timeouts under test, short to wait out  # deadline for a tier to notice a (re)started server by itself
Factory = Callable[..., RedisServer]


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAYLOAD,), generator=torch.Generator().manual_seed(i),
                         dtype=torch.uint8)


def filled_host(n: int = 8, slots: int = 16) -> HostTier:
    """A host tier whose slot i holds payload(i) for i < n."""
    host = HostTier(slots, PAYLOAD)
    for i in range(n):
        host.slot(i).copy_(payload(i))
    return host


def store(tier: RedisTier, host: HostTier, ids: list[int]) -> TransferOutcome:
    return tier.store_from_host(host, HostBlocks(ids), RedisBlocks([key(i) for i in ids]))


def load(tier: RedisTier, host: HostTier, ids: list[int], slots: list[int]) -> TransferOutcome:
    return tier.load_to_host(host, RedisBlocks([key(i) for i in ids]), HostBlocks(slots))


def stored_ok(tier: RedisTier, host: HostTier, ids: list[int]) -> bool:
    return store(tier, host, ids).failed_indices == []


# --- round trips and format -------------------------------------------------------------------


def test_round_trip_in_one_round_trip_per_job(redis_server: RedisServer) -> None:
    """A load is one round trip; a store two (which keys Redis holds, then the SETs)."""
    cfg = RedisTierConfig(redis_server.url)
    tier, host = RedisTier(cfg, NS), filled_host()
    assert store(tier, host, [0, 1, 2, 3]) == TransferOutcome(4 * PAYLOAD, [])
    assert tier.stats.snapshot().round_trips == 2
    lookup = RedisLookup(cfg, NS)
    assert lookup.exists([key(0), key(9), key(3)]) == [True, False, True]
    assert lookup.stats() == RedisLookupMetrics(lookups=1, keys_queried=3, keys_found=2,
                                                round_trips=1)
    got = load(tier, host, [3, 2, 9, 1, 0], [8, 9, 10, 11, 12])
    assert got == TransferOutcome(4 * PAYLOAD, [2])
    for i, slot in ((3, 8), (2, 9), (1, 11), (0, 12)):
        assert torch.equal(host.slot(slot), payload(i))
    s = tier.stats.snapshot()
    assert (s.round_trips, s.blocks_stored, s.bytes_stored) == (3, 4, 4 * PAYLOAD)
    assert (s.blocks_loaded, s.bytes_loaded, s.failures, s.vanished) == \
        (4, 4 * PAYLOAD, 1, 1)
    assert tier.load_to_host(host, RedisBlocks([]), HostBlocks([])) == TransferOutcome(0, [])
    assert tier.stats.snapshot().round_trips == 3  # nothing to do: no network
    tier.close()
    lookup.close()


def test_a_value_redis_holds_is_not_sent_again(redis_server: RedisServer) -> None:
    """Instances sharing a Redis compute the same prefixes: a store of values Redis holds
    sends none of them (counted), and stores only the others."""
    tier, host = RedisTier(RedisTierConfig(redis_server.url), NS), filled_host()
    assert store(tier, host, [0, 1]).failed_indices == []
    with redis_server.client() as admin:
        admin.set(tier.key(key(0)), b"a value this store must leave alone")
    assert store(tier, host, [0, 1, 2]) == TransferOutcome(3 * PAYLOAD, [])
    s = tier.stats.snapshot()
    assert (s.blocks_stored, s.already_present) == (3, 2), s
    with redis_server.client() as admin:
        assert admin.get(tier.key(key(0))) == b"a value this store must leave alone"
        assert admin.dbsize() == 3
    tier.close()


def test_value_is_header_then_payload_under_a_namespaced_key(redis_server: RedisServer) -> None:
    tier, host = RedisTier(RedisTierConfig(redis_server.url), NS), filled_host(1)
    store(tier, host, [0])
    digest = hashlib.sha256(redis_namespace(NS, "")).digest()
    rkey = b"kvport:" + digest.hex()[:16].encode() + b":" + key(0).hex().encode()
    assert rkey == tier.keyspace.key(key(0)) == tier.key(key(0))
    with redis_server.client() as admin:
        assert admin.keys("*") == [rkey]
        raw = admin.get(rkey)
    assert raw is not None and len(raw) == HEADER.size + PAYLOAD and raw.startswith(MAGIC)
    assert HEADER.unpack_from(raw)[2] == HEADER.size  # header size: no page padding
    assert raw[HEADER.size:] == payload(0).numpy().tobytes()


def test_namespace_covers_geometry_and_salt_without_ambiguity() -> None:
    a = redis_namespace(NS, "")
    assert a.startswith(b"15:kvport-redis-v1|")
    assert len({a, redis_namespace(NS, "t1"), redis_namespace(b"other", ""),
                redis_namespace(NS + b"|x", ""), redis_namespace(NS, "|x")}) == 5


def test_cluster_spreads_keys_one_round_trip_per_node(redis_cluster: RedisClusterServers) -> None:
    cfg = RedisTierConfig(redis_cluster.url, cluster=True)
    tier, host = RedisTier(cfg, NS), filled_host(12)
    assert store(tier, host, list(range(12))).failed_indices == []
    sizes = [n.client().dbsize() for n in redis_cluster.nodes]
    used = sum(1 for size in sizes if size)
    assert sum(sizes) == 12 and used >= 2, sizes  # no hash tags: the keys spread
    assert tier.stats.snapshot().round_trips == 2 * used  # EXISTS, then SET
    lookup = RedisLookup(cfg, NS)
    assert lookup.exists([key(i) for i in range(12)]) == [True] * 12
    assert lookup.stats().round_trips == used
    assert load(tier, host, list(range(12)), list(range(4, 16))).failed_indices == []
    for i in range(12):
        assert torch.equal(host.slot(4 + i), payload(i))
    assert tier.stats.snapshot().round_trips == 3 * used
    tier.close()


def test_namespaces_and_tenants_never_share_keys(redis_server: RedisServer) -> None:
    host = filled_host(2)
    a = RedisTier(RedisTierConfig(redis_server.url, tenant_salt="tenant-a"), NS)
    assert stored_ok(a, host, [0, 1])
    others = [RedisTierConfig(redis_server.url, tenant_salt="tenant-b"),
              RedisTierConfig(redis_server.url)]
    for cfg, ns in [(c, NS) for c in others] + [(RedisTierConfig(redis_server.url,
                                                                 tenant_salt="tenant-a"),
                                                 b"other-geometry")]:
        assert RedisLookup(cfg, ns).exists([key(0), key(1)]) == [False, False]
        other = RedisTier(cfg, ns)
        assert load(other, host, [0, 1], [4, 5]).failed_indices == [0, 1]
        assert other.stats.snapshot().vanished == 2
    assert RedisLookup(a.config, NS).exists([key(0), key(1)]) == [True, True]


# --- bad values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "longer", "other key"])
def test_corrupt_values_fail_are_counted_and_deleted(redis_server: RedisServer,
                                                     damage: str) -> None:
    tier, host = RedisTier(RedisTierConfig(redis_server.url), NS), filled_host(2)
    assert stored_ok(tier, host, [0, 1])
    rkey = tier.key(key(0))
    with redis_server.client() as admin:
        raw = bytearray(admin.get(rkey) or b"")
        if damage == "payload":
            raw[HEADER.size + 100] ^= 0xFF
        elif damage == "header":
            raw[16] ^= 0xFF  # the namespace digest
        elif damage == "truncated":
            raw = raw[:-1]
        elif damage == "longer":
            raw += b"\0"
        else:
            raw = bytearray(admin.get(tier.key(key(1))) or b"")  # a good value of another key
        admin.set(rkey, bytes(raw))
        assert load(tier, host, [0, 1], [4, 5]).failed_indices == [0]
        assert admin.exists(rkey) == 0  # deleted
    assert torch.equal(host.slot(5), payload(1))
    s = tier.stats.snapshot()
    assert (s.corrupt, s.failures, s.vanished, s.blocks_loaded) == (1, 1, 0, 1)


def test_a_value_gone_between_lookup_and_load_is_vanished(redis_server: RedisServer) -> None:
    cfg = RedisTierConfig(redis_server.url)
    tier, host = RedisTier(cfg, NS), filled_host(3)
    assert stored_ok(tier, host, [0, 1, 2])
    assert RedisLookup(cfg, NS).exists([key(0), key(1), key(2)]) == [True] * 3
    with redis_server.client() as admin:
        admin.delete(tier.key(key(1)))  # evicted by Redis, or deleted by another instance
    assert load(tier, host, [0, 1, 2], [4, 5, 6]) == TransferOutcome(2 * PAYLOAD, [1])
    s = tier.stats.snapshot()
    assert (s.vanished, s.failures, s.corrupt) == (1, 1, 0)


# --- Redis unavailable, slow, full ---------------------------------------------------------------


def test_absent_at_start_then_started_recovers_by_itself(redis_server_factory: Factory) -> None:
    server = redis_server_factory(start=False)
    cfg = RedisTierConfig(server.url, lookup_timeout_ms=100, io_timeout_s=1.0)
    tier, lookup, host = RedisTier(cfg, NS), RedisLookup(cfg, NS), filled_host(2)
    start = time.monotonic()
    assert lookup.exists([key(0), key(1)]) == [False, False]
    assert store(tier, host, [0, 1]).failed_indices == [0, 1]  # refused: counted, now down
    assert store(tier, host, [0, 1]).failed_indices == [0, 1]  # down: not attempted
    assert lookup.exists([key(0)]) == [False]
    assert time.monotonic() - start < 1.0
    s = tier.stats.snapshot()
    assert (s.errors, s.skipped_down, s.skipped_stores) == (1, 1, 4)
    assert lookup.stats().errors == 1 and lookup.stats().skipped_down == 1
    server.start()
    wait_for(lambda: stored_ok(tier, host, [0, 1]), "tier recovery", RECOVER_S)
    wait_for(lambda: lookup.exists([key(0), key(1)]) == [True, True], "lookup recovery",
             RECOVER_S)
    assert load(tier, host, [0, 1], [4, 5]).failed_indices == []


def test_killed_mid_run_then_restarted_recovers(redis_server: RedisServer) -> None:
    cfg = RedisTierConfig(redis_server.url, lookup_timeout_ms=100, io_timeout_s=1.0)
    tier, lookup, host = RedisTier(cfg, NS), RedisLookup(cfg, NS), filled_host(4)
    assert stored_ok(tier, host, [0, 1]) and lookup.exists([key(0)]) == [True]
    port = redis_server.port
    redis_server.stop()
    start = time.monotonic()
    assert store(tier, host, [2, 3]).failed_indices == [0, 1]
    assert load(tier, host, [0, 1], [4, 5]).failed_indices == [0, 1]  # down: skipped
    assert lookup.exists([key(0), key(1)]) == [False, False]
    assert time.monotonic() - start < 1.0
    s = tier.stats.snapshot()
    assert s.errors + s.timeouts == 1 and s.skipped_down == 1
    assert (s.skipped_stores, s.failures, s.vanished) == (2, 2, 0)
    redis_server.start()  # same port, empty (no persistence)
    assert redis_server.port == port
    wait_for(lambda: stored_ok(tier, host, [2, 3]), "tier recovery", RECOVER_S)
    wait_for(lambda: lookup.exists([key(2), key(0)]) == [True, False], "lookup recovery",
             RECOVER_S)


def test_slow_redis_lookup_answers_miss_within_the_timeout(redis_server: RedisServer) -> None:
    cfg = RedisTierConfig(redis_server.url, lookup_timeout_ms=100)
    tier, host = RedisTier(cfg, NS), filled_host(1)
    assert stored_ok(tier, host, [0])
    lookup = RedisLookup(cfg, NS)
    with redis_server.client() as admin:
        # Every client waits until the pause ends (CLIENT UNPAUSE would wait too, on Redis 7.0).
        admin.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
    start = time.monotonic()
    assert lookup.exists([key(0), key(1)]) == [False, False]
    elapsed = time.monotonic() - start
    assert lookup.exists([key(0)]) == [False]  # down: no wait at all
    assert time.monotonic() - start < 0.6, elapsed  # the timeout (0.1 s) and slack
    s = lookup.stats()
    assert (s.timeouts, s.skipped_down, s.keys_found) == (1, 1, 0)
    wait_for(lambda: lookup.exists([key(0)]) == [True], "lookup recovery", RECOVER_S)
    lookup.close()
    tier.close()


def test_full_redis_refuses_stores_without_raising(redis_server_factory: Factory) -> None:
    server = redis_server_factory(maxmemory="1mb", maxmemory_policy="noeviction")
    big = 256 << 10
    host = HostTier(8, big)
    tier = RedisTier(RedisTierConfig(server.url), NS)
    out = tier.store_from_host(host, HostBlocks(list(range(8))),
                               RedisBlocks([key(i) for i in range(8)]))
    s = tier.stats.snapshot()
    assert out.failed_indices and s.refused_stores == len(out.failed_indices)
    assert s.skipped_stores == len(out.failed_indices) and s.skipped_down == 0
    assert s.blocks_stored == 8 - len(out.failed_indices)
    assert out.num_bytes == s.blocks_stored * big
    # Refused writes are replies, not an outage: the tier stays up and loads still work.
    ok = [i for i in range(8) if i not in out.failed_indices]
    assert tier.load_to_host(host, RedisBlocks([key(i) for i in ok]),
                             HostBlocks(ok)).failed_indices == []


# --- auth, TLS, secrets --------------------------------------------------------------------------

PASSWORD = "s3cret-Pa55word"


def _round_trip(cfg: RedisTierConfig) -> None:
    tier, host = RedisTier(cfg, NS), filled_host(1)
    assert stored_ok(tier, host, [0]), tier.stats.snapshot()
    assert RedisLookup(cfg, NS).exists([key(0)]) == [True]
    assert load(tier, host, [0], [5]).failed_indices == []
    assert torch.equal(host.slot(5), payload(0))


def test_requirepass_via_url(redis_server_factory: Factory) -> None:
    server = redis_server_factory(password=PASSWORD)
    _round_trip(RedisTierConfig(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"))


def test_acl_user_via_url_and_via_env(redis_server_factory: Factory,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    server = redis_server_factory(acl_users=(f"alice on >{PASSWORD} ~kvport:* +@all",))
    _round_trip(RedisTierConfig(f"redis://alice:{PASSWORD}@127.0.0.1:{server.port}/0"))
    monkeypatch.setenv("KVPORT_TEST_REDIS_USER", "alice")
    monkeypatch.setenv("KVPORT_TEST_REDIS_PASSWORD", PASSWORD)
    # The env vars win over the URL's (wrong) credentials.
    _round_trip(RedisTierConfig(f"redis://bob:wrong@127.0.0.1:{server.port}/0",
                                username_env="KVPORT_TEST_REDIS_USER",
                                password_env="KVPORT_TEST_REDIS_PASSWORD"))


def test_unset_env_var_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPORT_TEST_UNSET", raising=False)
    cfg = RedisTierConfig(f"redis://127.0.0.1:{free_port()}/0", password_env="KVPORT_TEST_UNSET")
    for build in (RedisTier, RedisLookup):
        with pytest.raises(ValueError, match="password_env names the environment variable "
                                             "KVPORT_TEST_UNSET, which is not set; set "
                                             "KVPORT_TEST_UNSET to the Redis password"):
            build(cfg, NS)


def test_password_never_logged_or_raised(redis_server_factory: Factory,
                                         monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    server = redis_server_factory(password=PASSWORD)
    texts: list[str] = []
    wrong = "wr0ng-Pa55word"
    for url in (f"redis://:{wrong}@127.0.0.1:{server.port}/0",  # refused by the server
                f"redis://:{wrong}@127.0.0.1:{free_port()}/0"):  # nobody listening
        cfg = RedisTierConfig(url, lookup_timeout_ms=200)
        texts += [repr(cfg), str(cfg)]
        tier, host = RedisTier(cfg, NS), filled_host(1)
        assert store(tier, host, [0]).failed_indices == [0]
        assert RedisLookup(cfg, NS).exists([key(0)]) == [False]
        assert tier.stats.snapshot().errors == 1
    monkeypatch.setenv("KVPORT_TEST_REDIS_PASSWORD", wrong)
    env_cfg = RedisTierConfig(server.url, password_env="KVPORT_TEST_REDIS_PASSWORD")
    assert store(RedisTier(env_cfg, NS), filled_host(1), [0]).failed_indices == [0]
    monkeypatch.delenv("KVPORT_TEST_REDIS_PASSWORD")
    with pytest.raises(ValueError) as err:
        RedisTier(RedisTierConfig(f"redis://:{wrong}@127.0.0.1:{server.port}/0",
                                  password_env="KVPORT_TEST_REDIS_PASSWORD"), NS)
    texts.append(str(err.value))
    texts += [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    assert any("unavailable" in t for t in texts)  # failures were logged ...
    assert not [t for t in texts if wrong in t or PASSWORD in t]  # ... without the secret


def test_tls_with_ca_file(redis_server_factory: Factory, redis_tls_files: TlsFiles) -> None:
    server = redis_server_factory(tls=redis_tls_files)
    assert server.url.startswith("rediss://")
    _round_trip(RedisTierConfig(server.url, tls_ca_file=str(redis_tls_files.ca_cert)))
    # Without the CA the server's certificate is not trusted: failed, not raised.
    tier = RedisTier(RedisTierConfig(server.url), NS)
    assert store(tier, filled_host(1), [0]).failed_indices == [0]
    assert tier.stats.snapshot().errors == 1


def test_close_returns_at_once_even_while_redis_hangs(redis_server: RedisServer) -> None:
    cfg = RedisTierConfig(redis_server.url, io_timeout_s=0.2)
    tier, host = RedisTier(cfg, NS), filled_host(1)
    assert stored_ok(tier, host, [0])
    with redis_server.client() as admin:
        admin.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
    start = time.monotonic()
    assert load(tier, host, [0], [1]).failed_indices == [0]  # bounded by io_timeout_s
    tier.close()
    assert time.monotonic() - start < 0.8
    assert tier.stats.snapshot().timeouts == 1
    assert RedisKeyspace.build(RedisTierConfig(redis_server.url), NS).namespace_digest == \
        tier.namespace_digest


def test_a_store_larger_than_a_batch_goes_out_in_several_pipelines(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The value buffer a worker thread keeps is bounded: a store of more values than fit in
    STORE_BATCH_BYTES is sent in several pipelines, every value whole."""
    import kvport.connectors.offloading.tiers.redis.tier as redis_tier

    monkeypatch.setattr(redis_tier, "STORE_BATCH_BYTES", 2 * (HEADER.size + PAYLOAD))
    tier, host = RedisTier(RedisTierConfig(redis_server.url), NS), filled_host()
    assert store(tier, host, [0, 1, 2, 3, 4]) == TransferOutcome(5 * PAYLOAD, [])
    assert tier.stats.snapshot().round_trips == 1 + 3  # EXISTS, then SETs of 2, 2 and 1
    assert load(tier, host, [0, 1, 2, 3, 4], [8, 9, 10, 11, 12]).failed_indices == []
    assert tier.stats.snapshot().round_trips == 4 + 3  # GETs of 2, 2 and 1: bounded too
    for i in range(5):
        assert torch.equal(host.slot(8 + i), payload(i))
    tier.close()
