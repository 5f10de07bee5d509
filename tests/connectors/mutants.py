"""Mutants of the connector framework (connectors/driver.py, multi.py, factory.py, recording.py,
example.py, trace/writer.py): each removes one guard, and the tests named with it must then
fail."""

from __future__ import annotations

from tools.mutation import Mutant

RECORDING = "tests/connectors/test_recording.py"
REGRESSIONS = "tests/connectors/test_framework_regressions.py"
EXAMPLE_HYBRID = "tests/connectors/test_example_hybrid.py"
MULTI_HYBRID = "tests/connectors/test_multi_hybrid.py"


MUTANTS: list[Mutant] = [
    # ---- the worker call orders (connectors/driver.py), the recorder and its header ------------
    Mutant(
        "preemptions-before-bind", "src/kvport/connectors/driver.py",
        '        self._guarded("handle_preemptions", lambda: c.handle_preemptions(meta), None)\n'
        '        self._guarded("bind_connector_metadata", '
        'lambda: c.bind_connector_metadata(meta), None)\n',
        '        self._guarded("bind_connector_metadata", '
        'lambda: c.bind_connector_metadata(meta), None)\n'
        '        self._guarded("handle_preemptions", lambda: c.handle_preemptions(meta), None)\n',
        (f"{REGRESSIONS}::test_1_handle_preemptions_runs_before_bind[vllm-0.32]",),
        "handle_preemptions runs before the step's metadata is bound, in either order"),
    Mutant(
        "sync-loads-before-the-forward", "src/kvport/connectors/driver.py",
        "        return self.call_order == LEGACY or ctx.has_sync_kv_loads\n",
        "        return self.call_order == LEGACY\n",
        (f"{REGRESSIONS}::test_3_sync_loads_start_before_the_forward_that_reads_them[vllm-0.32]",),
        "vllm-0.32 starts a step's sync loads before the forward that reads them"),
    Mutant(
        "loads-start-after-the-forward", "src/kvport/connectors/driver.py",
        "        if not self._load_started:",
        "        if False:",
        ((f"{REGRESSIONS}::test_2_saves_queued_in_wait_for_save_are_lost_in_legacy_no_forward_steps"
          "[DeferredSaveConnector-vllm-0.32]"),),
        "vllm-0.32 starts the loads of a step without sync loads after its forward"),
    Mutant(
        "wait-for-save-every-step", "src/kvport/connectors/driver.py",
        "        if did_forward or self.call_order != LEGACY:",
        "        if did_forward:",
        ((f"{REGRESSIONS}::test_2_saves_queued_in_wait_for_save_are_lost_in_legacy_no_forward_steps"
          "[SaveInWaitForSaveConnector-vllm-0.32]"),),
        "vllm-0.32 calls wait_for_save on every step, no-forward steps included"),
    Mutant(
        "mrv2-finish-forward", "src/kvport/connectors/driver.py",
        "        if self.call_order == VLLM_MRV2:",
        "        if False:",
        (("tests/connectors/test_call_orders.py::test_loads_give_the_output_of_no_connector_in_"
          "each_order[vllm-mrv2-example-sync]"),),
        "vllm-mrv2 calls finish_forward once per step, when the forward has ended"),
    Mutant(
        "driver-records-hook-errors", "src/kvport/connectors/driver.py",
        "            self._record_error(hook, exc)\n            return if_raised\n",
        "            return if_raised\n",
        ("tests/connectors/test_connector_config.py::"
         "test_every_worker_hook_failure_fails_only_the_named_request[get_finished-inproc]",),
        "a worker hook that raises fails its requests (the driver records it, then goes on)"),
    Mutant(
        "recorder-writes-the-header", "src/kvport/trace/writer.py",
        "        if self.header is not None and self._header_pid != TraceProcess.pid:\n",
        "        if False:\n",
        (f"{RECORDING}::test_a_recorder_given_the_engine_header_writes_it_first",),
        "a recorded group starts with the engine's header (the checker picks its order by it)"),
    Mutant(
        "factory-hands-the-header-to-the-recorder", "src/kvport/connectors/factory.py",
        "        connector = recorder_for(connector, str(trace_path), header)\n",
        "        connector = recorder_for(connector, str(trace_path))\n",
        (f"{RECORDING}::"
         "test_factory_hands_the_header_to_recorders_and_a_multi_connectors_children",),
        "the engine's header reaches the recorder the factory wraps a connector in"),
    Mutant(
        "multi-passes-the-header-to-its-children", "src/kvport/connectors/multi.py",
        "create_connector(c, role, header) for c in children",
        "create_connector(c, role) for c in children",
        (f"{RECORDING}::"
         "test_factory_hands_the_header_to_recorders_and_a_multi_connectors_children",),
        "a MultiConnector's recording children write the engine's header too"),
    Mutant(
        "recorder-flags-sync-loads", "src/kvport/connectors/recording.py",
        '        sync = int(bool(getattr(ctx, "has_sync_kv_loads", False)))\n',
        '        sync = 0\n',
        (f"{RECORDING}::test_start_load_kv_records_whether_the_step_has_sync_loads",),
        "start_load_kv's record says whether the step has sync loads"),
    Mutant(
        "multi-tells-each-child-its-own-completions", "src/kvport/connectors/multi.py",
        "            finished_recving={rid for rid, owner in recv_owner.items() if owner == i},\n",
        "            finished_recving=set(recv_owner),\n",
        ("tests/connectors/test_multi.py::test_each_child_is_told_only_of_its_own_completions",
         "tests/connectors/test_call_orders.py::"
         "test_loads_give_the_output_of_no_connector_in_each_order"),
        "a MultiConnector child hears only of the async loads it owns (S7 in its own trace)"),
    # ---- the example connector's directory (connectors/example.py) -----------------------------
    Mutant(
        "example-default-private", "src/kvport/connectors/example.py",
        "            if problem is not None:\n"
        "                raise ValueError(f\"ExampleConnector:",
        "            if False:\n                raise ValueError(f\"ExampleConnector:",
        ("tests/connectors/test_example.py::test_the_default_store_is_private_to_the_user",),
        "ExampleConnector's default store is refused where another user could read or fill it"),
    # ---- KV cache groups: the example connector's layout, MultiConnector's SupportsHMA --------
    Mutant(
        "example-sliding-layers-keep-their-window", "src/kvport/connectors/example_layout.py",
        "        if window is None:\n            return 0\n",
        "        if True:\n            return 0\n",
        (f"{EXAMPLE_HYBRID}::test_sliding_layers_store_only_their_window",
         f"{EXAMPLE_HYBRID}::"
         "test_a_sliding_layer_stores_its_window_and_loads_it_into_its_groups_blocks",
         f"{EXAMPLE_HYBRID}::"
         "test_a_load_fills_each_groups_table_from_the_later_of_hit_and_window[no-local-hit]"),
        "a sliding layer stores and loads only the window its group's table holds (a load "
        "past it would write the null block)"),
    Mutant(
        "example-load-starts-at-the-window", "src/kvport/connectors/example_layout.py",
        "            first = max(start_token // block_size, "
        "self.first_block(g, num_tokens, block_size))\n",
        "            first = start_token // block_size\n",
        (f"{EXAMPLE_HYBRID}::"
         "test_a_load_fills_each_groups_table_from_the_later_of_hit_and_window[no-local-hit]",
         f"{EXAMPLE_HYBRID}::test_every_prompt_comes_back_from_its_entry_after_a_reset[sync]"),
        "a sliding group's store and load start at its window, where its table holds blocks"),
    Mutant(
        "example-load-starts-past-the-local-hit", "src/kvport/connectors/example_layout.py",
        "            first = max(start_token // block_size, "
        "self.first_block(g, num_tokens, block_size))\n",
        "            first = self.first_block(g, num_tokens, block_size)\n",
        (f"{EXAMPLE_HYBRID}::"
         "test_a_load_fills_each_groups_table_from_the_later_of_hit_and_window[hit-inside-window]",),
        "a load leaves the local prefix hit's blocks alone (they may be shared), in every group"),
    Mutant(
        "example-load-checks-what-the-file-holds", "src/kvport/connectors/example.py",
        "            if skip < 0 or len(data) - skip != len(span.block_ids) * bs:\n",
        "            if False:\n",
        (f"{EXAMPLE_HYBRID}::test_a_load_the_entry_cannot_supply_exactly_is_a_load_error",),
        "a load the entry's files cannot supply exactly is a load error that writes nothing"),
    Mutant(
        "example-key-names-the-group-layout", "src/kvport/connectors/example.py",
        "        self._namespace = spec.hash_root + self._layout.key_tag()\n",
        "        self._namespace = spec.hash_root\n",
        (f"{EXAMPLE_HYBRID}::test_the_group_layout_is_part_of_the_key",
         f"{EXAMPLE_HYBRID}::test_a_run_with_one_group_never_reads_grouped_entries"),
        "an entry of one KV cache group layout is never found under another"),
    Mutant(
        "multi-hma-only-if-every-child-is", "src/kvport/connectors/multi.py",
        "        return HMAMultiConnector if all(map(config_supports_hma, children))",
        "        return HMAMultiConnector if any(map(config_supports_hma, children))",
        (f"{MULTI_HYBRID}::test_a_multi_connector_is_hma_exactly_when_every_child_is[example+noop]",
         f"{MULTI_HYBRID}::test_a_child_without_hma_keeps_one_group[offloading+noop]"),
        "a MultiConnector is SupportsHMA only when every child is (vLLM's rule)"),
    Mutant(
        "engine-asks-the-class-the-config-builds", "src/kvport/connectors/factory.py",
        "    return supports_hma(connector_class_for(config))\n",
        "    return supports_hma(get_connector_class(config))\n",
        (f"{MULTI_HYBRID}::"
         "test_a_multi_connector_is_hma_exactly_when_every_child_is[example+offloading]",
         f"{MULTI_HYBRID}::test_two_hma_children_keep_the_groups_and_hits_come_back[example]"),
        "the engine keeps the groups for the class a config builds (HMAMultiConnector), and so "
        "agrees with the instance"),
    Mutant(
        "hma-multi-refuses-a-child-without-hma", "src/kvport/connectors/multi.py",
        "        if supports_hma(self) and not all(config_supports_hma(c) for c in children):\n",
        "        if False:\n",
        (f"{MULTI_HYBRID}::test_an_hma_multi_connector_refuses_a_child_without_hma",),
        "a SupportsHMA MultiConnector never hands tables per group to a child that reads one"),
]
