"""KV cache events from every tier (host, disk, Redis), in the engine's terms: replayed in order,
they say exactly which engine blocks each tier holds, after a workload with evictions, a
reset and entries a tier lost by itself; each stored event carries its blocks' tokens and the
hash before them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvport.connectors.base import KVCacheEvent
from kvport.connectors.offloading.geometry import offload_keys
from kvport.connectors.offloading.mediums import DISK, HOST, REDIS
from kvport.engine.hashing import hash_blocks
from kvport.engine.llm import LLM
from offload_utils import (
    BLOCK_SIZE, OFFLOAD_BLOCK, assert_nothing_leaked, make_llm, offload_block_bytes,
    offload_config, offloading_half, prompts, run, run_one_by_one,
)
from redis_fixtures import RedisServer

F = OFFLOAD_BLOCK // BLOCK_SIZE


class Blocks:
    """What the test knows of every sequence it ran: engine block hashes, their tokens, and the
    offload keys over them."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.tokens: dict[bytes, tuple[int, ...]] = {}  # engine hash -> its tokens
        self.parent: dict[bytes, bytes | None] = {}
        self.of_key: dict[bytes, tuple[bytes, ...]] = {}  # offload key -> its engine hashes

    def add(self, sequence: list[int]) -> None:
        hashes: list[bytes] = []
        hash_blocks(self.llm.engine.hash_root, sequence, BLOCK_SIZE, hashes)
        for i, h in enumerate(hashes):
            self.tokens[h] = tuple(sequence[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            self.parent[h] = hashes[i - 1] if i else None
        for j, key in enumerate(offload_keys(hashes, F)):
            self.of_key[key] = tuple(hashes[j * F:(j + 1) * F])

    def held(self, has: dict[bytes, bool]) -> set[bytes]:
        """The engine hashes of the keys a tier holds (`has`: key -> held)."""
        return {h for key, there in has.items() if there for h in self.of_key[key]}


def replay(events: list[KVCacheEvent], blocks: Blocks) -> dict[str, set[bytes]]:
    """Each tier's engine blocks after `events`, checking each event on the way: a store adds
    blocks the tier did not hold, with their tokens and parent; a removal drops held ones."""
    held: dict[str, set[bytes]] = {HOST: set(), DISK: set(), REDIS: set()}
    for e in events:
        assert e.block_size == BLOCK_SIZE and e.group_idx == 0, e
        assert len(e.block_hashes) % F == 0, e  # whole offload blocks
        tier = held[e.medium]
        if e.removed:
            assert set(e.block_hashes) <= tier, f"{e.medium}: removes blocks it never stored"
            tier.difference_update(e.block_hashes)
            continue
        assert not set(e.block_hashes) & tier, f"{e.medium}: stores a block it holds"
        assert e.token_ids == tuple(t for h in e.block_hashes for t in blocks.tokens[h]), e
        assert e.parent_block_hash == blocks.parent[e.block_hashes[0]], e
        for prev, h in zip(e.block_hashes, e.block_hashes[1:]):
            assert blocks.parent[h] == prev, "one event is one run of consecutive blocks"
        assert e.lora_name is None and e.extra_keys is None
        tier.update(e.block_hashes)
    return held


def run_and_note(llm: LLM, blocks: Blocks, events: list[KVCacheEvent],
                 ps: list[list[int]], one_by_one: bool = False) -> None:
    outputs, _ = run_one_by_one(llm, ps) if one_by_one else run(llm, ps)
    for p, out in zip(ps, outputs):
        blocks.add(p + out)
    events += llm.take_kv_events()


def host_keys(llm: LLM, blocks: Blocks) -> dict[bytes, bool]:
    manager = offloading_half(llm).manager
    return {key: manager.lookup([key]) == 1 for key in blocks.of_key}


def test_host_and_disk_events_match_the_tiers_after_evictions_and_a_reset(
        tmp_path: Path) -> None:
    # 8 host slots and disk room for ~14 offload blocks, 42+ blocks stored: both evict.
    llm = make_llm(offload_config(cpu_bytes=8 * offload_block_bytes(), disk_dir=tmp_path,
                                  disk_bytes=14 * offload_block_bytes()))
    blocks, events = Blocks(llm), []
    run_and_note(llm, blocks, events, prompts(), one_by_one=True)
    llm.reset_prefix_cache(reset_connector=True)  # drops the host tier, not the disk
    events += llm.take_kv_events()
    run_and_note(llm, blocks, events, prompts(seed=1), one_by_one=True)
    run_and_note(llm, blocks, events, prompts()[:2])  # hits: promotions from disk
    lookup = offloading_half(llm).lower.disk
    assert lookup is not None
    held = replay(events, blocks)
    assert held[HOST] == blocks.held(host_keys(llm, blocks))
    assert held[DISK] == blocks.held({k: lookup.exists(k) for k in blocks.of_key})
    assert held[HOST] and held[DISK] and not held[REDIS]
    kinds = Counter((e.medium, e.removed) for e in events)
    assert kinds[(HOST, True)] and kinds[(DISK, True)], kinds  # evictions were announced
    assert_nothing_leaked(llm)
    assert len(offloading_half(llm).events) == len(
        {k for k in blocks.of_key if host_keys(llm, blocks)[k] or lookup.exists(k)})
    llm.shutdown()


def test_redis_events_match_redis_and_a_value_redis_lost_is_announced_once_found_gone(
        redis_server: RedisServer) -> None:
    llm = make_llm(offload_config(cpu_bytes=8 * offload_block_bytes(),
                                  redis={"url": redis_server.url}))
    blocks, events = Blocks(llm), []
    run_and_note(llm, blocks, events, prompts(), one_by_one=True)
    redis = offloading_half(llm).lower.redis
    assert redis is not None
    keys = list(blocks.of_key)
    in_redis = dict(zip(keys, redis.exists(keys)))
    held = replay(events, blocks)
    assert held[REDIS] == blocks.held(in_redis) and held[REDIS]
    # Redis drops a value on its own (maxmemory, a TTL, an operator): nothing tells kvport
    # until a load finds it gone.
    first = offload_keys(_hashes(llm, prompts()[0]), F)[0]
    assert in_redis[first]
    client = redis_server.client()
    assert client.delete(redis.keyspace.key(first)) == 1
    llm.reset_prefix_cache(reset_connector=True)
    events += llm.take_kv_events()
    before = len(events)
    run_and_note(llm, blocks, events, prompts()[:1])  # its load fails; it recomputes, stores
    later = [(e.removed, e.block_hashes) for e in events[before:] if e.medium == REDIS]
    gone = blocks.of_key[first]
    assert later[0] == (True, gone), later  # announced gone, then stored again
    assert any(not removed and hashes[:F] == gone for removed, hashes in later[1:]), later
    held = replay(events, blocks)
    in_redis = dict(zip(keys, redis.exists(keys)))
    assert held[REDIS] == blocks.held(in_redis)
    assert held[HOST] == blocks.held(host_keys(llm, blocks))
    assert_nothing_leaked(llm)
    llm.shutdown()


def test_no_reader_no_descriptions() -> None:
    """An engine that reads no events (EngineInfo.kv_events False) keeps nothing for them."""
    llm = make_llm(offload_config())
    half = offloading_half(llm)
    half.events.enabled = False
    run(llm, prompts()[:2])
    assert llm.take_kv_events() == [] and len(half.events) == 0
    assert_nothing_leaked(llm)


def _hashes(llm: LLM, tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    hash_blocks(llm.engine.hash_root, tokens, BLOCK_SIZE, out)
    return out


def test_only_redis_saying_no_is_a_removal(redis_server: RedisServer) -> None:
    """A lookup's 0 says a value is gone; an error or a Redis that does not answer says nothing
    (its misses are not removals)."""
    from kvport.connectors.offloading.config import RedisTierConfig
    from kvport.connectors.offloading.tiers.redis.lookup import RedisLookup

    keys = [bytes([i]) * 32 for i in range(3)]
    lookup = RedisLookup(RedisTierConfig(redis_server.url), b"ns")
    client = redis_server.client()
    client.set(lookup.keyspace.key(keys[0]), b"x")
    client.hset(lookup.keyspace.key(keys[1]), "a", "b")  # another kind of value: still there
    assert lookup.exists(keys) == [True, True, False]
    assert lookup.absent.take() == [keys[2]]
    redis_server.stop()
    assert lookup.exists(keys) == [False, False, False]
    assert lookup.absent.take() == []
    lookup.close()


def test_one_stored_event_per_run_of_consecutive_blocks() -> None:
    from kvport.connectors.offloading.scheduler.block_events import BlockEvents
    from view_records import ViewRequest

    request = ViewRequest("r", list(range(32)), BLOCK_SIZE)  # 8 engine blocks, 4 offload blocks
    events = BlockEvents(True, BLOCK_SIZE, F)
    keys = [b"k%d" % i for i in range(4)]
    for i in (0, 1, 3):  # block 2 is not stored: 0-1 and 3 are two runs
        events.describe(request, keys[i], 0, i)
    events.stored(HOST, [keys[0], keys[1], keys[3]])
    stored = events.take()
    hashes = request.block_hashes
    assert [e.block_hashes for e in stored] == [tuple(hashes[0:4]), tuple(hashes[6:8])]
    assert [e.parent_block_hash for e in stored] == [None, hashes[5]]
    assert stored[1].token_ids == tuple(range(24, 32))
    events.settled(keys)
    assert len(events) == 3  # held by host: kept for their removal
    events.removed(HOST, keys)
    assert [e.block_hashes for e in events.take()] == [tuple(hashes[0:4] + hashes[6:8])]
    assert len(events) == 0

    off = BlockEvents(False, BLOCK_SIZE, F)
    off.describe(request, keys[0], 0, 0)
    off.stored(HOST, keys[:1])
    assert len(off) == 0 and off.take() == []


def test_a_hybrid_models_events_name_each_group() -> None:
    """tiny-gemma3 (a full-attention group and sliding-window groups): every event names its
    group, one engine block per key, and replayed per group they say what the host tier holds of
    that group's keys."""
    from hybrid_scenarios import GREEDY, offloading_llm, pair_prompts
    from kvport.connectors.offloading.geometry import group_key

    llm = offloading_llm("builtin:tiny-gemma3")()
    half = offloading_half(llm)
    groups = half.geometry.num_groups
    assert groups > 1
    outs, _ = run(llm, pair_prompts(), GREEDY)
    events = llm.take_kv_events()
    held: dict[int, set[bytes]] = {g: set() for g in range(groups)}
    for e in events:
        assert e.medium == HOST and 0 <= e.group_idx < groups, e
        if e.removed:
            held[e.group_idx].difference_update(e.block_hashes)
        else:
            assert len(e.token_ids) == 16 * len(e.block_hashes), e
            held[e.group_idx].update(e.block_hashes)
    hashes: set[bytes] = set()
    for p, out in zip(pair_prompts(), outs):
        seq: list[bytes] = []
        hash_blocks(llm.engine.hash_root, p + out, 16, seq)
        hashes.update(seq)
    for g in range(groups):
        want = {h for h in hashes if half.manager.lookup([group_key(h, g)]) == 1}
        assert held[g] == want and want, g
    assert_nothing_leaked(llm)
