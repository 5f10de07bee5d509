"""Redis's own removals announced as Redis makes them (`keyspace_events`), against a real
redis-server publishing keyevent notifications: a value someone else deletes, one that expires
and values Redis evicts under `maxmemory` are announced removed at the engine's next step, with
no lookup or load finding them gone, so the events replayed say exactly what Redis holds. A
server that publishes none gets a warning that says what to set, and the lookups still
announce what they find gone."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_kv_events_tiers import Blocks, replay, run_and_note

from kvport.connectors.offloading.mediums import REDIS
from kvport.connectors.offloading.tiers.redis.notifications import missing_flags
from offload_utils import (
    assert_nothing_leaked, make_llm, offload_block_bytes, offload_config, offloading_half, prompts,
)
from redis_fixtures import RedisServer, wait_for


@pytest.fixture
def notifying_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", maxmemory_policy="allkeys-lru",
                         extra_args=("--notify-keyspace-events", "Exeg")).start()
    yield server
    server.stop()


def test_removals_redis_makes_are_announced_without_a_lookup(
        notifying_redis: RedisServer) -> None:
    llm = make_llm(offload_config(cpu_bytes=8 * offload_block_bytes(),
                                  redis={"url": notifying_redis.url, "keyspace_events": True}))
    blocks, events = Blocks(llm), []
    run_and_note(llm, blocks, events, prompts(), one_by_one=True)
    redis = offloading_half(llm).lower.redis
    assert redis is not None and redis.listener is not None
    wait_for(redis.listener.connected.is_set, "the keyevent subscription")
    client = notifying_redis.client()

    def in_redis() -> dict[bytes, bool]:
        """Asked with a client of the test's own: a lookup would report what it finds gone."""
        keys = list(blocks.of_key)
        pipe = client.pipeline()
        for k in keys:
            pipe.exists(redis.keyspace.key(k))
        return {k: bool(n) for k, n in zip(keys, pipe.execute())}

    stored = [k for k, there in in_redis().items() if there]
    assert len(stored) >= 6
    lookups = redis.stats().lookups

    def removed() -> set[bytes]:
        llm.engine.step()  # an idle step: the events the connector holds are taken
        events.extend(llm.take_kv_events())
        return {h for e in events if e.medium == REDIS and e.removed for h in e.block_hashes}

    # The same blocks under another namespace (another model or tenant on this Redis) come and
    # go: not this tier's. Then someone deletes one of ours: announced, and nothing else (the
    # notifications come in order on one channel, so the others were seen before it).
    other = b"kvport:" + b"0" * 16 + b":"
    assert other != redis.keyspace.prefix
    for k in stored[1:4]:
        client.set(other + k.hex().encode(), b"x")
        client.delete(other + k.hex().encode())
    assert client.delete(redis.keyspace.key(stored[0])) == 1
    first = set(blocks.of_key[stored[0]])
    wait_for(lambda: first <= removed(), "the removal of a value another client deleted")
    assert removed() == first
    # a TTL ends one; Redis evicts some under maxmemory, making room for another application
    assert client.pexpire(redis.keyspace.key(stored[1]), 1)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", max(1, used - 2 * offload_block_bytes()))
    client.set(b"another-application", b"x" * (3 * offload_block_bytes()))
    client.config_set("maxmemory", 0)

    def announced() -> bool:
        removed()
        held = replay(events, blocks)
        return held[REDIS] == blocks.held(in_redis())

    wait_for(announced, "removal events for what Redis expired and evicted")
    gone = [k for k, there in in_redis().items() if not there and k in stored]
    assert len(gone) >= 3, gone  # deleted, expired, and at least one evicted
    assert all(set(blocks.of_key[k]) <= removed() for k in gone)
    assert redis.stats().lookups == lookups  # no lookup learnt it
    assert redis.listener.num_removals >= len(gone)
    assert_nothing_leaked(llm)
    llm.shutdown()
    assert not redis.listener._thread.is_alive()


def test_a_server_without_notifications_is_named_in_a_warning(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    llm = make_llm(offload_config(redis={"url": redis_server.url, "keyspace_events": True}))
    redis = offloading_half(llm).lower.redis
    assert redis is not None and redis.listener is not None
    wait_for(redis.listener.connected.is_set, "the keyevent subscription")
    assert "publishes no keyevent channels, evicted, expired, del notifications" in caplog.text
    assert "add Eexg" in caplog.text
    llm.shutdown()


def test_the_listener_starts_only_when_asked_for_and_someone_reads_events(
        notifying_redis: RedisServer) -> None:
    from kvport.connectors.offloading.config import RedisTierConfig
    from kvport.connectors.offloading.tiers.redis.lookup import RedisLookup

    llm = make_llm(offload_config(redis={"url": notifying_redis.url}))  # not asked for
    assert offloading_half(llm).lower.redis.listener is None  # type: ignore[union-attr]
    llm.shutdown()
    asked = RedisTierConfig(notifying_redis.url, keyspace_events=True)
    unread = RedisLookup(asked, b"ns", listen=False)  # an engine that reads no events
    assert unread.listener is None
    unread.close()
    read = RedisLookup(asked, b"ns", listen=True)
    assert read.listener is not None
    read.close()


def test_the_flags_a_server_needs() -> None:
    assert missing_flags("") == ["E", "e", "x", "g"]
    assert missing_flags("KEA") == []
    assert missing_flags("Ex") == ["e", "g"]
    assert missing_flags("gxeE") == []
