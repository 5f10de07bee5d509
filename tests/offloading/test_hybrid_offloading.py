"""The OffloadingConnector on a hybrid model (tiny-gemma3: two sliding-window groups, window 48,
and one full-attention group; blocks of 16 tokens, so a hit needs the 3 blocks before it in a
sliding group): every group offloaded under its own keys, sliding groups only where a hit can use
them; hits after a reset, across a shared prefix, from disk in a new engine, with chunked
prefill, preemption and failed loads (hybrid_scenarios.py); greedy output equal to no connector;
nothing leaked."""

from __future__ import annotations

from pathlib import Path
import pytest

import hybrid_scenarios as scenario
from hybrid_scenarios import GREEDY, finish, full_hit, pair_prompts
from offload_utils import MODES, keys_per_group, run, run_one_by_one

pytestmark = pytest.mark.usefixtures("no_faults")


gemma = scenario.offloading_llm("builtin:tiny-gemma3")


@pytest.fixture(scope="module")
def hybrid_reference() -> list[list[int]]:
    return scenario.reference_tokens("builtin:tiny-gemma3")


@pytest.mark.parametrize("mode", MODES)
def test_every_group_comes_back_after_a_reset(hybrid_reference: list[list[int]],
                                              mode: str) -> None:
    llm = gemma(**MODES[mode])
    assert llm.engine.kv_cache_manager.group_windows == (48, 48, None)  # HMA kept on
    prompts = pair_prompts()
    assert run(llm, prompts, GREEDY)[0] == hybrid_reference
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == hybrid_reference
    assert cached == [full_hit(p) for p in prompts]
    # The full group keeps every block: 14 and 13 of a pair's prompts (237 and 208 tokens
    # computed), 9 of them shared. A sliding group keeps the window (3 blocks) before each
    # boundary a hit may use: the prompt's last (14, 12), the decoded ones after it, and every
    # 12 blocks (the default interval, 4 windows): blocks 9-13 and 9-12 of a pair.
    sliding_a, sliding_b, full = keys_per_group(llm, 3)
    assert full == 2 * (14 + 13 - 9)  # under async scheduling too (a final block's store)
    assert sliding_a == sliding_b == 2 * (5 + 4)
    finish(llm)


@pytest.mark.parametrize("interval, hit_blocks", [(0, 9), (64, 8), (None, 0)])
def test_a_shared_prefix_hits_where_the_windows_were_stored(
        hybrid_reference: list[list[int]], interval: int | None, hit_blocks: int) -> None:
    # The pair shares 150 tokens (9 whole blocks). The second prompt's hit ends where every
    # sliding group holds the window: every block (interval 0), the last multiple of 4 blocks
    # (interval 64), or nowhere inside the shared prefix (the default, 12 blocks); then at the
    # junction (9 blocks).
    scenario.shared_prefix_hits(gemma, pair_prompts(), hybrid_reference, interval, hit_blocks)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_and_preemption(hybrid_reference: list[list[int]], mode: str) -> None:
    # Chunks of 32 tokens: a sliding group's blocks leave the window while the prompt is still
    # prefilling (stores reading them are flushed first); 48 blocks of 16 tokens for four
    # requests of 13-16 blocks each in three groups: requests are preempted.
    llm = gemma(num_kv_blocks=48, max_num_batched_tokens=32, **MODES[mode])
    scenario.chunked_prefill_and_preemption(llm, pair_prompts(), hybrid_reference)


def test_disk_hits_in_a_new_engine(tmp_path: Path, hybrid_reference: list[list[int]]) -> None:
    scenario.disk_hits_in_a_new_engine(gemma, tmp_path, pair_prompts(), hybrid_reference)


@pytest.mark.parametrize("sync", [True, False])
def test_failed_loads_recompute_every_group(tmp_path: Path, hybrid_reference: list[list[int]],
                                            sync: bool) -> None:
    # The engine recomputes from the last block where every group holds what it needs (a
    # sliding group's windows before the hit were never loaded: the start), in chunks that read
    # the earlier chunks' KV from real blocks.
    scenario.failed_loads_recompute(gemma, tmp_path, pair_prompts(), hybrid_reference, sync)
