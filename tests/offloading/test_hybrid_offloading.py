"""The OffloadingConnector on a hybrid model (tiny-gemma3: two sliding-window groups, window 48,
and one full-attention group; blocks of 16 tokens, so a hit needs the 3 blocks before it in a
sliding group): every group offloaded under its own keys, sliding groups only where a hit can use
them; hits after a reset, across a shared prefix, from disk in a new engine, with chunked
prefill, preemption and failed loads; greedy output equal to no connector; nothing leaked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import faulty_connector
from kvport import LLM, SamplingParams
from kvport.connectors.offloading.mediums import ENGINE, HOST
from kvport.trace.checker import check_file
from offload_utils import (
    MODES, assert_nothing_leaked, keys_per_group, run, run_one_by_one,
)

BLOCK = 16
WINDOW_BLOCKS = 3  # ceil((48 - 1) / 16)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("no_faults")


def gemma(extra: dict[str, Any] | None = None, connector: str = "OffloadingConnector",
          **kwargs: Any) -> LLM:
    cfg = {"cpu_bytes_to_use": 32 << 20, **(extra or {})}
    ktc: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both",
                           "kv_connector_extra_config": cfg}
    if connector != "OffloadingConnector":
        ktc["kv_connector_module_path"] = "faulty_connector"
    kwargs.setdefault("num_kv_blocks", 160)
    return LLM("builtin:tiny-gemma3", block_size=BLOCK, kv_transfer_config=ktc, **kwargs)


def hybrid_prompts(seed: int = 0) -> list[list[int]]:
    """Four prompts: two pairs, each pair sharing its first 150 tokens (lengths 230, 201)."""
    out = []
    for i in range(4):
        shared = [(t * 37 + 11 * (i // 2) + seed * 101) % 250 + 3 for t in range(150)]
        out.append(shared + [(t * 13 + i + seed) % 250 + 3 for t in range(80 - 29 * (i % 2))])
    return out


@pytest.fixture(scope="module")
def hybrid_reference() -> list[list[int]]:
    """Greedy tokens of hybrid_prompts() without a connector or a prefix cache."""
    llm = LLM("builtin:tiny-gemma3", block_size=BLOCK, num_kv_blocks=160,
              enable_prefix_caching=False)
    return run(llm, hybrid_prompts(), GREEDY)[0]


def _full_hit(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def finish(llm: LLM) -> None:
    assert_nothing_leaked(llm)
    llm.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_every_group_comes_back_after_a_reset(hybrid_reference: list[list[int]],
                                              mode: str) -> None:
    llm = gemma(**MODES[mode])
    assert llm.engine.kv_cache_manager.group_windows == (48, 48, None)  # HMA kept on
    prompts = hybrid_prompts()
    assert run(llm, prompts, GREEDY)[0] == hybrid_reference
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == hybrid_reference
    assert cached == [_full_hit(p) for p in prompts]
    # The full group keeps every block: 14 and 13 of a pair's prompts (237 and 208 tokens
    # computed), 9 of them shared. A sliding group keeps the window (3 blocks) before each
    # boundary a hit may use: the prompt's last (14, 12), the decoded ones after it, and every
    # 12 blocks (the default interval, 4 windows): blocks 9-13 and 9-12 of a pair.
    sliding_a, sliding_b, full = keys_per_group(llm, 3)
    # (Under async scheduling a finished request's last block may not be stored: a known loss,
    # single group too.)
    lost = 4 if mode == "async" else 0
    assert 2 * (14 + 13 - 9) - lost <= full <= 2 * (14 + 13 - 9)
    assert 2 * (5 + 4) - lost <= sliding_a == sliding_b <= 2 * (5 + 4)
    finish(llm)


@pytest.mark.parametrize("interval, hit_blocks", [(0, 9), (64, 8), (None, 0)])
def test_a_shared_prefix_hits_where_the_windows_were_stored(
        hybrid_reference: list[list[int]], interval: int | None, hit_blocks: int) -> None:
    # The pair shares 150 tokens (9 whole blocks). The second prompt's hit ends where every
    # sliding group holds the window: every block (interval 0), the last multiple of 4 blocks
    # (interval 64), or nowhere inside the shared prefix (the default, 12 blocks). Either way
    # the second prompt met the first at block 9 (the junction) and stores the windows there:
    # a third prompt with the prefix hits all 9 blocks.
    extra = {} if interval is None else {"sliding_store_interval": interval}
    llm = gemma(extra)
    prompts = hybrid_prompts()
    third = prompts[0][:150] + [(t * 7 + 5) % 250 + 3 for t in range(40)]
    first, _ = run_one_by_one(llm, prompts[:1], GREEDY)
    llm.reset_prefix_cache()
    second, cached = run_one_by_one(llm, prompts[1:2], GREEDY)
    assert first + second == hybrid_reference[:2]
    assert cached == [hit_blocks * BLOCK]
    llm.reset_prefix_cache()
    expected, _ = run_one_by_one(gemma(enable_prefix_caching=False), [third], GREEDY)
    tokens, cached = run_one_by_one(llm, [third], GREEDY)
    assert tokens == expected and cached == [9 * BLOCK]
    finish(llm)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_and_preemption(hybrid_reference: list[list[int]], mode: str) -> None:
    # Chunks of 32 tokens: a sliding group's blocks leave the window while the prompt is still
    # prefilling (stores reading them are flushed first); 48 blocks of 16 tokens for four
    # requests of 13-16 blocks each in three groups: requests are preempted.
    llm = gemma(num_kv_blocks=48, max_num_batched_tokens=32, **MODES[mode])
    prompts = hybrid_prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hybrid_reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == hybrid_reference and all(c > 0 for c in cached)
    finish(llm)


def test_disk_hits_in_a_new_engine(tmp_path: Path, hybrid_reference: list[list[int]]) -> None:
    tiers = {"secondary_tiers": [{"type": "disk", "root_dir": str(tmp_path),
                                  "max_bytes": 256 << 20}]}
    prompts = hybrid_prompts()
    llm = gemma(tiers)
    assert run(llm, prompts, GREEDY)[0] == hybrid_reference
    finish(llm)
    fresh = gemma(tiers)  # an empty host tier: every hit comes from disk
    tokens, cached = run_one_by_one(fresh, prompts, GREEDY)
    assert tokens == hybrid_reference
    assert cached == [_full_hit(p) for p in prompts]
    # The second prompt of a pair takes its shared 9 blocks from the host tier: the first
    # promoted them.
    disk = fresh.get_metrics()["connector"]["disk"]
    assert disk["hit_tokens"] == sum(cached) - 2 * 9 * BLOCK
    finish(fresh)


@pytest.mark.parametrize("sync", [True, False])
def test_failed_loads_recompute_every_group(tmp_path: Path, hybrid_reference: list[list[int]],
                                            sync: bool) -> None:
    # Loads 1 and 3 fail: the engine recomputes from the last block where every group holds
    # what it needs (a sliding group's windows before the hit were never loaded: the start),
    # in chunks of 64 tokens that read the earlier chunks' KV from real blocks.
    faulty_connector.FAULTS[(HOST, ENGINE)] = {"fail_on": {1, 3}}
    llm = gemma({"sync_host_loads": sync, "record_trace": str(tmp_path / "trace.jsonl")},
                connector="FaultyOffloadingConnector", max_num_batched_tokens=64)
    prompts = hybrid_prompts()
    assert run(llm, prompts, GREEDY)[0] == hybrid_reference
    llm.reset_prefix_cache()
    tokens, _ = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == hybrid_reference
    m = llm.get_metrics()
    assert m["kv_transfer"]["num_invalid_blocks"] > 0
    assert m["connector"]["requests"]["num_failed_loads"] == 2
    finish(llm)
    assert check_file(str(tmp_path / "trace.jsonl")) == []
