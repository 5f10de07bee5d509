"""Mutants of the OffloadingConnector's halves (connectors/offloading/scheduler/, worker/,
manager/): each removes one guard, and the tests named with it must then fail. The tiers' mutants
are in mutants_disk.py and mutants_tiers.py."""

from __future__ import annotations

from tools.mutation import Mutant

ENGINE = "tests/offloading/test_connector_engine.py"
FAULTS = "tests/offloading/test_connector_faults.py"
RACES = "tests/offloading/test_connector_races.py"
STAGES = "tests/offloading/test_store_stages.py"
SYNC = "tests/offloading/test_sync_loads.py"
TRANSFERS = "tests/offloading/test_transfers.py"

# The scheduler half frees the host slots of keys whose promotion failed (two mutants remove it).
FAILED_PROMOTION_FREED = """\
            self.manager.complete_store([k for i, k in enumerate(job.promoted) if i in failed],
                                        success=False)
"""


MUTANTS: list[Mutant] = [
    # ---- OffloadingConnector: no job touches blocks the engine reused --------------------------
    Mutant(
        "fence-wait", "src/kvport/connectors/offloading/worker/half.py",
        "            submitter.router.wait([k for k in submitter.in_flight if k.stage is Stage.COPY\n"
        "                                   and k.job_id in meta.jobs_to_flush])\n",
        "            pass\n",
        (f"{RACES}::test_a_preempted_requests_blocks_wait_for_its_stores_in_flight",),
        "handle_preemptions waits for jobs_to_flush before the forward overwrites their blocks"),
    Mutant(
        "sync-stores-report-in-their-step", "src/kvport/connectors/offloading/worker/half.py",
        "                submitter.router.wait([TransferKey(job.job_id) for job in meta.stores])\n",
        "                pass\n",
        (f"{STAGES}::test_sync_stores_report_in_the_step_that_computed_them",),
        "with sync_stores a step's stores report in that step (vLLM may stop stepping)"),
    Mutant(
        "finished-request-held", "src/kvport/connectors/offloading/scheduler/half.py",
        "        if jobs and not self.sync_stores:\n",
        "        if False:\n",
        (f"{RACES}::test_a_finished_requests_blocks_are_held_while_its_stores_read_them",
         "tests/offloading/test_scheduler_hold.py::"
         "test_a_finished_request_is_held_until_its_stores_copied"),
        "a finished request's blocks are held while its stores still read them"),
    Mutant(
        "held-until-copies-end", "src/kvport/connectors/offloading/worker/half.py",
        "        touching = stores.copies.keys() | loads.sync_in_flight()\n",
        "        touching: set[int] = set()\n",
        (f"{RACES}::test_a_finished_requests_blocks_are_held_while_its_stores_read_them",),
        "a held request is reported in finished_sending only once its jobs' copies ended"),
    Mutant(
        "preempted-jobs-flushed", "src/kvport/connectors/offloading/scheduler/half.py",
        "                meta.jobs_to_flush |= st.engine_jobs()\n",
        "                pass\n",
        (f"{RACES}::test_a_preempted_requests_blocks_wait_for_its_stores_in_flight",
         "tests/offloading/test_scheduler_hold.py::test_a_preempted_requests_stores_are_flushed"),
        "a preempted request's stores are flushed before its freed blocks are written"),
    # ---- OffloadingConnector: hits and loads ---------------------------------------------------
    Mutant(
        "readmission-waits-for-own-stores", "src/kvport/connectors/offloading/scheduler/half.py",
        "        if st is not None and st.store_jobs:\n",
        "        if False:\n",
        (f"{RACES}::test_a_readmitted_request_waits_for_its_own_stores_then_loads_them",),
        "a request re-admitted while its own stores are unreported asks again, then loads them"),
    Mutant(
        "keys-being-written-end-the-run", "src/kvport/connectors/offloading/scheduler/hits.py",
        "            match.lower = self.lower.find_run(candidates, stop=self.manager.contains)\n",
        "            match.lower = self.lower.find_run(candidates, stop=lambda key: False)\n",
        (f"{RACES}::test_a_promotion_later_than_inflight_wait_s_is_computed[0.0]",),
        "a key being written to the host tier (another request's promotion) ends the hit run"),
    Mutant(
        "inflight-wait-taken", "src/kvport/connectors/offloading/scheduler/hits.py",
        "        if self._being_written(keys, end, request.num_tokens)"
        " and self.waits.should_wait(rid):\n",
        "        if False:\n",
        (f"{RACES}::test_a_hit_on_keys_being_promoted_waits_for_the_promotion_then_loads",),
        "a hit run that ends at keys another job is writing waits for that write"),
    Mutant(
        "inflight-wait-bounded", "src/kvport/connectors/offloading/scheduler/inflight.py",
        "        if now < deadline:\n",
        "        if True:\n",
        (f"{RACES}::test_a_promotion_later_than_inflight_wait_s_is_computed[0.5]",),
        "the wait for another job's write ends at inflight_wait_s"),
    Mutant(
        "inflight-wait-forgotten-at-admission",
        "src/kvport/connectors/offloading/scheduler/half.py",
        "        rid = request.request_id\n        self.waits.forget(rid)\n        old = ",
        "        rid = request.request_id\n        old = ",
        (f"{RACES}::test_a_hit_on_keys_being_promoted_waits_for_the_promotion_then_loads",),
        "an admitted request's wait is dropped: a later one starts with a full bound"),
    Mutant(
        "inflight-wait-forgotten-at-finish", "src/kvport/connectors/offloading/scheduler/half.py",
        "        self.hits.forget(rid)\n"
        "        self.waits.forget(rid)\n",
        "        self.hits.forget(rid)\n",
        (f"{RACES}::test_a_request_aborted_while_it_waits_leaves_nothing",),
        "a request finished (aborted) while it waits leaves no wait behind"),
    Mutant(
        "failed-promotion-ends-waits", "src/kvport/connectors/offloading/scheduler/half.py",
        FAILED_PROMOTION_FREED,
        "            pass\n",
        (f"{RACES}::test_a_failed_promotion_ends_the_wait_for_it",),
        "keys whose promotion failed leave the host tier, which ends other requests' waits "
        "for them"),
    Mutant(
        "promotion-room", "src/kvport/connectors/offloading/scheduler/hits.py",
        "            room = max(0, self.room() - num_host)\n",
        "            room = len(keys)\n",
        (f"{ENGINE}::test_a_hit_larger_than_the_host_tier_promotes_what_fits",),
        "a hit promotes at most as many disk blocks as the host tier could free"),
    Mutant(
        "store-room", "src/kvport/connectors/offloading/scheduler/stores.py",
        "            end = min(end, first + room)\n",
        "",
        (f"{ENGINE}::test_a_hit_larger_than_the_host_tier_promotes_what_fits",),
        "a run longer than the host tier is stored a part per step, not refused forever"),
    Mutant(
        "promotion-bypasses-admission", "src/kvport/connectors/offloading/scheduler/hits.py",
        "            out = self.manager.prepare_store(lower_keys, bypass_admission=True)\n",
        "            out = self.manager.prepare_store(lower_keys)\n",
        ("tests/offloading/test_connector_admission.py::"
         "test_disk_hits_are_promoted_whatever_the_admission_count",),
        "promotions from disk are hits: admission control must not hold them back"),
    Mutant(
        "admission-counted-per-admission", "src/kvport/connectors/offloading/manager/policy.py",
        "            num_hits += 1\n        return num_hits\n",
        ("            num_hits += 1\n        self.admission.on_request(keys)\n"
         "        return num_hits\n"),
        ("tests/offloading/test_connector_admission.py::"
         "test_a_retried_request_counts_once_for_admission",),
        "a request matched several times before admission counts once for store_threshold"),
    # ---- OffloadingConnector: pins and failures ------------------------------------------------
    Mutant(
        "write-through-pins", "src/kvport/connectors/offloading/scheduler/half.py",
        "            self.manager.prepare_load(good)\n"
        "            job.pinned, job.failed_keys = good, bad\n",
        "            job.pinned, job.failed_keys = [], bad\n",
        (f"{RACES}::test_a_write_through_keeps_its_slots_until_it_reports",),
        "host slots stay pinned while the disk write-through reads them"),
    Mutant(
        "failed-slots-reserved-until-every-write",
        "src/kvport/connectors/offloading/scheduler/half.py",
        "            job.pinned, job.failed_keys = good, bad\n",
        "            job.pinned, job.failed_keys = good, []\n"
        "            self.manager.complete_store(bad, success=False)\n",
        (f"{STAGES}::test_a_store_is_done_when_every_worker_reported_it",),
        "a block one rank failed stays reserved while another rank may write its slot to disk"),
    Mutant(
        "write-through-started-by-the-worker", "src/kvport/connectors/offloading/worker/stores.py",
        "        writes = self.writes.start(job, failed)\n",
        "        writes = []\n",
        (f"{STAGES}::test_an_engine_that_stops_stepping_loses_no_store",),
        "the worker writes a store through to disk itself: no scheduler step is needed"),
    Mutant(
        "shutdown-drains-stores", "src/kvport/connectors/offloading/worker/half.py",
        "            submitter.router.wait(pending, left)\n",
        "            break\n",
        (f"{STAGES}::test_shutdown_lets_the_write_throughs_finish",),
        "shutdown lets stores and write-throughs in flight finish instead of cancelling them"),
    Mutant(
        "shutdown-writes-through-late-copies", "src/kvport/connectors/offloading/worker/half.py",
        "            self._on_finished(submitter.take_finished())  # a copy that ended starts its writes\n",
        "            pass\n",
        (f"{STAGES}::test_shutdown_writes_through_a_copy_that_ended_after_the_last_step",),
        "shutdown starts the write-through of a store whose copy ended after the last step (D3)"),
    Mutant(
        "shutdown-counts-what-it-dropped", "src/kvport/connectors/offloading/worker/half.py",
        "            self.stats.add(num_dropped_at_shutdown=len(pending))\n",
        "            pass\n",
        (f"{STAGES}::test_shutdown_drops_what_runs_past_its_deadline_and_says_what",),
        "what shutdown drops at its deadline is counted"),
    Mutant(
        "shutdown-skips-given-up-writes", "src/kvport/connectors/offloading/worker/half.py",
        "                       and k.job_id not in stores.given_up]\n",
        "                       ]\n",
        (f"{FAULTS}::test_shutdown_does_not_wait_for_a_write_it_gave_up",),
        "shutdown does not wait for a write-through already given up (write_timeout_s)"),
    Mutant(
        "a-stage-waits-for-every-worker", "src/kvport/connectors/offloading/scheduler/jobs.py",
        "        if self.num_workers == 1:\n",
        "        if True:\n",
        (f"{STAGES}::test_a_store_is_done_when_every_worker_reported_it",
         f"{STAGES}::test_a_load_is_done_when_every_worker_reported_it"),
        "with several workers (TP ranks) a job's stage is done only when every one reported"),
    Mutant(
        "failed-copy-reported", "src/kvport/connectors/offloading/worker/loads.py",
        "            load.engine_failed += [load.copy_dst[i] for i in result.failed_indices]\n",
        "            pass\n",
        (f"{FAULTS}::test_failed_loads_are_recomputed[False]",),
        "engine blocks a HOST->ENGINE copy failed to fill are reported as load errors"),
    Mutant(
        "failed-sync-part-reported", "src/kvport/connectors/offloading/worker/loads.py",
        "            load.engine_failed += [blocks[i] for i in result.failed_indices]\n",
        "            pass\n",
        (f"{FAULTS}::test_failed_loads_are_recomputed[True]",),
        "engine blocks a synchronous load's part failed to fill are this step's load errors"),
    Mutant(
        "failed-promotion-reported", "src/kvport/connectors/offloading/worker/loads.py",
        "        bad = {num_host + p for p in load.promote_failed}",
        "        bad: set[int] = set()",
        (f"{RACES}::test_a_failed_promotion_is_reported_and_frees_its_slots",),
        "engine blocks whose promotion from disk failed are reported, not copied from the slot"),
    Mutant(
        "failed-promotion-frees-slots", "src/kvport/connectors/offloading/scheduler/half.py",
        FAILED_PROMOTION_FREED,
        """\
            self.manager.complete_store([k for i, k in enumerate(job.promoted) if i in failed],
                                        success=True)
""",
        (f"{RACES}::test_a_failed_promotion_is_reported_and_frees_its_slots",),
        "slots of a failed promotion are freed, not published with garbage"),
    Mutant(
        "failed-store-frees-slots", "src/kvport/connectors/offloading/scheduler/half.py",
        "            self.manager.complete_store(bad, success=False)\n",
        "            self.manager.complete_store(bad, success=True)\n",
        (f"{FAULTS}::test_failed_stores_free_their_slots",),
        "slots of a failed store are freed, not published with garbage"),
    Mutant(
        "stores-submitted-every-step", "src/kvport/connectors/offloading/worker/half.py",
        "            self._on_finished(stores.submit(meta.stores, tainted))\n",
        "            self._on_finished(stores.submit(meta.stores if did_forward else [], tainted))\n",
        (f"{ENGINE}::test_no_store_is_lost_when_every_other_step_has_no_forward[one-step-late]",),
        "stores reaching the worker on a step without a forward are submitted too"),
    # ---- lower tiers: write-throughs and promotions (worker/) ----------------------------------
    Mutant(
        "write-through-waits-for-every-tier",
        "src/kvport/connectors/offloading/worker/write_throughs.py",
        """        if write.left > 0:
            return None, held  # another tier still reads the slots: they stay pinned
        del self._writes[job_id]
""",
        """        if write.left == 0:
            del self._writes[job_id]
""",
        (f"{RACES}::test_slots_stay_pinned_until_every_lower_tiers_write_reported",),
        "a store's slots stay pinned until every lower tier's write-through ended"),
    Mutant(
        "redis-promotion-failure-is-a-load-error",
        "src/kvport/connectors/offloading/worker/loads.py",
        """        load.promote_failed += [position[promotion.dst.slot_ids[i]]
                                for i in result.failed_indices]
""",
        "",
        (f"{RACES}::test_a_hit_from_disk_and_redis_fails_only_the_redis_blocks",),
        "blocks whose promotion from a lower tier failed are load errors, recomputed"),
    # ---- synchronous host loads ----------------------------------------------------------------
    Mutant(
        "sync-loads-copied-before-the-forward", "src/kvport/connectors/offloading/worker/half.py",
        "        if sync:\n"
        "            loads.wait_sync(sync)\n"
        "            self._on_finished(submitter.take_finished())\n"
        "            loads.settle_sync(sync)\n",
        "",
        (f"{SYNC}::test_a_host_hit_prefills_in_the_step_that_admits_it",),
        "a synchronous load is copied in start_load_kv, before the forward reads its blocks"),
    Mutant(
        "late-sync-parts-fail-their-blocks", "src/kvport/connectors/offloading/worker/loads.py",
        "                load.engine_failed += [b for blocks in load.parts.values()"
        " for b in blocks]\n",
        "",
        (f"{SYNC}::test_a_late_copy_recomputes_exactly_the_blocks_it_did_not_copy",),
        "parts of a synchronous load still running at its deadline fail their blocks"),
    Mutant(
        "late-sync-load-held", "src/kvport/connectors/offloading/scheduler/requests.py",
        "        if self.load_job is not None and self.load_sync:\n",
        "        if False:\n",
        (f"{RACES}::test_a_late_sync_loads_blocks_are_held_until_it_ends",),
        "a request whose synchronous load has a late part is held until the part ends"),
    Mutant(
        "late-sync-parts-write-nothing", "src/kvport/connectors/offloading/worker/wiring.py",
        "    if dst.deadline is not None and time.monotonic() > dst.deadline:\n",
        "    if False:\n",
        (f"{SYNC}::test_a_late_copy_recomputes_exactly_the_blocks_it_did_not_copy",),
        "a part of a synchronous load that starts after its deadline writes nothing"),
    # ---- transfer handlers: jobs run together --------------------------------------------------
    Mutant(
        "transfer-batch-takes-only-what-fits", "src/kvport/connectors/offloading/worker/threads.py",
        "            if blocks + len(task.dst) > limit:\n"
        "                return tasks, task\n",
        "",
        (f"{TRANSFERS}::test_queued_jobs_run_as_one_batch_and_are_reported_alone",),
        "a batch holds at most its size in positions (what a job waits for the others)"),
    Mutant(
        "transfer-batch-sized-by-the-last-rate",
        "src/kvport/connectors/offloading/worker/threads.py",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, fit, "
        "2 * self._batch_blocks))\n",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, "
        "2 * self._batch_blocks))\n",
        (f"{TRANSFERS}::test_a_batch_is_what_the_last_call_moved_in_batch_seconds",),
        "a slow call shrinks the next batch to what its rate moves in batch_seconds"),
    Mutant(
        "transfer-batch-grows-at-most-twofold",
        "src/kvport/connectors/offloading/worker/threads.py",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, fit, "
        "2 * self._batch_blocks))\n",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, fit))\n",
        (f"{TRANSFERS}::test_a_batch_is_what_the_last_call_moved_in_batch_seconds",),
        "one fast call (bytes read ahead) at most doubles the next batch"),
    Mutant(
        "transfer-batch-leaves-shutdowns-marker",
        "src/kvport/connectors/offloading/worker/threads.py",
        "                self._queue.put(None)\n",
        "",
        (f"{TRANSFERS}::test_shutdown_ends_every_batching_thread",),
        "a thread that takes shutdown's end marker while taking a batch leaves it for another"),
    Mutant(
        "transfer-cancelled-jobs-left-out", "src/kvport/connectors/offloading/worker/threads.py",
        "            started = [t for t in tasks if t.state is _QUEUED]\n",
        "            started = list(tasks)\n",
        (f"{TRANSFERS}::test_a_job_cancelled_while_queued_is_left_out_of_its_batch",
         f"{TRANSFERS}::test_shutdown_with_a_never_completing_job_does_not_hang"),
        "a job cancelled while queued never runs: its destination stays untouched"),
    Mutant(
        "transfer-waiter-woken-when-all-ended",
        "src/kvport/connectors/offloading/worker/threads.py",
        "            if not waiter.pending:\n",
        "            if True:\n",
        (f"{TRANSFERS}::test_wait_returns_when_the_last_of_its_jobs_ends",),
        "wait returns only once every job it names ended"),
    # ---- deadlines (D2), shutdown (D3), write-through bound (D13), hash blocks (D17) -----------
    Mutant(
        "late-loads-given-up", "src/kvport/connectors/offloading/worker/half.py",
        "        expired = self._deadlines.take_expired()\n",
        "        expired: list[int] = []\n",
        (f"{FAULTS}::test_a_hung_disk_read_fails_its_load_and_later_disk_hits_overtake_it",),
        "a promotion or write-through past its deadline is given up: generate() returns"),
    Mutant(
        "late-load-blocks-fail", "src/kvport/connectors/offloading/worker/loads.py",
        "        load.engine_failed = sorted(set(load.engine_failed) | set(load.job.dst.block_ids))\n",
        "",
        (f"{FAULTS}::test_a_hung_disk_read_fails_its_load_and_later_disk_hits_overtake_it",),
        "a late load's blocks are load errors: the engine recomputes them, never uses them"),
    Mutant(
        "queued-jobs-get-a-second-deadline", "src/kvport/connectors/offloading/worker/half.py",
        "            if started.isdisjoint(keys)"
        " and self._deadlines.extend_once(job_id, seconds):\n",
        "            if False:\n",
        (f"{RACES}::test_a_promotion_only_queued_behind_a_stuck_job_gets_a_second_deadline",),
        "a job only queued behind a stuck one runs on the replacement thread, not failed with it"),
    Mutant(
        "stuck-threads-replaced", "src/kvport/connectors/offloading/worker/threads.py",
        "        for _ in range(started):\n            self._start_thread()\n",
        "",
        (f"{FAULTS}::test_a_hung_disk_read_fails_its_load_and_later_disk_hits_overtake_it",),
        "a stuck transfer's thread is replaced: later disk hits overtake it"),
    Mutant(
        "late-jobs-keep-nothing-stepping", "src/kvport/connectors/offloading/scheduler/half.py",
        "        return len(self._jobs) > len(self._late_jobs)\n",
        "        return bool(self._jobs)\n",
        (f"{FAULTS}::test_a_hung_write_through_is_given_up_and_its_slots_return_with_it",),
        "a job the worker gave up on does not keep the engine stepping"),
    Mutant(
        "late-write-keeps-its-pins", "src/kvport/connectors/offloading/worker/stores.py",
        "        self.given_up.add(job_id)\n",
        "        self.given_up.add(job_id)\n"
        "        self.submitter.results.append(JobResult(job_id, False, stage=Stage.WRITE))\n",
        (f"{FAULTS}::test_a_hung_write_through_is_given_up_and_its_slots_return_with_it",),
        "a given-up write keeps its host slots pinned until its thread returns"),
    Mutant(
        "write-throughs-bounded", "src/kvport/connectors/offloading/scheduler/stores.py",
        "            writes = []  # a slow lower tier: this store stays in host memory only\n",
        "            pass\n",
        (f"{STAGES}::test_write_throughs_behind_a_stuck_tier_leave_host_room_for_new_stores",),
        "write-throughs hold at most WRITE_THROUGH_SHARE of the host slots (D13)"),
    Mutant(
        "mismatched-hashes-not-loaded", "src/kvport/connectors/offloading/scheduler/hits.py",
        "        if not hashes_ok(request, g.block_size):\n",
        "        if False:\n",
        (f"{STAGES}::test_block_hashes_of_another_block_size_are_neither_loaded_nor_stored",),
        "a request hashed in blocks unlike the KV block's is not matched (D17)"),
    Mutant(
        "mismatched-hashes-not-stored", "src/kvport/connectors/offloading/scheduler/stores.py",
        " or not st.hashes_ok or not st.limits.stores:\n",
        " or not st.limits.stores:\n",
        (f"{STAGES}::test_block_hashes_of_another_block_size_are_neither_loaded_nor_stored",),
        "a request hashed in blocks unlike the KV block's is not stored (D17)"),
    Mutant(
        "planned-promotions-kept-on-disk", "src/kvport/connectors/offloading/worker/loads.py",
        "                self._keep_entries(promotion, True)\n",
        "",
        (f"{RACES}::test_a_run_a_planned_promotion_reads_is_not_evicted_by_a_write_through",),
        "a write-through does not evict the disk run a planned promotion will read (D5)"),
    Mutant(
        "sync-loads-waited-for-in-vllm", "src/kvport/connectors/offloading/worker/loads.py",
        "        timeout = None if self.wait_sync_loads else sync_timeout(num_bytes)\n",
        "        timeout = sync_timeout(num_bytes)\n",
        (f"{SYNC}::test_inside_vllm_a_slow_sync_copy_is_waited_for",),
        "with wait_sync_loads a slow synchronous copy is waited for, not failed"),
    Mutant(
        "failed-sync-load-stores-nothing", "src/kvport/connectors/offloading/worker/stores.py",
        "            if job.req_id in tainted:  # computed on KV a failed sync load left\n",
        "            if False:\n",
        (f"{SYNC}::test_a_failed_sync_load_stores_nothing_computed_on_it",),
        "a step whose synchronous load failed stores nothing its forward computed on it"),
    Mutant(
        "final-block-stored", "src/kvport/connectors/offloading/scheduler/half.py",
        "        self._store_final_blocks(st, request)\n",
        "",
        ("tests/offloading/test_store_stages.py::test_the_block_a_final_step_completes_is_stored",
         "tests/offloading/test_hybrid_offloading.py::test_every_group_comes_back_after_a_reset"),
        "the block a request's final step completed is stored under async scheduling too"),
    Mutant(
        "final-block-only-computed-tokens", "src/kvport/connectors/offloading/scheduler/half.py",
        "        done = min(request.num_computed_tokens, request.num_tokens - 1)\n",
        "        done = request.num_tokens\n",
        ("tests/offloading/test_store_stages.py::test_the_block_a_final_step_completes_is_stored",),
        "a finished request's final store covers only tokens whose KV a finished step wrote"),
]
