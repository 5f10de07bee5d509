"""Mutants of the host and Redis tiers and the value format (connectors/offloading/tiers/host/,
redis/, value_format.py): each removes one guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

HOST_BOUNDS = "tests/offloading/test_host_bounds.py"
REDIS_CLUSTER_CHAOS = "tests/offloading/test_redis_cluster_chaos.py"
REDIS_VALUES = "tests/offloading/test_redis_values.py"


REMOVALS = "tests/offloading/test_redis_removals.py"
POOLS = "tests/offloading/test_engine_pool.py"
TORCH_COPY = "tests/offloading/test_torch_copy.py"
STREAMS = "tests/offloading/test_stream_handler.py"

MUTANTS: list[Mutant] = [
    # ---- the Redis tier ------------------------------------------------------------------------
    Mutant(
        "redis-checksum-checked", "src/kvport/connectors/offloading/tiers/value_format.py",
        "        return Verdict.OK if checksum(payload) == xxh else Verdict.BAD\n",
        "        return Verdict.OK\n",
        ("tests/offloading/test_redis_tier.py::test_corrupt_values_fail_are_counted_and_deleted",),
        "a Redis value whose payload does not match its checksum is never loaded"),
    Mutant(
        "redis-corrupt-deleted", "src/kvport/connectors/offloading/tiers/redis/tier.py",
        """        if delete:
            self._delete(delete)
""",
        "",
        ("tests/offloading/test_redis_tier.py::test_corrupt_values_fail_are_counted_and_deleted",),
        "a corrupt Redis value is deleted (else every lookup finds it and every load fails)"),
    # ---- host tier -----------------------------------------------------------------------------
    Mutant(
        "host-buffer-faulted-in-at-start", "src/kvport/connectors/offloading/tiers/host/tier.py",
        "        self.buffer = torch.zeros((num_slots, slot_bytes), dtype=torch.uint8,\n",
        "        self.buffer = torch.empty((num_slots, slot_bytes), dtype=torch.uint8,\n",
        ("tests/offloading/test_host_tier.py::test_the_buffer_is_resident_from_the_start",),
        "the host tier's pages are faulted in when it is made, not by stores beside the forward"),
    # ---- host tier: byte views and the torch copy path (tiers/host/) ---------------------------
    Mutant(
        "engine-pool-refuses-overlapping-blocks",
        "src/kvport/connectors/offloading/tiers/host/engine_pool.py",
        "    if out.shape[0] > 1 and out.stride(0) < out.shape[1]:\n",
        "    if False:\n",
        (f"{POOLS}::test_bad_pools_are_refused_with_what_is_wrong",),
        "blocks whose bytes overlap are refused: a store would mix two blocks"),
    Mutant(
        "engine-pool-kernel-blocks-a-multiple",
        "src/kvport/connectors/offloading/tiers/host/engine_pool.py",
        "    if num_blocks < 1 or t.shape[0] % num_blocks:\n",
        "    if num_blocks < 1:\n",
        (f"{POOLS}::test_bad_pools_are_refused_with_what_is_wrong",),
        "kernel blocks group into engine blocks only when they divide evenly"),
    Mutant(
        "engine-pool-runs-of-one-element",
        "src/kvport/connectors/offloading/tiers/host/engine_pool.py",
        "        if not any(pages.stride(d) == 1 for d in dims):",
        "        if not dims:",
        (f"{POOLS}::test_bad_pools_are_refused_with_what_is_wrong",),
        "a page with no contiguous run is refused, not cut into one segment per element"),
    Mutant(
        "host-only-copies-refuse-a-device-pool",
        "src/kvport/connectors/offloading/tiers/host/tier.py",
        '        if pool.device.type != "cpu" and self.strategy in HOST_ONLY:\n',
        "        if False:\n",
        (f"{POOLS}::test_bad_pools_are_refused_with_what_is_wrong",),
        "the native and numpy copies never get a pool on a GPU (C would read device pointers)"),
    Mutant(
        "torch-copy-checks-ids", "src/kvport/connectors/offloading/tiers/host/torch_copy.py",
        "        check_pairs(block_ids, self.pool.num_blocks, row_ids, self.host_rows.shape[0])\n",
        "",
        (f"{TORCH_COPY}::test_ids_out_of_range_are_refused_before_anything_is_copied",),
        "the torch path checks ids before enqueueing: a CUDA index kernel would stop the device"),
    Mutant(
        "stream-handler-one-job-per-id", "src/kvport/connectors/offloading/worker/streams.py",
        "        if any(j.job_id == job_id for j in self._pending):\n",
        "        if False:\n",
        (f"{STREAMS}::test_ids_in_flight_and_submits_after_shutdown_are_refused",),
        "a job id in flight is refused: its results would be reported under one id twice"),
    Mutant(
        "config-host-copy-checked", "src/kvport/connectors/offloading/config.py",
        "            if self.host_copy not in HOST_COPIES:\n",
        "            if False:\n",
        ("tests/offloading/test_offloading_config.py::test_bad_configs_name_the_key",),
        "an unknown host_copy is refused naming the accepted ones, not found at the first copy"),
    # ---- host tier: copy bounds (tiers/host/) --------------------------------------------------
    Mutant(
        "row-checks-negative", "src/kvport/connectors/offloading/tiers/host/row_checks.py",
        "min(a) >= 0 and max(a) < num_a",
        "max(a) < num_a",
        (f"{HOST_BOUNDS}::test_copy_segments_refuses_a_negative_block_it_would_wrap",
         f"{HOST_BOUNDS}::test_the_checks_find_the_first_bad_pair_on_either_side"),
        "a negative id is refused, not wrapped to the other end of the pool (D14)"),
    Mutant(
        "row-checks-past-the-end", "src/kvport/connectors/offloading/tiers/host/row_checks.py",
        "min(b) >= 0 and max(b) < num_b",
        "min(b) >= 0",
        (f"{HOST_BOUNDS}::test_copy_rows_refuses_a_destination_row_out_of_range",),
        "an id past the end is refused, not clipped to the last row (D14)"),
    Mutant(
        "host-numpy-checks-ids", "src/kvport/connectors/offloading/tiers/host/tier.py",
        "    check_rows(src_rows, src.shape[0], dst_rows, dst.shape[0])\n    num_bytes",
        "    num_bytes",
        (f"{HOST_BOUNDS}::test_the_numpy_copy_refuses_a_source_row_it_would_clip",),
        "the numpy copy checks ids: take(mode='clip') would copy the wrong block (D14)"),
    Mutant(
        "copy-segments-checks-ids", "src/kvport/connectors/offloading/tiers/host/engine_pool.py",
        "    check_pairs(block_ids, pool.num_blocks, row_ids, rows.shape[0])\n",
        "",
        (f"{HOST_BOUNDS}::test_copy_segments_refuses_a_host_row_out_of_range",
         f"{HOST_BOUNDS}::test_copy_segments_refuses_a_negative_block_it_would_wrap"),
        "a pool of several segments checks ids: slices would copy fewer or other rows"),
    Mutant(
        "block-copy-c-bounds", "src/kvport/connectors/offloading/tiers/host/block_copy.c",
        "        if (host_rows[i] < 0 || host_rows[i] >= num_rows || blocks[i] < 0 ||\n"
        "            blocks[i] >= num_blocks)\n",
        "        if (0)\n",
        (f"{HOST_BOUNDS}::test_the_c_copy_refuses_an_id_past_either_end_of_either_side",),
        "review M4: the C copy checks every id; one out of range writes over other memory"),
    # ---- the Redis tier: clusters, failing nodes, values, config -------------------------------
    Mutant(
        "redis-down-state-skips", "src/kvport/connectors/offloading/tiers/redis/node.py",
        "            if self._probing or time.monotonic() < self._down_until:\n"
        "                return None\n",
        "",
        ("tests/offloading/test_redis_faults.py::"
         "test_a_half_open_connection_costs_one_timeout_then_skips",),
        "M5: while a server is down calls skip at once (one probe per backoff), never a wait each"),
    Mutant(
        "redis-header-namespace-checked", "src/kvport/connectors/offloading/tiers/value_format.py",
        "        if (ns != self.namespace_digest or kd != key_digest(key)",
        "        if (kd != key_digest(key)",
        (f"{REDIS_VALUES}::test_another_namespaces_value_under_this_name_is_a_miss_and_removed",),
        "M2: a value of another namespace under this name is never decoded"),
    Mutant(
        "redis-moved-followed", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "            self._run(moved, commands, results, deadline)\n",
        "",
        (f"{REDIS_CLUSTER_CHAOS}::test_a_moved_slot_is_followed_within_the_call",),
        "D6: a MOVED position goes to the slot's new owner within the same call"),
    Mutant(
        "redis-ask-followed", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "            self._run(asked, commands, results, deadline, asking=True)\n",
        "",
        (f"{REDIS_CLUSTER_CHAOS}::test_an_ask_during_a_slots_migration_is_followed_with_asking",),
        "D6: an ASK position goes once to the importing server behind ASKING"),
    Mutant(
        "redis-down-per-node", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "        node.health.down(f\"{self.url} ({node.name}): {why}\")\n",
        "        for other in (list(self._slots._nodes.values()) if self._slots else [node]):\n"
        "            other.health.down(f\"{self.url} ({node.name}): {why}\")\n",
        (f"{REDIS_CLUSTER_CHAOS}::test_a_dead_master_costs_its_slots_only",),
        "D6: one dead master costs its own slots' hits, not the whole tier's"),
    Mutant(
        "redis-unserved-slot-is-a-miss", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "            if node is None:\n                results[i] = _NO_MAP\n"
        "                unrouted += 1\n            else:\n"
        "                groups.setdefault(node, []).append(i)\n",
        "            groups.setdefault(node, []).append(i)  # type: ignore[arg-type]\n",
        (f"{REDIS_CLUSTER_CHAOS}::test_a_cluster_nobody_answers_is_a_miss_counted_and_down",
         f"{REDIS_CLUSTER_CHAOS}::test_slots_nobody_serves_miss_and_the_served_ones_hit"),
        "D1: a key whose slot nobody serves (or no map at all) is a miss, never an exception"),
    Mutant(
        "redis-load-batches-bounded", "src/kvport/connectors/offloading/tiers/redis/tier.py",
        "        for b in range(0, len(src.keys), per_batch):\n",
        "        per_batch = max(1, len(src.keys))\n"
        "        for b in range(0, len(src.keys), per_batch):\n",
        (f"{REDIS_VALUES}::test_a_load_larger_than_a_batch_goes_out_in_several_pipelines",),
        "D7: a promotion's GETs go out in batches of at most STORE_BATCH_BYTES"),
    Mutant(
        "redis-mac-checked", "src/kvport/connectors/offloading/tiers/value_format.py",
        "            return Verdict.OK if good else Verdict.FORGED\n",
        "            return Verdict.OK\n",
        (f"{REDIS_VALUES}::"
         "test_a_value_without_a_valid_mac_is_a_miss_counted_and_removed[tampered payload]",),
        "D10: with a MAC key, a value without a valid MAC is never decoded"),
    Mutant(
        "redis-wrongtype-removed", "src/kvport/connectors/offloading/tiers/redis/tier.py",
        "                if why in (\"corrupt\", \"forged\", \"wrong_type\"):\n",
        "                if why in (\"corrupt\", \"forged\"):\n",
        (f"{REDIS_VALUES}::test_a_wrongtype_key_is_a_miss_and_removed",),
        "D12: a WRONGTYPE key under a kvport name is removed (else it fails every load)"),
    Mutant(
        "redis-other-format-left-alone", "src/kvport/connectors/offloading/tiers/value_format.py",
        "        if version != FORMAT_VERSION or hsize not in (HEADER.size, HEADER.size + "
        "MAC_BYTES):\n            return Verdict.OTHER_FORMAT\n",
        "        if version != FORMAT_VERSION or hsize not in (HEADER.size, HEADER.size + "
        "MAC_BYTES):\n            return Verdict.BAD\n",
        (f"{REDIS_VALUES}::test_another_format_version_is_a_miss_and_left_alone",),
        "D12: a value of another format version is a miss and left for its readers"),
    Mutant(
        "redis-config-entry-redacted", "src/kvport/connectors/offloading/config.py",
        "                         f\"got {redacted(entry)!r}\")\n",
        "                         f\"got {entry!r}\")\n",
        ("tests/offloading/test_offloading_config.py::test_no_config_error_shows_a_password",),
        "D11: a bad tier entry's error shows its URL without the password"),
    Mutant(
        "redis-config-url-redacted", "src/kvport/connectors/offloading/config.py",
        "            shown = redacted_url(url) if isinstance(url, str) else url\n",
        "            shown = url\n",
        (f"{REDIS_VALUES}::test_no_redis_tier_config_error_shows_a_password",),
        "D11: a bad URL's error shows it without the password"),
    Mutant(
        "redis-tenant-prefix", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "        tenant = config.tenant.encode() + b\":\" if config.tenant else b\"\"\n",
        "        tenant = b\"\"\n",
        (f"{REDIS_VALUES}::test_a_tenants_keys_carry_its_prefix_and_an_acl_scopes_them",),
        "D10: a tenant's keys carry its name first, so an ACL key pattern scopes them"),
    Mutant(
        "redis-tenant-salt-env", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "        salt = _env(config, \"tenant_salt_env\", \"the tenant salt\") or "
        "config.tenant_salt\n",
        "        salt = config.tenant_salt\n",
        (f"{REDIS_VALUES}::test_tenant_salt_env_names_the_salt_and_no_message_shows_it",),
        "D10: the salt read from tenant_salt_env is part of the namespace"),
    Mutant(
        "redis-redirects-counted", "src/kvport/connectors/offloading/metrics.py",
        "    redirects: int = 0  # positions a cluster sent elsewhere",
        "    _no_redirects: int = 0  # positions a cluster sent elsewhere",
        (f"{REDIS_CLUSTER_CHAOS}::test_a_moved_slot_is_followed_within_the_call",),
        "the worker tier counts redirects (without the field a MOVED raised AttributeError)"),
    Mutant(
        "redis-whole-call-deadline", "src/kvport/connectors/offloading/tiers/redis/node.py",
        "        alarm = WATCHDOG.arm(deadline, lambda: _shut_down(conn))  # the blocked read "
        "fails\n",
        "        alarm = WATCHDOG.arm(deadline + 3600.0, lambda: _shut_down(conn))\n",
        ("tests/offloading/test_redis_faults.py::"
         "test_a_trickled_reply_is_cut_at_the_whole_calls_deadline",),
        "a reply trickling in within each socket timeout is still cut at the call's deadline"),
    Mutant(
        "producer-answers-after-write-through", "src/kvport/connectors/offloading/worker/half.py",
        "        if meta is not None and meta.stores and self.config.sync_write_through:\n",
        "        if False:\n",
        ("tests/offloading/test_redis_engine.py::"
         "test_a_producers_answer_comes_after_its_kv_is_in_redis",),
        "a kv_producer's step ends once its stores are in Redis: a decode instance finds them"),
    Mutant(
        "producer-sync-write-through-default", "src/kvport/connectors/offloading/connector.py",
        "self.offloading_config, sync_write_through=config.kv_role == \"kv_producer\")",
        "self.offloading_config, sync_write_through=False)",
        ("tests/offloading/test_redis_engine.py::"
         "test_a_producers_answer_comes_after_its_kv_is_in_redis",),
        "sync_write_through is on by default for kv_producer"),
    Mutant(
        "redis-removals-announced", "src/kvport/connectors/offloading/tiers/redis/notifications.py",
        "        self._sink.add([key])\n",
        "        pass\n",
        (f"{REMOVALS}::test_removals_redis_makes_are_announced_without_a_lookup",),
        "a key Redis evicted, expired or deleted is announced removed without a lookup"),
    Mutant(
        "redis-removals-own-keys-only",
        "src/kvport/connectors/offloading/tiers/redis/notifications.py",
        "        if not isinstance(data, bytes) or not data.startswith(self._prefix):\n",
        "        if not isinstance(data, bytes):\n",
        (f"{REMOVALS}::test_removals_redis_makes_are_announced_without_a_lookup",),
        "another namespace's removal of the same blocks is not this tier's"),
    Mutant(
        "redis-listener-only-when-read", "src/kvport/connectors/offloading/tiers/redis/lookup.py",
        "        if listen and config.keyspace_events:\n",
        "        if config.keyspace_events:\n",
        (f"{REMOVALS}::test_the_listener_starts_only_when_asked_for_and_someone_reads_events",),
        "no subscriber thread in an engine that reads no events"),
]
