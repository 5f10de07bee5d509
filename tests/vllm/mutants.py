"""Mutants of kvport inside vLLM (vllm/, and what the offloading connector does for it): each
removes one guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

VLLM_IDENTITY = "tests/vllm/test_vllm_identity.py"
VLLM_PAGES = "tests/vllm/test_vllm_pages.py"


MUTANTS: list[Mutant] = [
    # ---- the OffloadingConnector inside vLLM ---------------------------------------------------
    Mutant(
        "failed-load-not-offered-again", "src/kvport/connectors/offloading/scheduler/hits.py",
        "        if not self.load_enabled or (st is not None and st.load_failed):\n",
        "        if not self.load_enabled:\n",
        ("tests/vllm/test_vllm_scheduler.py::test_a_failed_load_is_recomputed[False]",),
        "a request whose load failed is not offered it again (vLLM would retry it forever)"),
    Mutant(
        "vllm-worker-waits-for-sync-loads", "src/kvport/vllm/storage.py",
        "                        caches_failed_sync_loads=True,\n",
        "                        caches_failed_sync_loads=False,\n",
        (f"{VLLM_IDENTITY}::test_a_shared_tier_sets_vllms_load_failure_policy_to_recompute",),
        "inside vLLM synchronous loads are waited for (vLLM keeps a failed one's blocks)"),
    # ---- model identity (vllm/identity.py), shared tiers and the failure policy ----------------
    Mutant(
        "vllmid-m1-sync-hit-cap", "src/kvport/connectors/offloading/scheduler/hits.py",
        "            end = min(end, g.max_hit_blocks(request.num_tokens))\n",
        "",
        ("tests/vllm/test_vllm_scheduler.py::"
         "test_a_block_aligned_prompt_held_wholly_in_host_memory_computes_its_last_token[True]",),
        "a sync hit leaves the prompt's last token computed (vLLM asserts num_new_tokens > 0)"),
    Mutant(
        "vllmid-identity-dtype", "src/kvport/vllm/identity.py",
        '        "dtype": mc.dtype,\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[dtype-bfloat16]",),
        "the model identity (the shared tiers' namespace) includes the dtype"),
    Mutant(
        "vllmid-identity-quantization", "src/kvport/vllm/identity.py",
        '        "quantization": getattr(mc, "quantization", None),\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[quantization-fp8]",),
        "the model identity (the shared tiers' namespace) includes the quantization"),
    Mutant(
        "vllmid-identity-load-format", "src/kvport/vllm/identity.py",
        '        "load_format": getattr(vllm_config.load_config, "load_format", None),\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[load_format-gguf]",),
        "the model identity (the shared tiers' namespace) includes the load format"),
    Mutant(
        "vllmid-identity-model-impl", "src/kvport/vllm/identity.py",
        '        "model_impl": getattr(mc, "model_impl", None),\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[model_impl-transformers]",),
        "the model identity (the shared tiers' namespace) includes the model impl"),
    Mutant(
        "vllmid-identity-code-revision", "src/kvport/vllm/identity.py",
        '        "code_revision": getattr(mc, "code_revision", None),\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[code_revision-v2]",),
        "the model identity (the shared tiers' namespace) includes the code revision"),
    Mutant(
        "vllmid-identity-kv-cache-dtype", "src/kvport/vllm/identity.py",
        '        "kv_cache_dtype": getattr(vllm_config.cache_config, "cache_dtype", None),\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[kv_cache_dtype-fp8]",),
        "the model identity (the shared tiers' namespace) includes the kv cache dtype"),
    Mutant(
        "vllmid-identity-hf-overrides", "src/kvport/vllm/identity.py",
        '        "hf_overrides": getattr(mc, "hf_overrides", None),\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[hf_overrides-value6]",),
        "the model identity (the shared tiers' namespace) includes the hf overrides"),
    Mutant(
        "vllmid-identity-loaded-config", "src/kvport/vllm/identity.py",
        '        "config": loaded_config(getattr(mc, "hf_config", None)),\n',
        "",
        (f"{VLLM_IDENTITY}::"
         "test_each_setting_that_changes_the_kv_changes_the_identity[hf-value7]",),
        "the model identity (the shared tiers' namespace) includes the loaded config"),
    Mutant(
        "vllmid-identity-revision", "src/kvport/vllm/identity.py",
        '        return "|".join(["vllm-model-v2", name, self.revision or "-", '
        'self.weights_digest or "-",\n',
        '        return "|".join(["vllm-model-v2", name, "-", self.weights_digest or "-",\n',
        (f"{VLLM_IDENTITY}::"
         "test_a_hub_id_missing_from_the_cache_is_identified_only_by_a_recorded_commit",),
        "the identity includes the resolved revision"),
    Mutant(
        "vllmid-identity-weights-digest", "src/kvport/vllm/identity.py",
        '        return "|".join(["vllm-model-v2", name, self.revision or "-", '
        'self.weights_digest or "-",\n',
        '        return "|".join(["vllm-model-v2", name, self.revision or "-", "-",\n',
        (f"{VLLM_IDENTITY}::test_local_dirs_of_one_name_are_told_apart_by_their_weights",
         f"{VLLM_IDENTITY}::test_a_directory_with_bin_weights_is_identified_by_their_content"),
        "the identity includes the weights' content digest (a local directory is not its name)"),
    Mutant(
        "vllmid-identity-snapshot-revision", "src/kvport/vllm/identity.py",
        "        revision = weights.name  # a Hugging Face cache snapshot is named by its commit\n",
        "        pass\n",
        (f"{VLLM_IDENTITY}::test_a_hub_id_is_pinned_by_its_cached_snapshot",),
        "a hub id's revision is the commit of the cache snapshot its weights are read from"),
    Mutant(
        "vllmid-identity-recorded-commit", "src/kvport/vllm/identity.py",
        "    if isinstance(recorded, str) and FULL_HASH.fullmatch(recorded):\n",
        "    if False:\n",
        (f"{VLLM_IDENTITY}::"
         "test_a_hub_id_missing_from_the_cache_is_identified_only_by_a_recorded_commit",),
        "the commit transformers recorded loading the config pins a hub id"),
    Mutant(
        "vllmid-identity-dummy-weights", "src/kvport/vllm/identity.py",
        '    if weights is None or str(load_format) == "dummy":\n',
        "    if weights is None:\n",
        (f"{VLLM_IDENTITY}::test_dummy_weights_are_not_an_identity",),
        "dummy (random) weights are not identified by the checkpoint they were not read from"),
    Mutant(
        "vllmid-identity-needs-weight-files", "src/kvport/vllm/identity.py",
        "        if weights.is_dir() and not any(p.suffix in WEIGHT_SUFFIXES for p in "
        "weights.rglob(\"*\")\n",
        "        if False and not any(p.suffix in WEIGHT_SUFFIXES for p in weights.rglob(\"*\")\n",
        (f"{VLLM_IDENTITY}::"
         "test_a_model_without_weights_shares_no_tier_unless_a_namespace_is_named",),
        "a directory without weight files does not identify the model"),
    Mutant(
        "vllmid-refuse-unidentified", "src/kvport/vllm/storage.py",
        "    if not identity.established and namespace is None:\n",
        "    if False:\n",
        (f"{VLLM_IDENTITY}::"
         "test_a_model_without_weights_shares_no_tier_unless_a_namespace_is_named",),
        "shared tiers refuse a model that cannot be identified unless a namespace is named"),
    Mutant(
        "vllmid-namespace-in-geometry", "src/kvport/connectors/offloading/geometry.py",
        '            namespace += b"|namespace=" + config.namespace.encode()\n',
        "            pass\n",
        ("tests/offloading/test_geometry.py::"
         "test_a_configured_namespace_separates_the_shared_tiers_entries",
         f"{VLLM_IDENTITY}::"
         "test_a_model_without_weights_shares_no_tier_unless_a_namespace_is_named"),
        "a configured namespace separates the shared tiers' entries (both engines)"),
    Mutant(
        "vllmid-policy-override", "src/kvport/vllm/storage.py",
        '    ktc.kv_load_failure_policy = "recompute"\n',
        "",
        (f"{VLLM_IDENTITY}::test_a_shared_tier_sets_vllms_load_failure_policy_to_recompute",),
        "with shared tiers, vLLM's kv_load_failure_policy 'fail' is set to 'recompute'"),
    Mutant(
        "vllmid-policy-override-called", "src/kvport/vllm/connector.py",
        "                recompute_failed_loads(ktc, where)\n",
        "                pass\n",
        (f"{VLLM_IDENTITY}::test_a_shared_tier_sets_vllms_load_failure_policy_to_recompute",),
        "the scheduler-side connector applies the policy before vLLM reads it"),
    Mutant(
        "vllmid-recording-carries-policy", "src/kvport/vllm/recording_inner.py",
        "        outer.kv_load_failure_policy = inner_ktc.kv_load_failure_policy\n",
        "        pass\n",
        (f"{VLLM_IDENTITY}::test_the_recording_connector_carries_the_policy_to_vllm",),
        "a recorded connector's policy reaches the outer config vLLM's scheduler reads"),
    Mutant(
        "vllmid-disk-bytes-per-rank", "src/kvport/connectors/offloading/config.py",
        "        tiers = tuple(dataclasses.replace(t, max_bytes=max(1, t.max_bytes // tp_size))\n",
        "        tiers = tuple(dataclasses.replace(t, max_bytes=t.max_bytes)\n",
        (f"{VLLM_IDENTITY}::test_each_tensor_parallel_rank_gets_its_share_of_the_budgets",),
        "the disk's max_bytes is the engine's: each tensor-parallel rank gets its share"),
    # ---- events and per-request limits inside vLLM ---------------------------------------------
    Mutant(
        "vllm-event-hashes-as-vllm-sends-them", "src/kvport/vllm/events.py",
        "        hashes = [maybe_convert_block_hash(h) for h in e.block_hashes]\n",
        "        hashes = list(e.block_hashes)\n",
        ("tests/vllm/test_vllm_events.py::test_stored_blocks_carry_what_vllm_s_own_events_give_them",),
        "kvport's events carry vLLM's hashes as vLLM's own events do (an int by default)"),
    Mutant(
        "vllm-events-only-when-read", "src/kvport/vllm/storage.py",
        "                        kv_events=bool(events is not None and events.enable_kv_cache_events))",
        "                        kv_events=False)",
        ("tests/vllm/test_vllm_events.py::test_the_events_say_exactly_what_every_tier_holds",),
        "with vLLM's KV events on, kvport describes its blocks (off, it builds nothing)"),
    Mutant(
        "vllm-bad-transfer-params-refused", "src/kvport/vllm/params.py",
        "        TransferLimits.parse(extra.get(\"kv_transfer_params\"))\n",
        "        pass\n",
        ("tests/vllm/test_vllm_params.py::test_a_bad_value_fails_its_request_alone",),
        "a bad kv_transfer_params value is refused at admission, for that request alone"),
    # ---- a GPU is refused at once (vllm/compat.py, vllm/connector.py) ---------------------------
    Mutant(
        "gpu-refused-before-the-host-tier", "src/kvport/vllm/connector.py",
        "        refuse_device(str(getattr(vllm_config.device_config, \"device_type\", None) or "
        "\"cpu\"), where)\n",
        "        pass\n",
        ("tests/vllm/test_vllm_devices.py::test_a_gpu_worker_refuses_before_its_host_tier_exists",),
        "a worker on a GPU refuses before its host tier allocates its buffer"),
    Mutant(
        "gpu-pool-refused-when-registered", "src/kvport/vllm/connector.py",
        "            refuse_device(device, f\"kvport.vllm {self.kvport_name}\")\n",
        "            pass\n",
        ("tests/vllm/test_vllm_devices.py::"
         "test_a_kv_pool_on_another_device_is_refused_when_registered",),
        "a KV pool on another device is refused when vLLM registers it"),
    Mutant(
        "c3-check-loads-must-be-a-bool", "src/kvport/vllm/recording_config.py",
        "    if not isinstance(check, bool):\n",
        "    if False:\n",
        ("tests/vllm/test_vllm_recording_config.py::"
         "test_a_check_loads_that_is_not_a_bool_is_refused_naming_it",),
        "the recorder's check_loads key is a bool, a bad value named"),
    # ---- the recorder's half of rule C3 (vllm/recording_kv.py) ---------------------------------
    Mutant(
        "c3-load-starts-after-the-local-hit", "src/kvport/vllm/recording_kv.py",
        "        first = -(-local // bs)\n",
        "        first = 0\n",
        ("tests/vllm/test_vllm_recording_kv.py::test_a_load_covers_the_full_blocks_after_the_local_hit_and_keeps_its_kind",),
        "a load covers the blocks after the local hit, not the local ones"),
    Mutant(
        "c3-negative-computed-count", "src/kvport/vllm/recording_kv.py",
        "            start = max(before, 0) // bs\n",
        "            start = before // bs\n",
        ("tests/vllm/test_vllm_recording_kv.py::"
         "test_a_negative_computed_count_hands_over_nothing_before_block_zero",),
        "a negative computed count (after a connector's negative match) plans nothing"),
    Mutant(
        "c3-async-load-measured-when-done", "src/kvport/vllm/recording_kv.py",
        "                if load.is_async:\n",
        "                if False:\n",
        ("tests/vllm/test_vllm_recording_kv.py::test_an_async_load_is_measured_when_its_request_is_reported_finished",),
        "an async load is measured when get_finished reports it, not when it starts"),
    Mutant(
        "c3-failed-load-not-judged", "src/kvport/vllm/recording_kv.py",
        "            judged = [None if b in failed else d for b, d in zip(load.block_ids, "
        "distances)]\n",
        "            judged = list(distances)\n",
        ("tests/vllm/test_vllm_recording_kv.py::test_failed_and_never_computed_blocks_have_no_distance",),
        "a block whose load failed is recomputed by vLLM: not judged"),
    Mutant(
        "c3-first-fingerprint-wins", "src/kvport/vllm/recording_kv.py",
        "                if key not in self._seen:\n",
        "                if True:\n",
        ("tests/vllm/test_vllm_recording_kv.py::test_the_first_fingerprint_of_a_hash_wins",),
        "a hash keeps the fingerprint of its first compute"),
    Mutant(
        "c3-resumed-table-replaced", "src/kvport/vllm/recording_kv.py",
        "                self._tables[rid] = []  # a resumed request's ids are given whole\n",
        "                pass\n",
        ("tests/vllm/test_vllm_recording_kv.py::test_a_resumed_request_is_given_its_block_ids_whole",),
        "a resumed request's block ids replace the old ones"),
    Mutant(
        "c3-checks-never-stop-the-engine", "src/kvport/vllm/recording_kv.py",
        "        except Exception:  # noqa: BLE001  # a checker's failure is never the engine's\n",
        "        except ZeroDivisionError:\n",
        ("tests/vllm/test_vllm_recording_kv.py::test_a_failure_inside_the_checks_turns_them_off_without_raising",),
        "a failure inside the load checks turns them off, never the engine"),
    Mutant(
        "c3-recorder-fingerprints", "src/kvport/vllm/recording.py",
        "        self._loads.finished(self._connector_metadata, out.finished_recving)\n",
        "        pass\n",
        ("tests/vllm/test_vllm_loads.py::"
         "test_a_store_that_reads_blocks_after_they_were_given_to_another_request_is_c3",),
        "the recorder measures what loads bring back inside vLLM (0.32 calls "
        "get_transfer_results)"),
    # ---- pages and layout (vllm/pages.py, vllm/storage.py) ----------------------------------
    Mutant(
        "vllm-page-plain-product", "src/kvport/vllm/pages.py",
        "        if spec.page_size_bytes != plain:\n",
        "        if False:\n",
        (f"{VLLM_PAGES}::test_a_page_that_is_not_the_plain_product_is_refused",),
        "a page that is not num_kv_heads x block_size x (head_size + head_size_v) is refused"),
    Mutant(
        "vllm-page-quantized-scales", "src/kvport/vllm/pages.py",
        "    if quant not in PLAIN_QUANT_MODES:\n",
        "    if False:\n",
        (f"{VLLM_PAGES}::test_other_pages_are_refused_naming_the_spec_and_what_is_handled",),
        "KV quantized with scales a page copy does not carry (per token-head) is refused"),
    Mutant(
        "vllm-page-odd-per-token", "src/kvport/vllm/pages.py",
        "    if per_token % 2:  # kvport's pool describes a page as K and V halves\n",
        "    if False:\n",
        (f"{VLLM_PAGES}::test_other_pages_are_refused_naming_the_spec_and_what_is_handled",),
        "a page kvport cannot halve into K and V is refused"),
    Mutant(
        "vllm-groups-one-page", "src/kvport/vllm/storage.py",
        "    if len(pages) != 1:\n",
        "    if False:\n",
        (f"{VLLM_PAGES}::test_groups_of_different_pages_are_refused",),
        "KV cache groups of different page geometries are refused"),
    Mutant(
        "vllm-layout-unresolved", "src/kvport/vllm/pages.py",
        "        if layout:\n",
        "        if True:\n",
        (f"{VLLM_PAGES}::test_the_resolved_layout_is_read_from_vllms_configs",),
        "a connector built before vLLM resolved the layout is refused"),
    Mutant(
        "vllm-layout-in-namespace", "src/kvport/vllm/storage.py",
        "    layout = (f\"{LAYOUT_PREFIX}{resolved_layout(vllm_config, kv_cache_config, where)}\"\n",
        "    layout = (f\"{LAYOUT_PREFIX}pages\"\n",
        (f"{VLLM_PAGES}::test_the_disk_namespace_names_the_resolved_layout",),
        "the disk namespace names the layout vLLM resolved"),
]
