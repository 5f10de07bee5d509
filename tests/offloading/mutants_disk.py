"""Mutants of the disk tier (connectors/offloading/tiers/disk/, tiers/parts.py): each removes one
guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

DISK_FULL = "tests/offloading/test_disk_full.py"
DISK_HOSTILE = "tests/offloading/test_disk_hostile.py"
DISK_RUNS = "tests/offloading/test_disk_runs.py"
DISK_SHARED = "tests/offloading/test_disk_shared.py"
DISK_TIER = "tests/offloading/test_disk_tier.py"
PARTS = "tests/offloading/test_parts.py"


MUTANTS: list[Mutant] = [
    # ---- disk tier -----------------------------------------------------------------------------
    Mutant(
        "disk-decides-before-evicting", "src/kvport/connectors/offloading/tiers/disk/index.py",
        """            if freed < need:
                return None
            names: list[bytes] = []
            for run_id in victims:
                run = self._runs.pop(run_id)
                self._used -= run.size
                for key in run.keys:
                    del self._key_run[key]
                names += run.keys
""",
        """            names: list[bytes] = []
            for run_id in victims:
                run = self._runs.pop(run_id)
                self._used -= run.size
                for key in run.keys:
                    del self._key_run[key]
                names += run.keys
            if freed < need:
                return None
""",
        (f"{DISK_TIER}::test_size_limit_evicts_least_recently_used",),
        "a disk store that cannot fit is skipped without evicting anything"),
    Mutant(
        "disk-store-keeps-its-own-runs", "src/kvport/connectors/offloading/tiers/disk/index.py",
        "                if run_id not in keep:\n",
        "                if True:\n",
        (f"{DISK_RUNS}::test_a_store_never_evicts_the_runs_of_its_own_held_keys",),
        "a disk store never evicts a run holding keys the same store counts as held"),
    Mutant(
        "disk-forgets-a-name-found-gone", "src/kvport/connectors/offloading/tiers/disk/index.py",
        """            if held:
                self._runs.move_to_end(run_id)
            else:
                self._remove_key(key)
""",
        """            if held:
                self._runs.move_to_end(run_id)
""",
        (f"{DISK_RUNS}::test_a_name_found_gone_frees_its_room_before_the_store_makes_room",),
        "a key whose name another process removed no longer holds room or a run in the index"),
    Mutant(
        "disk-run-files-reopened-when-changed",
        "src/kvport/connectors/offloading/tiers/disk/files.py",
        "            if changed_since_open(cached.run):\n",
        "            if False:\n",
        (f"{DISK_RUNS}::test_runs_stay_open_between_jobs_and_close_when_evicted",
         f"{DISK_RUNS}::test_an_entry_is_hashed_once_until_its_file_changes"),
        "a kept run file another process changed (written, names removed) is reopened and its "
        "entries checked again; one whose every name is gone is closed, not read"),
    Mutant(
        "disk-changed-run-unchecked", "src/kvport/connectors/offloading/tiers/disk/files.py",
        "                cached.run.checked[:] = bytes(len(cached.run.checked))\n",
        "",
        (f"{DISK_RUNS}::test_a_changed_run_another_job_still_reads_is_handed_out_unchecked",),
        "a run found changed is handed to the next job (two disk threads) with nothing checked"),
    Mutant(
        "disk-hashes-what-changed-while-read",
        "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if unhashed and changed_since_open(run):\n",
        "    if False:\n",
        (f"{DISK_RUNS}::test_a_run_written_while_a_job_reads_it_is_hashed_after_all",),
        "entries read unhashed from a run file another writer changed during the job are hashed"),
    Mutant(
        "disk-reads-in-one-call-only-what-is-cached",
        "src/kvport/connectors/offloading/tiers/disk/read.py",
        "            or not holds_whole(run.fd, run.header.offset(first), "
        "len(entries) * payload)):\n",
        "            ):\n",
        (f"{DISK_RUNS}::test_checked_entries_the_cache_holds_are_read_in_one_call",),
        "a cold extent is read in pieces the kernel's readahead streams, not in one call"),
    Mutant(
        "disk-reads-in-one-call-only-what-was-checked",
        "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if (not all(position == first + i and run.checked[position]\n",
        "    if (not all(position == first + i\n",
        (f"{DISK_RUNS}::test_a_job_across_runs_loads_exactly_and_bad_entries_fail_alone",
         f"{DISK_TIER}::test_corrupt_entry_is_a_miss_and_removed"),
        "an entry never checked is hashed, however fast the cache could hand it out"),
    Mutant(
        "disk-reads-in-one-call-only-an-extent",
        "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if (not all(position == first + i and run.checked[position]\n",
        "    if (not all(run.checked[position]\n",
        (f"{DISK_RUNS}::test_checked_entries_the_cache_holds_are_read_in_one_call",),
        "one call fills the slots of consecutive positions only (no gap, no key asked twice)"),
    Mutant(
        "disk-asks-for-names-the-index-lacks",
        "src/kvport/connectors/offloading/tiers/disk/load.py",
        "                    linked = run.links == self.index.num_keys(run_id)\n",
        "                    linked = True\n",
        (f"{DISK_RUNS}::test_a_name_removed_before_its_run_was_opened_is_a_miss",),
        "a key whose name is gone is a miss even while its run is open through another name"),
    Mutant(
        "disk-reads-ahead-only-holes", "src/kvport/connectors/offloading/tiers/disk/page_cache.py",
        "    return prefix is None or prefix[0] != held[0]\n",
        "    return True\n",
        (f"{DISK_RUNS}::test_a_span_cached_with_holes_is_read_ahead_at_once",),
        "a span cached as a prefix (a sequential read's readahead) is not asked for again"),
    Mutant(
        "disk-reads-ahead-holes", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "        _read_ahead_holes(run, entries)\n",
        "",
        (f"{DISK_RUNS}::test_a_span_cached_with_holes_is_read_ahead_at_once",),
        "a span cached with holes is asked for at once, not one miss at a time"),
    Mutant(
        "disk-reads-ahead-only-its-span", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if size <= 2 * len(entries) * payload and has_holes(run.fd, start, size):\n",
        "    if has_holes(run.fd, start, size):\n",
        (f"{DISK_RUNS}::test_a_span_cached_with_holes_is_read_ahead_at_once",),
        "a job with gaps does not read ahead the entries between its own"),
    Mutant(
        "parts-all-end-before-the-call-does", "src/kvport/connectors/offloading/tiers/parts.py",
        "        wait([f for f in futures if not f.cancel()])\n",
        "        pass\n",
        (f"{PARTS}::test_every_part_has_ended_when_the_callers_part_raises",),
        "a part on a helper never writes after the call ended (a failed copy's blocks are "
        "recomputed into)"),
    Mutant(
        "parts-late-helper-not-waited-for", "src/kvport/connectors/offloading/tiers/parts.py",
        "        wait([f for f in futures if not f.cancel()])\n",
        "        wait(futures)\n",
        (f"{PARTS}::test_a_helper_that_has_not_started_is_not_waited_for",),
        "a helper task still queued when the ranges ran out is dropped, not waited for"),
    Mutant(
        "parts-no-range-after-a-failure", "src/kvport/connectors/offloading/tiers/parts.py",
        "        while not failed and (r := next(taken)) < num_ranges:\n",
        "        while (r := next(taken)) < num_ranges:\n",
        (f"{PARTS}::test_a_helpers_exception_is_raised_and_no_range_starts_after_it",),
        "once a range raised, no thread starts another (the call fails anyway)"),
    Mutant(
        "disk-split-read-failures-count", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    return all(run_in_parts(len(entries), k, lambda lo, hi: _read_exactly(\n",
        "    return any(run_in_parts(len(entries), k, lambda lo, hi: _read_exactly(\n",
        (f"{DISK_RUNS}::test_a_range_that_fails_to_read_makes_the_job_read_again",),
        "a range of a split read that failed makes the job read again, not a slot left "
        "unfilled"),
    Mutant(
        "disk-split-parts-of-at-least-half-the-split",
        "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    return max(1, min(num_helpers + 1, num_entries, size // (SPLIT_BYTES // 2)))\n",
        "    return max(1, min(num_helpers + 1, num_entries))\n",
        (f"{DISK_RUNS}::"
         "test_a_split_read_has_one_part_per_thread_of_at_least_half_the_split_size",),
        "many cores do not cut a cached read into parts smaller than half the split size"),
    Mutant(
        "disk-split-parts-at-their-offsets", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "        run.fd, views[lo:hi], offset + lo * payload, payload), helpers))\n",
        "        run.fd, views[lo:hi], offset, payload), helpers))\n",
        (f"{DISK_RUNS}::test_a_large_cached_extent_is_read_by_several_threads",),
        "each part of a split read fills its slots from its own entries"),
    # ---- disk tier: jobs run together ----------------------------------------------------------
    Mutant(
        "disk-batch-outcomes-per-job", "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "            first += len(src.keys)\n",
        "",
        (f"{DISK_RUNS}::test_a_batch_of_jobs_is_read_as_one_and_each_job_fails_alone",),
        "each job of a batch gets the outcome of its own entries"),
    # ---- disk tier: hostile directories and failing disks --------------------------------------
    Mutant(
        "diskchaos-other-format-is-the-runs-verdict",
        "src/kvport/connectors/offloading/tiers/disk/load.py",
        "            header = bad.get(run_id) or read_run_header(",
        "            header = (Verdict.BAD if run_id in bad else None) or read_run_header(",
        (f"{DISK_HOSTILE}::"
         "test_a_run_of_another_format_version_is_a_miss_for_every_key_and_left_alone",),
        "every key of another version's run is a miss left alone, not 'bad' from the second on"),
    Mutant(
        "diskchaos-other-format-is-a-miss", "src/kvport/connectors/offloading/tiers/disk/runs.py",
        "    if version != RUN_VERSION:\n        return Verdict.OTHER_FORMAT\n",
        "",
        (f"{DISK_HOSTILE}::"
         "test_a_run_of_another_format_version_is_a_miss_for_every_key_and_left_alone",),
        "a run file of another format version is a miss and left alone, not deleted (D12)"),
    Mutant(
        "diskchaos-header-within-the-file", "src/kvport/connectors/offloading/tiers/disk/runs.py",
        "            or h > file_size):\n",
        "            ):\n",
        (f"{DISK_HOSTILE}::test_huge_counts_are_bad_without_reading_them",),
        "a damaged count never makes the header parser read or allocate past the file"),
    Mutant(
        "diskchaos-evicts-until-the-ledger-fits",
        "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "            self.stats.add(evictions=len(eviction.keys))\n",
        "            self.stats.add(evictions=len(eviction.keys))\n            break\n",
        (f"{DISK_SHARED}::test_eviction_goes_on_until_the_shared_ledger_says_the_run_fits",),
        "eviction stops when the shared ledger, not this process's index, says the run fits"),
    Mutant(
        "diskchaos-lost-ledger-write-undoes-the-reserve",
        "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "        if entry.lost is not None:",
        "        if False:",
        (f"{DISK_FULL}::test_data_pages_full_from_the_first_store_skips_stores_and_they_resume",),
        "a reserve the ledger could not count is not written"),
    Mutant(
        "diskchaos-ledger-write-failure-is-not-raised",
        "src/kvport/connectors/offloading/tiers/disk/ledger.py",
        "                    except OSError as exc:\n                        entry.lost = exc\n",
        "                    except OSError as exc:\n                        raise\n",
        (f"{DISK_FULL}::test_data_pages_full_from_the_first_store_skips_stores_and_they_resume",),
        "a full file system makes a skipped store, never an OSError out of it"),
    Mutant(
        "diskchaos-ledger-gets-its-bytes-at-open",
        "src/kvport/connectors/offloading/tiers/disk/ledger.py",
        "                if os.fstat(fd).st_size < _USED.size:\n",
        "                if False:\n",
        (f"{DISK_HOSTILE}::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "the ledger's bytes are allocated at open, so a later full disk cannot fail its writes"),
    Mutant(
        "diskchaos-full-disk-at-start-is-no-refusal",
        "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "        if exc.errno in FULL_DISK:\n",
        "        if False:\n",
        (f"{DISK_FULL}::test_a_restart_on_a_full_file_system_serves_and_stores_resume",),
        "an engine restarted on a full disk starts and serves what the disk holds"),
    Mutant(
        "diskchaos-loads-close-runs-others-evicted",
        "src/kvport/connectors/offloading/tiers/disk/load.py",
        "        self.files.close_unlinked(SWEEP_EVERY_S)\n",
        "",
        (f"{DISK_SHARED}::test_runs_another_process_evicted_are_closed_by_loads_too",),
        "a process that only loads does not pin the space of runs others evicted"),
    Mutant(
        "diskchaos-unlinked-sweep-rate-limited",
        "src/kvport/connectors/offloading/tiers/disk/files.py",
        "            if now - self._swept < every_s:\n",
        "            if False:\n",
        (f"{DISK_SHARED}::test_a_sweep_of_unlinked_runs_is_not_repeated_within_its_interval",),
        "loads sweep the open runs at most every SWEEP_EVERY_S (a sweep costs ~0.1 ms)"),
    Mutant(
        "diskchaos-entry-checksum-checked", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "        elif checksum(views[j]) != entries[k][2]:\n",
        "        elif False:\n",
        ("tests/offloading/test_disk_chaos.py::"
         "test_power_loss_of_named_files_data_is_misses_never_wrong_bytes",
         f"{DISK_TIER}::test_corrupt_entry_is_a_miss_and_removed"),
        "M3: a torn, zeroed or rotten entry is a miss, never wrong bytes (there is no fsync)"),
    Mutant(
        "diskchaos-symlink-never-followed", "src/kvport/connectors/offloading/tiers/disk/load.py",
        "_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK",
        "_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK",
        (f"{DISK_HOSTILE}::test_a_symlink_at_a_name_is_never_followed_and_is_removed",),
        "a symlink planted at a key's name is never read through (D9)"),
    Mutant(
        "diskchaos-only-regular-files-are-runs",
        "src/kvport/connectors/offloading/tiers/disk/load.py",
        "            if not stat.S_ISREG(st.st_mode):\n                os.close(fd)\n",
        "            if False:\n                os.close(fd)\n",
        (f"{DISK_HOSTILE}::test_a_fifo_at_a_name_neither_hangs_a_load_nor_a_store",),
        "a FIFO (or other non-file) at a key's name is a miss and removed (D9)"),
    Mutant(
        "diskchaos-store-removes-a-non-file-name",
        "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "            if not held:\n                self.ledger.remove_names([path])\n",
        "            if False:\n                self.ledger.remove_names([path])\n",
        (f"{DISK_HOSTILE}::test_a_symlink_at_a_name_is_never_followed_and_is_removed",),
        "a store replaces a symlink or FIFO at its key's name with its own entry"),
    Mutant(
        "diskchaos-scan-indexes-regular-files-only",
        "src/kvport/connectors/offloading/tiers/disk/location.py",
        "            if not stat.S_ISREG(st.st_mode):\n                return",
        "            if False:\n                return",
        (f"{DISK_HOSTILE}::test_a_symlink_at_a_name_is_never_followed_and_is_removed",),
        "the start's scan never indexes a symlink or FIFO as an entry"),
    Mutant(
        "diskchaos-another-users-directory-refused",
        "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "    if not group_access:\n",
        "    if False:\n",
        (f"{DISK_HOSTILE}::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "a namespace directory of another user is refused (its entries could be planted)"),
    Mutant(
        "diskchaos-wide-directory-narrowed", "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "        if mode & ~location.dir_mode:\n",
        "        if False:\n",
        (f"{DISK_HOSTILE}::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "our namespace directory with too wide a mode is narrowed to 0o700"),
    Mutant(
        "diskchaos-world-writable-directory-refused",
        "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "    if mode & stat.S_IWOTH:\n",
        "    if False:\n",
        (f"{DISK_HOSTILE}::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "even with group_access, a directory every user may write is refused"),
    Mutant(
        "diskchaos-dead-writers-temps-swept",
        "src/kvport/connectors/offloading/tiers/disk/location.py",
        "                if now - st.st_mtime > stale_temp_seconds or self._writer_dead(entry.name):",
        "                if now - st.st_mtime > stale_temp_seconds:",
        ("tests/offloading/test_disk_chaos.py::"
         "test_kill_9_at_each_point_leaves_exact_entries_and_no_temp_file",),
        "a killed writer's temp file is removed (and uncounted) by the next process to start"),
    Mutant(
        "diskchaos-symlinked-key-directory-removed",
        "src/kvport/connectors/offloading/tiers/disk/location.py",
        "            if entry.is_symlink():\n",
        "            if False:\n",
        (f"{DISK_HOSTILE}::test_a_symlink_in_place_of_a_key_directory_is_removed_at_start",),
        "no load or store goes through a symlink planted in place of a key directory"),
    Mutant(
        "diskchaos-ledger-must-be-a-file", "src/kvport/connectors/offloading/tiers/disk/ledger.py",
        "            if not stat.S_ISREG(os.fstat(fd).st_mode):",
        "            if False:",
        (f"{DISK_HOSTILE}::test_a_fifo_or_symlink_at_the_ledger_is_refused_at_start",),
        "a FIFO planted at the ledger is refused at start with a clear error"),
]
