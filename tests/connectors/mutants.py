"""Mutants of the connector framework (connectors/driver.py, multi.py, factory.py, recording.py,
example.py, trace/writer.py): each removes one guard, and the tests named with it must then
fail."""

from __future__ import annotations

from tools.mutation import Mutant

RECORDING = "tests/connectors/test_recording.py"
REGRESSIONS = "tests/connectors/test_framework_regressions.py"


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
        "        if did_forward or self.call_order == VLLM_0_32:",
        "        if did_forward:",
        ((f"{REGRESSIONS}::test_2_saves_queued_in_wait_for_save_are_lost_in_legacy_no_forward_steps"
          "[SaveInWaitForSaveConnector-vllm-0.32]"),),
        "vllm-0.32 calls wait_for_save on every step, no-forward steps included"),
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
        "        connector = RecordingConnector(connector, str(trace_path), header)\n",
        "        connector = RecordingConnector(connector, str(trace_path))\n",
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
         "test_loads_give_the_output_of_no_connector_in_either_order"),
        "a MultiConnector child hears only of the async loads it owns (S7 in its own trace)"),
    # ---- the example connector's directory (connectors/example.py) -----------------------------
    Mutant(
        "example-default-private", "src/kvport/connectors/example.py",
        "            if problem is not None:\n"
        "                raise ValueError(f\"ExampleConnector:",
        "            if False:\n                raise ValueError(f\"ExampleConnector:",
        ("tests/connectors/test_example.py::test_the_default_store_is_private_to_the_user",),
        "ExampleConnector's default store is refused where another user could read or fill it"),
]
