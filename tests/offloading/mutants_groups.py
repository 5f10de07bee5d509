"""Mutants of the OffloadingConnector's KV cache groups (a hybrid model) and of the engine's
rewind of a failed load across groups: each removes one guard, and the tests named with it must
then fail."""

from __future__ import annotations

from tools.mutation import Mutant

SCHED = "tests/offloading/test_hybrid_scheduler.py"
HYBRID = "tests/offloading/test_hybrid_offloading.py"
GROUPS = "tests/engine/test_kv_cache_groups.py"

MUTANTS: list[Mutant] = [
    Mutant(
        "window-left-flushed", "src/kvport/connectors/offloading/scheduler/half.py",
        "            if any(i < g.first_held(group, num_computed) for group, i in reads):\n",
        "            if False:\n",
        (f"{SCHED}::test_a_store_reading_blocks_the_window_left_is_flushed",),
        "a store reading a sliding block the window left is flushed before the block is reused"),
    Mutant(
        "sliding-stores-where-a-hit-can-use-them",
        "src/kvport/connectors/offloading/geometry.py",
        "        if last >= self.max_hit_blocks(num_prompt_tokens):\n",
        "        if True:\n",
        (f"{SCHED}::test_a_sliding_group_stores_the_windows_a_hit_can_use",
         f"{HYBRID}::test_every_group_comes_back_after_a_reset"),
        "a sliding group stores only the windows before boundaries a hit may use"),
    Mutant(
        "sliding-stores-at-the-junction", "src/kvport/connectors/offloading/geometry.py",
        "        if junction is not None and i < junction <= last:\n",
        "        if False:\n",
        (f"{HYBRID}::test_a_shared_prefix_hits_where_the_windows_were_stored",),
        "a prompt that met a stored prefix stores its sliding windows there (the next hits it)"),
    Mutant(
        "sliding-stores-only-held-blocks", "src/kvport/connectors/offloading/scheduler/stores.py",
        "                     if i >= held[group]\n",
        "                     if True\n",
        (f"{SCHED}::test_a_deferred_store_skips_blocks_the_window_left",),
        "a store never reads a sliding block the engine freed (it may hold another request's KV)"),
    Mutant(
        "groups-take-engine-blocks", "src/kvport/connectors/offloading/geometry.py",
        "        if len(windows) > 1 and f != 1:\n",
        "        if False:\n",
        (f"{SCHED}::test_several_groups_refuse_a_larger_offload_block",),
        "several groups offload engine blocks (a larger one would split windows)"),
    Mutant(
        "hit-needs-every-sliding-window", "src/kvport/connectors/offloading/scheduler/group_hits.py",
        "        if any(counts[w.stop - start] != counts[w.start - start]\n",
        "        if False and any(counts[w.stop - start] != counts[w.start - start]\n",
        (f"{SCHED}::test_a_hit_ends_where_every_group_holds_its_blocks",
         f"{HYBRID}::test_a_shared_prefix_hits_where_the_windows_were_stored"),
        "a hit ends where every sliding group holds the window before it"),
    Mutant(
        "keys-per-group", "src/kvport/connectors/offloading/geometry.py",
        "    return key + group.to_bytes(4, \"little\")\n",
        "    return key\n",
        (f"{HYBRID}::test_every_group_comes_back_after_a_reset",),
        "each group's blocks have keys of their own (one group's KV never loads into another)"),
    Mutant(
        "rewind-to-a-held-window", "src/kvport/engine/recovery.py",
        "        good = _rewind_block(kv, tables, first, invalid)\n",
        "        good = first\n",
        (f"{GROUPS}::test_a_failed_load_in_a_window_rewinds_to_where_every_window_is_held",
         f"{GROUPS}::test_a_failed_full_block_also_rewinds_past_the_released_windows"),
        "a failed load rewinds to where every sliding group holds its window"),
    Mutant(
        "rewind-fills-window-holes", "src/kvport/engine/kv_cache_manager.py",
        "            if cut is not None:\n                self.pool.free(",
        "            if False:\n                self.pool.free(",
        (f"{HYBRID}::test_failed_loads_recompute_every_group",),
        "a rewound request's window gets real blocks in place of the null block"),
]
