"""Mutants of the model's native bounds and checkpoint digests (model/): each removes one guard,
and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

KERNEL_BOUNDS = "tests/model/test_kernel_bounds.py"


MUTANTS: list[Mutant] = [
    # ---- native bounds (model/paged_attention.c, model/kernels.py) -----------------------------
    Mutant(
        "paged-attention-block-bounds", "src/kvport/model/paged_attention.c",
        "            if (id < 0 || id >= g->num_blocks)\n",
        "            if (0)\n",
        (f"{KERNEL_BOUNDS}::test_decode_attention_refuses_a_block_outside_the_pool",),
        "decode attention reads no block outside the pool (D14)"),
    Mutant(
        "paged-attention-length-bounds", "src/kvport/model/paged_attention.c",
        "        if (len < 0 || len > g->table_len * g->block_size)\n",
        "        if (0)\n",
        (f"{KERNEL_BOUNDS}::test_decode_attention_refuses_a_length_beyond_its_table",),
        "a length beyond its block table is refused, not read past the table's row"),
    Mutant(
        "paged-attention-checks-first", "src/kvport/model/paged_attention.c",
        "    if (bad != 0)\n        return bad;\n",
        "",
        (f"{KERNEL_BOUNDS}::test_decode_attention_refuses_a_block_outside_the_pool",),
        "decode attention runs its table check before any read"),
    Mutant(
        "store-kv-slot-bounds", "src/kvport/model/paged_attention.c",
        "        if (slot_blocks[t] < 0 || slot_blocks[t] >= g->num_blocks || "
        "slot_offsets[t] < 0 ||\n"
        "            slot_offsets[t] >= g->block_size)\n",
        "        if (0)\n",
        (f"{KERNEL_BOUNDS}::test_store_kv_refuses_a_slot_outside_the_pool_and_writes_nothing",),
        "the KV write writes no slot outside the pool (D14)"),
    Mutant(
        "kernels-raise-on-bad-table", "src/kvport/model/kernels.py",
        "    if rc > 0:  # an id or length out of range: C read nothing\n",
        "    if False:\n",
        (f"{KERNEL_BOUNDS}::test_decode_attention_refuses_a_block_outside_the_pool",),
        "a table the C code refused is an error, not a silent fallback to torch"),
    Mutant(
        "kernels-raise-on-bad-slot", "src/kvport/model/kernels.py",
        "    if bad >= 0:\n        raise kernel_checks.slot_error",
        "    if False:\n        raise kernel_checks.slot_error",
        (f"{KERNEL_BOUNDS}::test_store_kv_refuses_a_slot_outside_the_pool_and_writes_nothing",),
        "a slot the C code refused is an error, not a write reported done"),
    # ---- checkpoint digests (model/checkpoint_digest.py) ---------------------------------------
    Mutant(
        "vllmid-digest-tensor-heads", "src/kvport/model/checkpoint_digest.py",
        "        content.update(os.pread(fd, TENSOR_SAMPLE_BYTES, base + start))\n",
        "        pass\n",
        ("tests/model/test_checkpoint_digest.py::"
         "test_a_changed_byte_at_a_tensor_head_outside_the_fixed_samples_changes_it",),
        "the checkpoint digest reads the head of every safetensors tensor"),
    Mutant(
        "vllmid-digest-names-and-sizes", "src/kvport/model/checkpoint_digest.py",
        '            h.update(f"\\0{name}\\0{size}\\0".encode())\n',
        "",
        ("tests/model/test_checkpoint_digest.py::test_names_sizes_and_small_files_change_it",),
        "the checkpoint digest covers every file's name and size"),
    # ---- hybrid models (model/config.py, model/kv_groups.py, model/attention.py) ---------------
    Mutant(
        "config-layer-types-count", "src/kvport/model/config.py",
        "        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:\n",
        "        if False:\n",
        ("tests/model/test_model_config.py::test_unsupported_values_name_themselves",),
        "layer_types must name every layer"),
    Mutant(
        "config-layer-types-known", "src/kvport/model/config.py",
        "        if unknown:\n",
        "        if False:\n",
        ("tests/model/test_model_config.py::test_unsupported_values_name_themselves",),
        "an attention type kvport does not run is refused"),
    Mutant(
        "config-sliding-window-positive", "src/kvport/model/config.py",
        "        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window or 0) < 1:\n",
        "        if False:\n",
        ("tests/model/test_model_config.py::test_unsupported_values_name_themselves",),
        "sliding layers need a window of at least one token"),
    Mutant(
        "kv-group-needs-layers", "src/kvport/model/kv_groups.py",
        "        if not self.layer_ids:\n",
        "        if False:\n",
        ("tests/model/test_kv_groups.py::test_bad_groups_name_the_value",),
        "a KV cache group holds at least one layer"),
    Mutant(
        "dense-attention-window", "src/kvport/model/attention.py",
        "        mask = window_mask(len(q), len(k), window, q.device)\n",
        "        pass\n",
        ("tests/model/test_llama_vs_hf.py::test_float32_logits_match_transformers",
         "tests/model/test_tiny_gemma3.py::test_greedy_output_equals_transformers"),
        "a sliding layer's query sees only its window"),
]
