"""kvport's tiers on vLLM's KV event stream (run_events.py: vLLM's ZMQ publisher on loopback, read
back with its replay protocol): replayed in order, the events say exactly what the host tier,
the disk and Redis hold after a workload, evictions and a reset; every stored block carries the
hash, tokens and parent that vLLM's own GPU-prefix events gave the same block."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from engine_pool import EnginePool
from redis_fixtures import RedisServer

BLOCK = 128  # vLLM's CPU block
SLOT_BYTES = 30 * 2 * 3 * 64 * 4 * BLOCK  # SmolLM2-135M, float32: layers, K/V, heads, head dim


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory, engine_pool: EnginePool) -> dict[str, Any]:
    redis = RedisServer(tmp_path_factory.mktemp("events-redis")).start()
    cfg = {"disk_dir": str(tmp_path_factory.mktemp("events-disk")), "redis_url": redis.url,
           "cpu_bytes": 6 * SLOT_BYTES}  # 6 host slots: the second round evicts
    try:
        done, _ = engine_pool.run("events", cfg)
    finally:
        redis.stop()
    assert "error" not in done, done.get("traceback", done)
    return done


def replay(events: list[dict[str, Any]]) -> dict[str, set[int]]:
    """Each tier's blocks after the events, in order (a router's index); checks each event on
    the way (no store of a held block, no removal of one not held)."""
    held: dict[str, set[int]] = {}
    for e in events:
        if e["type"] == "AllBlocksCleared":
            held["GPU"] = set()
            continue
        tier = held.setdefault(e["ownership"] or e["medium"], set())
        hashes = set(e["block_hashes"])
        if e["type"] == "BlockRemoved":
            if e["medium"] != "GPU":
                assert hashes <= tier, f"{e['medium']}: removes blocks it does not hold: {e}"
            tier -= hashes
        else:
            if e["medium"] != "GPU":
                assert not hashes & tier, f"stores blocks it holds: {e}"
            tier |= hashes
    return held


def test_the_events_say_exactly_what_every_tier_holds(result: dict[str, Any]) -> None:
    held = replay(result["events"])
    contents = result["contents"]
    assert contents["CPU"] and contents["disk"] and contents["redis"], contents
    assert held.get("CPU", set()) == set(contents["CPU"])
    assert held.get("disk", set()) == set(contents["disk"])
    assert held.get("redis", set()) == set(contents["redis"])
    kinds = Counter((e.get("medium"), e["type"]) for e in result["events"])
    assert kinds[("CPU", "BlockRemoved")] >= 2, kinds  # evictions and the reset
    # A live subscriber got them too, the same batches.
    assert result["num_live"] > 0 and not result["live_mismatched"], result["live_mismatched"]


def test_stored_blocks_carry_what_vllm_s_own_events_give_them(result: dict[str, Any]) -> None:
    tokens: dict[int, list[int]] = {}
    parent: dict[int, int | None] = {}
    for e in result["events"]:
        if e["type"] == "BlockStored" and e["medium"] == "GPU":
            p = e["parent_block_hash"]
            for i, h in enumerate(e["block_hashes"]):
                tokens[h] = e["token_ids"][i * BLOCK:(i + 1) * BLOCK]
                parent[h] = p if i == 0 else e["block_hashes"][i - 1]
    ours = [e for e in result["events"] if e["type"] == "BlockStored" and e["medium"] != "GPU"]
    assert ours
    for e in ours:
        assert e["block_size"] == BLOCK and e["group_idx"] == 0, e
        assert isinstance(e["block_hashes"][0], int)  # vLLM's default: the low 64 bits
        assert e["kv_cache_spec_kind"] is not None
        want = [t for h in e["block_hashes"] for t in tokens[h]]
        assert e["token_ids"] == want
        assert e["parent_block_hash"] == parent[e["block_hashes"][0]]
        assert (e["medium"], e["locality"], e["ownership"]) in {
            ("CPU", None, None), ("STORAGE", "LOCAL", "disk"), ("STORAGE", "REMOTE", "redis")}
    removed = [e for e in result["events"] if e["type"] == "BlockRemoved" and e["medium"] != "GPU"]
    assert all(set(e["block_hashes"]) <= set(tokens) for e in removed)
