"""Mutants of the engine's connector bookkeeping (engine/kv_transfer.py, recovery.py,
scheduler.py): each removes one guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

SCHED = "tests/engine/test_scheduler_connector.py"


MUTANTS: list[Mutant] = [
    # ---- the engine's connector bookkeeping (engine/kv_transfer.py, recovery.py, scheduler.py) ---
    Mutant(
        "hold-while-loading", "src/kvport/engine/kv_transfer.py",
        "        if was_loading and rid not in self._finished_recving:\n            reasons.add(RECV)\n",
        "",
        (f"{SCHED}::test_abort_while_loading_frees_blocks_only_after_the_load_reports",),
        "an aborted request's blocks stay allocated while its async load still writes them"),
    Mutant(
        "hold-while-sending", "src/kvport/engine/kv_transfer.py",
        "            if delay:\n                reasons.add(SEND)\n",
        "",
        (f"{SCHED}::test_delayed_send_keeps_blocks_until_finished_sending",),
        "request_finished True keeps the blocks until finished_sending names the request"),
    Mutant(
        "release-only-by-its-completion", "src/kvport/engine/kv_transfer.py",
        "        if held is not None and kind in held[1]:\n",
        "        if held is not None:\n",
        (f"{SCHED}::test_a_completion_of_the_other_kind_keeps_the_blocks_held",),
        "held blocks are released only by the completion they wait for"),
    Mutant(
        "duplicate-recv-counted", "src/kvport/engine/kv_transfer.py",
        "        if kind == RECV and rid in self._async_load_tokens and rid not in self._finished_recving:\n",
        "        if kind == RECV and rid in self._async_load_tokens:\n",
        (f"{SCHED}::test_a_duplicate_finished_recving_before_the_resume_is_counted",),
        "a second finished_recving of the same load is ignored and counted"),
    Mutant(
        "sync-load-leaves-a-token", "src/kvport/engine/kv_transfer.py",
        "        if not is_async and num_local + num_external >= req.num_tokens:\n",
        "        if False:\n",
        (f"{SCHED}::test_load_of_the_whole_prompt_still_computes_one_token",),
        "a sync load covering the whole prompt is cut to leave a token to compute"),
    Mutant(
        "no-async-load-of-nothing", "src/kvport/engine/kv_transfer.py",
        "        if num_external == 0 and is_async:\n",
        "        if False:\n",
        (f"{SCHED}::test_answers_outside_the_contract_are_corrected_and_counted",),
        "(0, True) would park a request for a load that never reports: corrected to (0, False)"),
    Mutant(
        "matched-count-checked", "src/kvport/engine/kv_transfer.py",
        "isinstance(num_external, bool) or num_external < 0:\n",
        "isinstance(num_external, bool):\n",
        (f"{SCHED}::test_answers_outside_the_contract_are_corrected_and_counted",),
        "a negative matched-token count is corrected to 0"),
    Mutant(
        "async-load-leaves-a-token", "src/kvport/engine/kv_transfer.py",
        "        num_valid = max(0, min(self._async_load_tokens.pop(rid), req.num_tokens - 1))\n",
        "        num_valid = max(0, self._async_load_tokens.pop(rid))\n",
        (f"{SCHED}::test_load_of_the_whole_prompt_still_computes_one_token",),
        "a request resumed after an async load still computes its last prompt token"),
    Mutant(
        "empty-load-stops-asking", "src/kvport/engine/kv_transfer.py",
        "        if num_valid == 0:\n            self._no_external.add(rid)\n",
        "",
        (f"{SCHED}::test_failed_async_load_resumes_from_the_last_good_block",),
        "an async load that delivered nothing makes the request start over without the connector"),
    Mutant(
        "admission-counted-once", "src/kvport/engine/kv_transfer.py",
        "        return Match(MatchKind.MATCHED, num_local, num_external, bool(is_async))\n",
        "        self.stats.num_queried_tokens += req.num_tokens - num_local  # per call\n"
        "        return Match(MatchKind.MATCHED, num_local, num_external, bool(is_async))\n",
        (f"{SCHED}::test_a_request_retried_for_room_is_counted_once",),
        "queried and hit tokens count once per admission, not once per retry"),
    Mutant(
        "failed-load-limits-a-load-in-flight", "src/kvport/engine/recovery.py",
        "            xfer.limit_async_load(req.request_id, good * bs)\n",
        "            pass\n",
        (f"{SCHED}::test_failed_async_load_resumes_from_the_last_good_block",),
        "a parked request resumes with only the tokens before its first failed block"),
    Mutant(
        "failed-load-rewinds", "src/kvport/engine/recovery.py",
        "            req.rewind(good * bs, step_id)\n",
        "            pass\n",
        (f"{SCHED}::test_failed_sync_load_recomputes_from_the_last_good_block",),
        "a running request recomputes from the last good block before a failed one"),
    Mutant(
        "rewound-request-resent", "src/kvport/engine/recovery.py",
        "            resend.add(req.request_id)\n",
        "",
        (f"{SCHED}::test_failed_sync_load_recomputes_from_the_last_good_block",),
        "a rewound request's runner state is sent again in full"),
    Mutant(
        "failed-blocks-uncached", "src/kvport/engine/recovery.py",
        "    kv.uncache_block_ids(invalid)\n",
        "",
        (f"{SCHED}::test_failed_load_blocks_leave_the_cache_even_when_their_request_is_gone",),
        "blocks a load failed to fill leave the prefix cache, whoever holds them"),
    Mutant(
        "blocks-after-a-failed-one-uncached", "src/kvport/engine/recovery.py",
        "        kv.uncache_blocks_from(req, first)\n",
        "",
        (f"{SCHED}::test_blocks_computed_from_a_failed_load_are_withdrawn_with_it",),
        "blocks computed from a failed load's blocks leave the prefix cache with them"),
    Mutant(
        "failed-step-blocks-uncached", "src/kvport/engine/recovery.py",
        "    kv.uncache_blocks_from(req, max(0, first_token) // kv.block_size)\n",
        "",
        (f"{SCHED}::test_a_failed_step_withdraws_the_blocks_it_computed_or_loaded",),
        "blocks a failed step computed or loaded leave the prefix cache"),
    Mutant(
        "stale-outputs-dropped", "src/kvport/engine/scheduler.py",
        "            if sched_out.step < req.discard_outputs_before_step:\n",
        "            if False:\n",
        (f"{SCHED}::"
         "test_async_scheduling_drops_the_token_of_a_step_in_flight_behind_a_failed_load",),
        "tokens of steps computed from KV that a failed load rewound are dropped"),
    Mutant(
        "loading-blocks-never-reclaimed", "src/kvport/engine/scheduler.py",
        "                continue  # an async load still writes into them\n",
        "                pass\n",
        (f"{SCHED}::test_blocks_an_async_load_writes_are_never_reclaimed_for_another_request",),
        "blocks an async load still writes are never freed for another request"),
    Mutant(
        "async-load-blocks-unpublished", "src/kvport/engine/scheduler.py",
        "delay_cache_blocks=load_async) is None:\n",
        "delay_cache_blocks=False) is None:\n",
        (f"{SCHED}::test_async_load_parks_the_request_until_finished_recving",),
        "blocks an async load will fill are not published before it reports"),
    Mutant(
        "failed-match-fails-its-request", "src/kvport/engine/scheduler.py",
        "                self._fail_detached(req, match.error or \"KV connector failed\")\n"
        "                return _Admission.FAILED\n",
        "                return _Admission.NOT_READY\n",
        (f"{SCHED}::test_a_raising_scheduler_hook_fails_only_its_request",),
        "a raising get_num_new_matched_tokens fails its request alone, not the engine"),
    Mutant(
        "failed-hook-fails-its-request", "src/kvport/engine/scheduler.py",
        "        if error is not None:\n            self._fail_detached(req, error)\n"
        "            return _Admission.FAILED\n",
        "",
        (f"{SCHED}::test_a_raising_scheduler_hook_fails_only_its_request",),
        "a raising update_state_after_alloc fails its request alone"),
    Mutant(
        "held-blocks-freed-on-completion", "src/kvport/engine/scheduler.py",
        "            self.kv.free(req)  # the connector no longer reads or writes its blocks\n",
        "            pass\n",
        (f"{SCHED}::test_delayed_send_keeps_blocks_until_finished_sending",),
        "held blocks go back to the pool once the connector reports"),
    Mutant(
        "load-failure-policy-fail", "src/kvport/engine/scheduler.py",
        '        if self.load_failure_policy == "fail":\n',
        "        if False:\n",
        (f"{SCHED}::test_fail_policy_fails_the_request_alone",),
        "kv_load_failure_policy=fail fails the request whose load failed"),
    # ---- the worker call orders (engine/scheduler.py) ------------------------------------------
    Mutant(
        "sync-loads-flagged", "src/kvport/engine/scheduler.py",
        "            plan.has_sync_kv_loads = True  # the forward reads what start_load_kv loads\n",
        "            pass\n",
        (f"{SCHED}::test_only_the_step_that_admits_a_sync_load_has_sync_kv_loads",),
        "a step that admits a sync load says so (vllm-0.32 starts its loads before the forward)"),
    # ---- KV cache groups (engine/kv_cache_manager.py, block_pool.py) -------------------------
    Mutant(
        "sliding-groups-need-a-null-block", "src/kvport/engine/kv_cache_manager.py",
        "        if any(w is not None for w in group_windows) and pool.null_block is None:\n",
        "        if False:\n",
        ("tests/engine/test_kv_cache_groups.py::test_bad_groups_are_named",),
        "a sliding-window group's table has a null block to hold where its window moved past"),
    Mutant(
        "null-block-never-free", "src/kvport/engine/block_pool.py",
        "            (b.block_id, b) for b in self.blocks if b is not self.null_block)",
        "            (b.block_id, b) for b in self.blocks)",
        ("tests/engine/test_kv_cache_groups.py::test_the_null_block_is_never_handed_out",),
        "the null block is never allocated to a request"),
    Mutant(
        "sliding-hit-needs-its-window", "src/kvport/engine/kv_cache_manager.py",
        "            if run == need:\n                return i + need\n",
        "            return limit\n",
        ("tests/engine/test_kv_cache_groups.py::"
         "test_an_evicted_window_block_shortens_the_hit_for_every_group",),
        "a hit is only as long as the sliding group's window blocks are cached"),
    Mutant(
        "sliding-window-frees-behind-it", "src/kvport/engine/kv_cache_manager.py",
        "            self._skip_blocks(table, firsts[g])\n",
        "            pass\n",
        ("tests/engine/test_kv_cache_groups.py::test_a_growing_request_frees_what_its_window_left",
         "tests/engine/test_hybrid_engine.py::test_sliding_groups_hold_only_their_window"),
        "a sliding group gives back the blocks its window has left"),
    Mutant(
        "hits-before-allocation", "src/kvport/engine/kv_cache_manager.py",
        "        for blocks in kept:\n",
        "        for blocks in []:\n",
        ("tests/engine/test_kv_cache_groups.py::"
         "test_a_hit_needs_the_full_prefix_and_only_the_window_of_the_sliding_group",),
        "hit blocks are referenced (taken off the free queue) before any group allocates"),
    Mutant(
        "blocks-in-use-cap-one-group", "src/kvport/engine/kv_cache_manager.py",
        "        if self.max_blocks_in_use is not None and in_use + needed > self.max_blocks_in_use:\n"
        "            return None\n        if rid not in self.req_to_blocks:",
        "        if False:\n"
        "            return None\n        if rid not in self.req_to_blocks:",
        ("tests/engine/test_kv_cache_cap.py::test_cap_refuses_blocks_the_pool_still_has",),
        "the cap on blocks in use holds on the one-group path"),
    Mutant(
        "blocks-in-use-cap-groups", "src/kvport/engine/kv_cache_manager.py",
        "        if self.max_blocks_in_use is not None and in_use + needed > self.max_blocks_in_use:\n"
        "            return None\n        rid = request.request_id",
        "        if False:\n"
        "            return None\n        rid = request.request_id",
        ("tests/engine/test_kv_cache_groups.py::test_the_blocks_in_use_cap_counts_every_group",),
        "the cap on blocks in use counts every group's blocks"),
    Mutant(
        "hma-connector-keeps-groups", "src/kvport/engine/executor.py",
        "    if ktc is not None and not config_supports_hma(ktc):\n",
        "    if ktc is not None:\n",
        ("tests/engine/test_hybrid_connector_api.py::test_an_hma_connector_gets_every_group",),
        "a SupportsHMA connector runs with the model's KV cache groups"),
    Mutant(
        "hma-connector-finishes-all-groups", "src/kvport/engine/kv_transfer.py",
        "                if self.hma:\n                    delay, _params",
        "                if False:\n                    delay, _params",
        ("tests/engine/test_hybrid_connector_api.py::test_an_hma_connector_gets_every_group",),
        "a SupportsHMA connector is asked request_finished_all_groups with every group's table"),
]
