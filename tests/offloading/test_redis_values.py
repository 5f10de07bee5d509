"""What a Redis value must be before the tier decodes it, and what isolates tenants on one Redis
(real redis-server processes): another format version a miss left alone, a WRONGTYPE key removed,
another namespace's value a miss (M2), the keyed MAC (no key, another key, a tampered payload
or header: a miss, counted), tenant key prefixes an ACL scopes, tenant_salt_env, no secret in
an error, GETs in bounded batches (D7), and the header parser fuzzed (never an exception, never
a large allocation).
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from redis_fixtures import RedisServer
from redis_tier_utils import (
    NS, PAYLOAD, filled_host, key, load, loaded_exactly, store, tier_and_lookup, untouched,
)

from kvport.connectors.offloading.config import RedisTierConfig
from kvport.connectors.offloading.tiers.redis import tier as redis_tier_module
from kvport.connectors.offloading.tiers.redis.client import RedisKeyspace
from kvport.connectors.offloading.tiers.redis.tier import RedisTier
from kvport.connectors.offloading.tiers.value_format import (
    FORMAT_VERSION, HEADER, MAC_BYTES, MAGIC, ValueCodec, Verdict, checksum, derive_mac_key,
)

Factory = Callable[..., RedisServer]
SECRET_ENV = "KVPORT_TEST_MAC_SECRET"


def planted(server: RedisServer, tier: RedisTier, i: int, value: bytes) -> None:
    """`value` under the Redis name of tier's key(i), as anyone who can write keys could."""
    server.client().set(tier.key(key(i)), value)


def held(server: RedisServer, tier: RedisTier, i: int) -> bytes | None:
    return server.client().get(tier.key(key(i)))  # type: ignore[no-any-return]


# --- D12: another format version, WRONGTYPE ---------------------------------------------------


@pytest.mark.parametrize("change", ["version", "header_size"])
def test_another_format_version_is_a_miss_and_left_alone(redis_server: RedisServer,
                                                         change: str) -> None:
    tier, _ = tier_and_lookup(RedisTierConfig(redis_server.url))
    host = filled_host(1)
    assert store(tier, host, [0]).failed_indices == []
    value = bytearray(held(redis_server, tier, 0) or b"")
    if change == "version":
        struct.pack_into("<H", value, 8, FORMAT_VERSION + 1)
    else:  # a later release's larger header (its payload follows at its own offset)
        struct.pack_into("<H", value, 10, HEADER.size + 2 * MAC_BYTES)
    planted(redis_server, tier, 0, bytes(value))
    assert load(tier, host, [0], [8]).failed_indices == [0] and untouched(host, [8])
    s = tier.stats.snapshot()
    assert (s.other_format, s.corrupt, s.forged) == (1, 0, 0), s
    assert held(redis_server, tier, 0) == bytes(value)  # the other version's readers keep it


def test_a_wrongtype_key_is_a_miss_and_removed(redis_server: RedisServer) -> None:
    tier, lookup = tier_and_lookup(RedisTierConfig(redis_server.url))
    redis_server.client().rpush(tier.key(key(0)), b"not a value")
    assert lookup.exists([key(0)]) == [True]  # every lookup would find it ...
    host = filled_host(1)
    assert load(tier, host, [0], [8]).failed_indices == [0]  # ... and every load fail
    assert tier.stats.snapshot().wrong_type == 1
    assert lookup.exists([key(0)]) == [False]  # removed: a miss, then stored again
    assert store(tier, host, [0]).failed_indices == []
    assert loaded_exactly(tier, host, [0], [9])


# --- M2: another namespace's value under this name ----------------------------------------------


def test_another_namespaces_value_under_this_name_is_a_miss_and_removed(
    redis_server: RedisServer,
) -> None:
    """Its key digest, length and checksum are right: only the namespace digest tells it apart
    (a 64-bit prefix clash, or a value copied between names)."""
    cfg = RedisTierConfig(redis_server.url)
    mine, _ = tier_and_lookup(cfg)
    other, _ = tier_and_lookup(cfg, NS + b"|another model")
    host = filled_host(1)
    assert store(other, host, [0]).failed_indices == []
    planted(redis_server, mine, 0, held(redis_server, other, 0) or b"")
    assert load(mine, host, [0], [8]).failed_indices == [0] and untouched(host, [8])
    assert mine.stats.snapshot().corrupt == 1
    assert held(redis_server, mine, 0) is None and held(redis_server, other, 0) is not None


# --- D10: the keyed MAC ------------------------------------------------------------------------


def mac_tier(server: RedisServer, monkeypatch: pytest.MonkeyPatch, secret: str | None,
             ) -> RedisTier:
    if secret is None:
        return RedisTier(RedisTierConfig(server.url), NS)
    env = f"{SECRET_ENV}_{abs(hash(secret))}"
    monkeypatch.setenv(env, secret)
    return RedisTier(RedisTierConfig(server.url, mac_key_env=env), NS)


def flip_payload(value: bytes, header_size: int) -> bytes:
    """One payload byte changed, and the xxh3 fixed to match: only the MAC can tell."""
    out = bytearray(value)
    out[header_size + 7] ^= 0x5A
    struct.pack_into("<Q", out, 72, checksum(bytes(out[header_size:])))
    return bytes(out)


def flip_header(value: bytes, header_size: int) -> bytes:
    out = bytearray(value)
    out[12] ^= 0x01  # the reserved field: covered by the MAC, read by nobody
    return bytes(out)


@pytest.mark.parametrize("forger", ["no key", "another key", "tampered payload",
                                    "tampered header"])
def test_a_value_without_a_valid_mac_is_a_miss_counted_and_removed(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, forger: str,
) -> None:
    victim = mac_tier(redis_server, monkeypatch, "tenant-a secret")
    host = filled_host(2)
    assert store(victim, host, [0]).failed_indices == []
    assert loaded_exactly(victim, host, [0], [8])  # the key's own values pass
    size = victim._codec.header_size
    assert size == HEADER.size + MAC_BYTES
    if forger in ("no key", "another key"):
        # Everything public is right (the victim's namespace digest, read off any of its
        # values; the key's digest; the checksum): only the MAC key is not known.
        forge = ValueCodec(victim.namespace_digest,
                           None if forger == "no key" else derive_mac_key("another secret"))
        evil = bytes(host.slot(1).flip(0).numpy())  # attacker-chosen KV for key(1)
        value = forge.pack_header(key(1), evil) + evil
    else:
        assert store(victim, host, [1]).failed_indices == []
        good = held(redis_server, victim, 1) or b""
        value = (flip_payload if forger == "tampered payload" else flip_header)(good, size)
    planted(redis_server, victim, 1, value)
    assert load(victim, host, [1], [9]).failed_indices == [0] and untouched(host, [9])
    s = victim.stats.snapshot()
    assert (s.forged, s.blocks_loaded) == (1, 1), s
    assert held(redis_server, victim, 1) is None


# --- D10: tenants, the salt from the environment; D11: secrets --------------------------------


def test_a_tenants_keys_carry_its_prefix_and_an_acl_scopes_them(
    redis_server_factory: Factory,
) -> None:
    rule = "acme on >acmepw ~kvport:acme:* resetchannels -@all +get +set +exists +del +ping"
    server = redis_server_factory(acl_users=(rule,))
    url = f"redis://acme:acmepw@127.0.0.1:{server.port}/0"
    tier, lookup = tier_and_lookup(RedisTierConfig(url, tenant="acme", io_timeout_s=1.0))
    assert tier.key(key(0)).startswith(b"kvport:acme:")
    host = filled_host(2)
    assert store(tier, host, [0, 1]).failed_indices == []
    assert lookup.exists([key(0), key(1)]) == [True, True]
    assert loaded_exactly(tier, host, [0, 1], [8, 9])
    # The same ACL user configured as another tenant: Redis refuses every key (a miss, counted).
    other, other_lookup = tier_and_lookup(RedisTierConfig(url, tenant="globex"))
    assert other.key(key(0)).startswith(b"kvport:globex:")
    assert store(other, host, [0]).failed_indices == [0]
    assert other_lookup.exists([key(0)]) == [False]
    assert other.stats.snapshot().refused_stores == 1


def test_tenant_salt_env_names_the_salt_and_no_message_shows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPORT_TEST_SALT", "acme-salt-7f3a")
    by_env = RedisTierConfig("redis://127.0.0.1:1/0", tenant_salt_env="KVPORT_TEST_SALT")
    inline = RedisTierConfig("redis://127.0.0.1:1/0", tenant_salt="acme-salt-7f3a")
    unsalted = RedisTierConfig("redis://127.0.0.1:1/0")
    prefix = RedisKeyspace.build(by_env, NS).prefix
    assert prefix == RedisKeyspace.build(inline, NS).prefix
    assert prefix != RedisKeyspace.build(unsalted, NS).prefix
    assert "acme-salt" not in repr(by_env) + repr(inline)
    monkeypatch.delenv("KVPORT_TEST_SALT")
    with pytest.raises(ValueError, match="KVPORT_TEST_SALT") as err:
        RedisKeyspace.build(by_env, NS)
    assert "acme-salt" not in str(err.value)


@pytest.mark.parametrize("entry", [
    {"url": "http://u:s3cretPW@h/0"},
    {"url": "redis://u:s3cretPW@h/0", "startup_nodes": ["no port"], "cluster": True},
    {"url": "redis://u:s3cretPW@h/0", "startup_nodes": ["h:1"]},
    {"url": "redis://u:s3cretPW@h/0", "tls_ca_file": "/ca.pem"},
    {"url": "redis://u:s3cretPW@h/0", "password_env": ""},
    {"url": "redis://u:s3cretPW@h/0", "tenant": "a bad name!"},
    {"url": "redis://u:s3cretPW@h/0", "io_timeout_s": "2"},
    {"url": "redis://u:s3cretPW@h/0", "cluster": "yes"},
])
def test_no_redis_tier_config_error_shows_a_password(entry: dict[str, object]) -> None:
    with pytest.raises(ValueError) as err:
        RedisTierConfig(**entry)  # type: ignore[arg-type]
    assert "s3cretPW" not in str(err.value), err.value


# --- D7: promotions in bounded batches -----------------------------------------------------------


def test_a_load_larger_than_a_batch_goes_out_in_several_pipelines(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier, _ = tier_and_lookup(RedisTierConfig(redis_server.url))
    host = filled_host(10)
    assert store(tier, host, list(range(10))).failed_indices == []
    before = tier.stats.snapshot().round_trips
    monkeypatch.setattr(redis_tier_module, "STORE_BATCH_BYTES", 3 * (PAYLOAD + HEADER.size))
    assert loaded_exactly(tier, host, list(range(10)), list(range(10, 20)))
    assert tier.stats.snapshot().round_trips - before == 4  # 3 + 3 + 3 + 1 values


# --- the header parser, fuzzed -----------------------------------------------------------------

DIGEST = bytes(range(32))
CODECS = {"plain": ValueCodec(DIGEST), "keyed": ValueCodec(DIGEST, derive_mac_key("fuzz"))}
BIG = 1 << 20  # no check may allocate anything near this (a payload length field is 64 bits)


def checked_small(codec: ValueCodec, value: bytes, n: int) -> Verdict:
    tracemalloc.start()
    try:
        verdict = codec.check(b"k", value, n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < BIG, peak
    return verdict


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(CODECS)), st.binary(max_size=300), st.integers(0, 1 << 62))
def test_any_bytes_are_a_verdict_never_an_exception(name: str, value: bytes, n: int) -> None:
    assert checked_small(CODECS[name], value, n) is not Verdict.OK or n == len(value) - \
        CODECS[name].header_size


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(CODECS)), st.integers(0, 2**16 - 1), st.integers(0, 2**16 - 1),
       st.integers(0, 2**64 - 1), st.booleans(), st.integers(0, 200), st.binary(max_size=64))
def test_a_header_with_any_fields_is_a_miss_unless_it_is_exact(
    name: str, version: int, hsize: int, length: int, right_ns: bool, cut: int, tail: bytes,
) -> None:
    codec = CODECS[name]
    payload = bytes(64)
    good = codec.pack_header(b"k", payload) + payload
    fields = HEADER.pack(MAGIC, version, hsize, 0, DIGEST if right_ns else bytes(32),
                         good[48:64], length, checksum(payload))
    value = (fields + good[HEADER.size:])[:len(good) - cut] + tail
    verdict = checked_small(codec, value, 64)
    if value != good:
        assert verdict is not Verdict.OK, (version, hsize, length, right_ns, cut, tail)
    else:
        assert verdict is Verdict.OK


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.none(), st.binary(max_size=300), st.integers(), st.text(max_size=20)))
def test_the_tier_turns_any_reply_into_a_miss_never_an_exception(reply: object) -> None:
    tier = RedisTier(RedisTierConfig("redis://127.0.0.1:1/0"), NS)
    out = torch.zeros(64, dtype=torch.uint8)
    assert tier._fill(key(0), reply, out) is not None
    assert not out.any()
