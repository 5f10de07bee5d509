"""The OffloadingConnector on a state-space hybrid (tiny-granite4: a group of Mamba2 layers, whose
blocks hold each layer's state at a block boundary, and a full-attention group; blocks of 16
tokens): a hit at boundary k loads the attention group's blocks and the one state block k - 1;
state blocks are stored only where a hit can use them; hits after a reset, across a shared prefix,
from disk in a new engine, with chunked prefill, preemption and failed loads; greedy output equal
to no connector; nothing leaked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import faulty_connector
from kvport import LLM, SamplingParams
from kvport.connectors.offloading.mediums import ENGINE, HOST
from kvport.trace.checker import check_file
from offload_utils import (
    MODES, assert_nothing_leaked, keys_per_group, offloading_half, run, run_one_by_one,
)

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("no_faults")


def granite(extra: dict[str, Any] | None = None, connector: str = "OffloadingConnector",
            **kwargs: Any) -> LLM:
    cfg = {"cpu_bytes_to_use": 32 << 20, **(extra or {})}
    ktc: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both",
                           "kv_connector_extra_config": cfg}
    if connector != "OffloadingConnector":
        ktc["kv_connector_module_path"] = "faulty_connector"
    kwargs.setdefault("num_kv_blocks", 160)
    return LLM("builtin:tiny-granite4", block_size=BLOCK, kv_transfer_config=ktc, **kwargs)


def state_prompts() -> list[list[int]]:
    """Four prompts: two pairs, each pair sharing its first 150 tokens (lengths 230, 201)."""
    out = []
    for i in range(4):
        shared = [(t * 37 + 11 * (i // 2)) % 250 + 3 for t in range(150)]
        out.append(shared + [(t * 13 + i) % 250 + 3 for t in range(80 - 29 * (i % 2))])
    return out


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy tokens of state_prompts() without a connector or a prefix cache."""
    llm = LLM("builtin:tiny-granite4", block_size=BLOCK, num_kv_blocks=160,
              enable_prefix_caching=False)
    return run(llm, state_prompts(), GREEDY)[0]


def _full_hit(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def finish(llm: LLM) -> None:
    assert_nothing_leaked(llm)
    llm.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_every_group_comes_back_after_a_reset(reference: list[list[int]], mode: str) -> None:
    llm = granite(**MODES[mode])
    assert llm.engine.kv_cache_manager.group_windows == (2, None)  # HMA kept on
    prompts = state_prompts()
    assert run(llm, prompts, GREEDY)[0] == reference
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == reference
    assert cached == [_full_hit(p) for p in prompts]
    # The attention group keeps every block: 14 and 13 of a pair's prompts (237 and 208 tokens
    # computed), 9 of them shared. The state group keeps the state before each boundary a hit
    # may use, here the prompt's last (block 13 of 14; blocks 11-12 of 13: the prompt's last
    # boundary and the decoded block after it), the default interval (256 tokens) lying beyond.
    states, full = keys_per_group(llm, 2)
    lost = 4 if mode == "async" else 0  # a finished request's last block under async scheduling
    assert 2 * (14 + 13 - 9) - lost <= full <= 2 * (14 + 13 - 9)
    assert 2 * (1 + 2) - lost <= states <= 2 * (1 + 2)
    finish(llm)


@pytest.mark.parametrize("interval, hit_blocks", [(0, 9), (64, 8), (None, 0)])
def test_a_shared_prefix_hits_where_a_state_was_stored(
        reference: list[list[int]], interval: int | None, hit_blocks: int) -> None:
    # The pair shares 150 tokens (9 whole blocks). The second prompt's hit ends at the last
    # boundary with a stored state: every block (interval 0), every 4 blocks (64 tokens), or
    # none inside the shared prefix (the default, 16 blocks). Either way the second prompt met
    # the first at block 9 (the junction) and stores the state there: a third prompt with the
    # prefix hits all 9 blocks.
    extra = {} if interval is None else {"sliding_store_interval": interval}
    llm = granite(extra)
    prompts = state_prompts()
    third = prompts[0][:150] + [(t * 7 + 5) % 250 + 3 for t in range(40)]
    first, _ = run_one_by_one(llm, prompts[:1], GREEDY)
    llm.reset_prefix_cache()
    second, cached = run_one_by_one(llm, prompts[1:2], GREEDY)
    assert first + second == reference[:2]
    assert cached == [hit_blocks * BLOCK]
    llm.reset_prefix_cache()
    expected, _ = run_one_by_one(granite(enable_prefix_caching=False), [third], GREEDY)
    tokens, cached = run_one_by_one(llm, [third], GREEDY)
    assert tokens == expected and cached == [9 * BLOCK]
    finish(llm)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_and_preemption(reference: list[list[int]], mode: str) -> None:
    # Chunks of 24 tokens end inside blocks (a state block is rewritten until it is full, and
    # stored only then); 30 blocks for four requests of 13-15 attention blocks and 1-3 state
    # blocks each: requests are preempted.
    llm = granite(num_kv_blocks=30, max_num_batched_tokens=24, **MODES[mode])
    prompts = state_prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == reference and all(c > 0 for c in cached)
    finish(llm)


def test_disk_hits_in_a_new_engine(tmp_path: Path, reference: list[list[int]]) -> None:
    tiers = {"secondary_tiers": [{"type": "disk", "root_dir": str(tmp_path),
                                  "max_bytes": 256 << 20}]}
    prompts = state_prompts()
    llm = granite(tiers)
    assert run(llm, prompts, GREEDY)[0] == reference
    finish(llm)
    fresh = granite(tiers)  # an empty host tier: every hit comes from disk
    tokens, cached = run_one_by_one(fresh, prompts, GREEDY)
    assert tokens == reference
    assert cached == [_full_hit(p) for p in prompts]
    finish(fresh)


def test_the_tiers_namespace_names_the_state_group(tmp_path: Path) -> None:
    # The same checkpoint in one group of every layer (a connector that is not SupportsHMA), or
    # with its state layers grouped otherwise, lays blocks out differently: the disk and Redis
    # namespace names each group's kind and layers, so such entries never meet.
    tiers = {"secondary_tiers": [{"type": "disk", "root_dir": str(tmp_path),
                                  "max_bytes": 256 << 20}]}
    prompts = state_prompts()[:1]
    hybrid = granite(tiers)
    run(hybrid, prompts, GREEDY)
    spaces = {offloading_half(hybrid).geometry.namespace}
    finish(hybrid)
    assert b"|groups=state:0,2;full:1,3" in next(iter(spaces))


@pytest.mark.parametrize("sync", [True, False])
def test_failed_loads_recompute_every_group(tmp_path: Path, reference: list[list[int]],
                                            sync: bool) -> None:
    # Loads 1 and 3 fail: the engine recomputes from the last block where the state group holds
    # a good state (a hit loads only the state at its boundary: the start), in chunks of 64
    # tokens that read the earlier chunks' states from real blocks.
    faulty_connector.FAULTS[(HOST, ENGINE)] = {"fail_on": {1, 3}}
    llm = granite({"sync_host_loads": sync, "record_trace": str(tmp_path / "trace.jsonl")},
                  connector="FaultyOffloadingConnector", max_num_batched_tokens=64)
    prompts = state_prompts()
    assert run(llm, prompts, GREEDY)[0] == reference
    llm.reset_prefix_cache()
    tokens, _ = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == reference
    m = llm.get_metrics()
    assert m["kv_transfer"]["num_invalid_blocks"] > 0
    assert m["connector"]["requests"]["num_failed_loads"] == 2
    finish(llm)
    assert check_file(str(tmp_path / "trace.jsonl")) == []
