"""The OffloadingConnector on a state-space hybrid (tiny-granite4: a group of Mamba2 layers, whose
blocks hold each layer's state at a block boundary, and a full-attention group; blocks of 16
tokens): a hit at boundary k loads the attention group's blocks and the one state block k - 1;
state blocks are stored only where a hit can use them; hits after a reset, across a shared prefix,
from disk in a new engine, with chunked prefill, preemption and failed loads
(hybrid_scenarios.py); greedy output equal to no connector; nothing leaked."""

from __future__ import annotations

from pathlib import Path

import pytest

import hybrid_scenarios as scenario
from hybrid_scenarios import GREEDY, finish, full_hit, pair_prompts
from offload_utils import MODES, keys_per_group, offloading_half, run, run_one_by_one

pytestmark = pytest.mark.usefixtures("no_faults")

granite = scenario.offloading_llm("builtin:tiny-granite4")


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return scenario.reference_tokens("builtin:tiny-granite4")


@pytest.mark.parametrize("mode", MODES)
def test_every_group_comes_back_after_a_reset(reference: list[list[int]], mode: str) -> None:
    llm = granite(**MODES[mode])
    assert llm.engine.kv_cache_manager.group_windows == (2, None)  # HMA kept on
    prompts = pair_prompts()
    assert run(llm, prompts, GREEDY)[0] == reference
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == reference
    assert cached == [full_hit(p) for p in prompts]
    # The attention group keeps every block: 14 and 13 of a pair's prompts (237 and 208 tokens
    # computed), 9 of them shared. The state group keeps the state before each boundary a hit
    # may use, here the prompt's last (block 13 of 14; blocks 11-12 of 13: the prompt's last
    # boundary and the decoded block after it), the default interval (256 tokens) lying beyond.
    states, full = keys_per_group(llm, 2)
    assert full == 2 * (14 + 13 - 9)  # under async scheduling too (a final block's store)
    assert states == 2 * (1 + 2)
    finish(llm)


@pytest.mark.parametrize("interval, hit_blocks", [(0, 9), (64, 8), (None, 0)])
def test_a_shared_prefix_hits_where_a_state_was_stored(
        reference: list[list[int]], interval: int | None, hit_blocks: int) -> None:
    # The pair shares 150 tokens (9 whole blocks). The second prompt's hit ends at the last
    # boundary with a stored state: every block (interval 0), every 4 blocks (64 tokens), or
    # none inside the shared prefix (the default, 16 blocks); then at the junction (9 blocks).
    scenario.shared_prefix_hits(granite, pair_prompts(), reference, interval, hit_blocks)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_and_preemption(reference: list[list[int]], mode: str) -> None:
    # Chunks of 24 tokens end inside blocks (a state block is rewritten until it is full, and
    # stored only then); 30 blocks for four requests of 13-15 attention blocks and 1-3 state
    # blocks each: requests are preempted.
    llm = granite(num_kv_blocks=30, max_num_batched_tokens=24, **MODES[mode])
    scenario.chunked_prefill_and_preemption(llm, pair_prompts(), reference)


def test_disk_hits_in_a_new_engine(tmp_path: Path, reference: list[list[int]]) -> None:
    scenario.disk_hits_in_a_new_engine(granite, tmp_path, pair_prompts(), reference)


def test_the_tiers_namespace_names_the_state_group() -> None:
    # The same checkpoint in one group of every layer (a connector that is not SupportsHMA), or
    # with its state layers grouped otherwise, lays blocks out differently: the disk and Redis
    # namespace names each group's kind and layers, so such entries never meet.
    llm = granite()
    namespace = offloading_half(llm).geometry.namespace
    finish(llm)
    assert b"|groups=state:0,2;full:1,3" in namespace


@pytest.mark.parametrize("sync", [True, False])
def test_failed_loads_recompute_every_group(tmp_path: Path, reference: list[list[int]],
                                            sync: bool) -> None:
    # The engine recomputes from the last block where the state group holds a good state (a hit
    # loads only the state at its boundary: the start), in chunks that read the earlier chunks'
    # states from real blocks.
    scenario.failed_loads_recompute(granite, tmp_path, pair_prompts(), reference, sync)
