"""Mutants of the benchmarks' verdicts (bench/): each removes one check, and the tests named with
it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

SOAK_BENCH = "tests/bench/test_soak_bench.py"
TRANSFER_STRATEGIES = "tests/bench/test_transfer_strategies.py"
WORKLOAD_PASSES = "tests/bench/test_workload_passes.py"


MUTANTS: list[Mutant] = [
    # ---- passes of a workload run pooled (bench/workload/passes.py, serving.py, targets.py) ----
    Mutant(
        "passes-phases-numbered-on", "src/kvport/bench/workload/passes.py",
        "            records=tuple(dataclasses.replace(r, phase=k * num_phases + r.phase)\n",
        "            records=tuple(r\n",
        (f"{WORKLOAD_PASSES}::test_passes_pool_into_one_outcome_with_phases_numbered_on",),
        "pooled passes keep a phase per round of one pass: the later requests' wall time counts"),
    Mutant(
        "passes-counters-added", "src/kvport/bench/workload/serving.py",
        "    return _combine(first, second, lambda a, b: a + b, \"\", union=True)\n",
        "    return _combine(first, second, lambda a, b: b, \"\", union=True)\n",
        (f"{WORKLOAD_PASSES}::test_metrics_sum_adds_counters_of_either_side",),
        "the pooled bytes and hits of several passes are their sum, not the last pass's"),
    Mutant(
        "passes-judged-on-the-median", "src/kvport/bench/workload/targets.py",
        "        median = statistics.median(known) if known else None\n",
        "        median = t.ratio\n",
        (f"{WORKLOAD_PASSES}::test_targets_are_judged_on_the_median_of_the_passes",),
        "a run of passes is judged on its passes' median ratio, not on the pooled requests"),
    # ---- the soak's verdict (bench/soak/) ------------------------------------------------------
    Mutant(
        "soak-mismatch-is-a-violation", "src/kvport/bench/soak/result.py",
        "    if reference.mismatches:\n",
        "    if False:\n",
        (f"{SOAK_BENCH}::test_an_answer_that_differs_from_the_reference_fails_the_run",),
        "an answer unlike the no-connector reference fails the soak"),
    Mutant(
        "soak-reference-compares", "src/kvport/bench/soak/reference.py",
        "        if got != expected:\n",
        "        if False:\n",
        (f"{SOAK_BENCH}::"
         "test_the_reference_finds_an_answer_that_differs_and_counts_failed_requests",),
        "the reference check compares every answer, token by token"),
    Mutant(
        "soak-disk-bounded", "src/kvport/bench/soak/result.py",
        "    bound(\"disk bytes\", peak[\"disk_bytes\"], "
        "disk_max_bytes + bounds.disk_slack_bytes)\n",
        "",
        (f"{SOAK_BENCH}::test_disk_use_above_max_bytes_plus_slack_fails_the_run",),
        "disk use above max_bytes (plus slack) fails the soak"),
    Mutant(
        "soak-temp-files-left", "src/kvport/bench/soak/result.py",
        "    if final_disk.temp_files:\n",
        "    if False:\n",
        (f"{SOAK_BENCH}::test_temp_files_after_the_last_stop_fail_the_run",),
        "a temp file left after the last clean stop fails the soak"),
    Mutant(
        "soak-restart-hits-disk", "src/kvport/bench/soak/result.py",
        "    if kills and not restarted_disk_hits:\n",
        "    if False:\n",
        (f"{SOAK_BENCH}::test_a_restart_without_disk_hits_or_a_run_without_kills_fails",),
        "a restarted process that never hits the disk fails the soak (the cache must survive)"),
    Mutant(
        "soak-min-kills", "src/kvport/bench/soak/result.py",
        "    if kills < bounds.min_kills:\n",
        "    if False:\n",
        (f"{SOAK_BENCH}::test_a_restart_without_disk_hits_or_a_run_without_kills_fails",),
        "a soak without its kills proves nothing: it fails"),
    Mutant(
        "soak-crash-is-a-violation", "src/kvport/bench/soak/result.py",
        "        if i.end not in (\"killed\", \"stopped\"):\n",
        "        if False:\n",
        (f"{SOAK_BENCH}::test_a_process_that_crashed_fails_the_run",),
        "a workload process that died unasked fails the soak"),
    Mutant(
        "soak-fd-growth-bounded", "src/kvport/bench/soak/result.py",
        "    bound(\"fd growth\", growth[\"fds\"], bounds.max_fd_growth)\n",
        "",
        (f"{SOAK_BENCH}::test_descriptor_growth_beyond_its_bound_fails_the_run",),
        "--max-fd-growth is checked"),
    Mutant(
        "soak-exit-code", "src/kvport/bench/soak/cli.py",
        "        return 0 if result.ok else 1\n",
        "        return 0\n",
        (f"{SOAK_BENCH}::test_the_command_exits_1_when_a_bound_breaks",),
        "a broken bound makes the command exit 1"),
    Mutant(
        "soak-disk-inode-once", "src/kvport/bench/soak/probe.py",
        "            seen[(st.st_dev, st.st_ino)] = (st.st_size, st.st_blocks * 512)\n",
        "            seen[(st.st_dev, hash(name))] = (st.st_size, st.st_blocks * 512)\n",
        (f"{SOAK_BENCH}::test_disk_usage_counts_a_run_once_for_all_its_names_and_sees_temp_files",),
        "a run's bytes count once, not once per key's hard link"),
    # ---- the transfer bench's copy strategies (bench/transfer/strategies.py) -----------------
    Mutant(
        "host-strategies-check-ids", "src/kvport/bench/transfer/strategies.py",
        "    check_rows(src_rows, src.shape[0], dst_rows, dst.shape[0])\n"
        "    if strategy == \"runs\":",
        "    if strategy == \"runs\":",
        (f"{TRANSFER_STRATEGIES}::test_copy_rows_refuses_a_destination_row_out_of_range",),
        "the bench's torch strategies check ids before copying any piece"),
    # ---- connector-overhead: comparisons only vLLM has ---------------------------------------
    Mutant(
        "overhead-vllm-only-flags", "src/kvport/bench/overhead/cli.py",
        "        if args.engine == \"kvport\" and (args.events or args.recorder or args.recording):\n",
        "        if False:\n",
        ("tests/vllm/test_vllm_trace.py::"
         "test_the_vllm_only_overhead_comparisons_refuse_kvports_engine",),
        "--events and --recorder with kvport's engine are refused, not silently ignored"),
]
