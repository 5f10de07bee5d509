"""Mutants of state-space hybrids (Granite 4) in kvport's engine: the model config's refusals,
where a step reads a state from, how many blocks a state group holds, and that a state fits a
block: each removes one guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

ENGINE = "tests/engine/test_state_hybrid_engine.py"
MODEL = "tests/model/test_tiny_granite4.py"
OFFLOAD = "tests/offloading/test_state_offloading.py"
EXAMPLE = "tests/connectors/test_example_state.py"

MUTANTS: list[Mutant] = [
    Mutant(
        "granite-refuses-experts", "src/kvport/model/granite_config.py",
        "    if int(d[\"num_local_experts\"] or 0):\n",
        "    if False:\n",
        (f"{MODEL}::test_configs_kvport_cannot_run_are_refused_by_name",),
        "a Granite 4 config with experts is refused by name (kvport runs the dense ones)"),
    Mutant(
        "granite-refuses-unknown-positions", "src/kvport/model/granite_config.py",
        "    if rope not in (None, \"nope\", \"rope\"):\n",
        "    if False:\n",
        (f"{MODEL}::test_configs_kvport_cannot_run_are_refused_by_name",),
        "a position embedding kvport does not compute is refused by name"),
    Mutant(
        "granite-refuses-heads-across-groups", "src/kvport/model/granite_config.py",
        "    if mamba.n_heads % mamba.n_groups:\n",
        "    if False:\n",
        (f"{MODEL}::test_configs_kvport_cannot_run_are_refused_by_name",),
        "mamba_n_heads must be a multiple of mamba_n_groups (each group's B and C serve its heads)"),
    Mutant(
        "mamba-layers-need-a-mamba-config", "src/kvport/model/config.py",
        "        if (MAMBA in self.layer_types) != (self.mamba is not None):\n",
        "        if False:\n",
        ("tests/model/test_model_config.py::test_unsupported_values_name_themselves",),
        "Mamba layers come with a Mamba config (and only then)"),
    Mutant(
        "state-group-has-no-window", "src/kvport/model/kv_groups.py",
        "        if self.state and self.sliding_window is not None:\n",
        "        if False:\n",
        ("tests/model/test_kv_groups.py::test_a_state_group_has_no_window",),
        "a KV cache group is a state group or a sliding one, never both"),
    Mutant(
        "vllm-refuses-non-attention-groups-first", "src/kvport/vllm/groups.py",
        "        if not hasattr(spec, \"num_kv_heads\") or not hasattr(spec, \"head_size\"):\n",
        "        if False:\n",
        ("tests/vllm/test_vllm_groups_layout.py::test_layouts_kvport_cannot_offload_are_named",),
        "kvport.vllm names a Mamba group whatever its block size, before any other check"),
    Mutant(
        "state-fits-a-block", "src/kvport/model/state_cache.py",
        "    if config.mamba.state_numel > block_size * per_token:\n",
        "    if False:\n",
        (f"{MODEL}::test_a_block_too_small_for_the_state_names_the_smallest_that_fits",
         f"{ENGINE}::test_a_block_too_small_for_the_state_is_refused_at_start"),
        "a block whose layer slot cannot hold a layer's state is refused, naming the size that fits"),
    Mutant(
        "state-read-from-the-previous-token", "src/kvport/model/state_cache.py",
        "        read = table[(start - 1) // block_size] if start else None\n",
        "        read = table[start // block_size] if start else None\n",
        (f"{ENGINE}::test_greedy_equals_transformers_with_prefix_hits",),
        "a step starts from the state in the block of the token before its first"),
    Mutant(
        "state-read-after-its-writer", "src/kvport/model/state_cache.py",
        "    batched = [r for r in runs if r.num_tokens == 1 and writer.get(r.read_block, r) is r]\n",
        "    batched = [r for r in runs if r.num_tokens == 1]\n",
        (f"{ENGINE}::test_a_hit_on_a_state_written_in_the_same_step",),
        "a request starting from a state another writes in the same step runs after it"),
    Mutant(
        "state-prefill-after-its-writer", "src/kvport/model/state_cache.py",
        "        if source is not None and source is not run and source in rest:\n",
        "        if False:\n",
        (f"{ENGINE}::test_a_hit_on_a_state_written_in_the_same_step",),
        "a prefill starting from a state another prefill writes in the same step runs after it"),
    Mutant(
        "state-group-holds-one-state", "src/kvport/model/kv_groups.py",
        "        return STATE_WINDOW if self.state else self.sliding_window\n",
        "        return self.sliding_window\n",
        (f"{ENGINE}::test_a_state_group_holds_only_its_latest_state",),
        "a state group frees every block but its latest state's"),
    Mutant(
        "offload-state-group-loads-one-block", "src/kvport/connectors/spec.py",
        "        return 2 if self.state else self.sliding_window\n",
        "        return self.sliding_window\n",
        (f"{OFFLOAD}::test_every_group_comes_back_after_a_reset",),
        "the OffloadingConnector stores a state group's blocks only where a hit can use them"),
    Mutant(
        "example-state-layer-stores-one-block", "src/kvport/connectors/example_layout.py",
        "        window = self.groups[group].held_window if self.groups else None\n",
        "        window = self.groups[group].sliding_window if self.groups else None\n",
        (f"{EXAMPLE}::test_state_layers_store_one_block",),
        "the ExampleConnector stores a state layer's block before the aligned end, not every block"),
    Mutant(
        "state-store-interval", "src/kvport/connectors/offloading/geometry.py",
        "        tokens = max(4 * largest, STATE_STORE_INTERVAL if any(g.state for g in groups) else 0)\n",
        "        tokens = 4 * largest\n",
        (f"{OFFLOAD}::test_a_shared_prefix_hits_where_a_state_was_stored",),
        "a state group stores every STATE_STORE_INTERVAL tokens by default, not every block"),
    Mutant(
        "state-namespace", "src/kvport/connectors/offloading/geometry.py",
        "                f\"{'state' if g.state else g.sliding_window or 'full'}:\"\n",
        "                f\"{g.sliding_window or 'full'}:\"\n",
        (f"{OFFLOAD}::test_the_tiers_namespace_names_the_state_group",),
        "the tiers' namespace names a state group, so its entries never meet another layout's"),
]
