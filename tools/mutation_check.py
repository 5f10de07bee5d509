#!/usr/bin/env python3
"""Mutation check: remove one guard at a time and check that the tests meant to catch it fail.

Each `Mutant` replaces one exact piece of source text (`old`, which must occur exactly once, so
a refactor that moves or rewrites a guard makes this script fail loudly instead of silently
checking nothing) with `new`, the code as it would be without the guard. The script copies
`src/` into a temporary directory, applies one mutant at a time, and runs the mutant's tests
against the copy (`PYTHONPATH=<tmp>/src`, so spawned worker processes import it too). Each copy
has a zygote (`--serve`): a process that imported torch, pytest and the other third-party
modules once and forks a fresh child for every mutant's pytest run, which then imports only
kvport (from the copy) and the tests. A mutant is killed when its tests fail; it survived when
they pass. Exit code 1 if any mutant survived, could not be applied, or its test run errored (a
collection error is not a kill).

    python tools/mutation_check.py                 # every mutant
    python tools/mutation_check.py --list          # names and why
    python tools/mutation_check.py --only NAME...  # some of them
    python tools/mutation_check.py --why           # also how each killed mutant failed
    python tools/mutation_check.py --jobs 1        # one mutant at a time (default: 2 at once)

Adding a guard: append a Mutant to MUTANTS with the smallest tests that kill it. Standard
library only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MUTANT_LIMIT_S = 240  # one mutant's test run at most (a hang counts as killed)
TESTS = "tests/offloading"
RACES = f"{TESTS}/test_connector_races.py"
ENGINE = f"{TESTS}/test_connector_engine.py"
FAULTS = f"{TESTS}/test_connector_faults.py"
ADMISSION = f"{TESTS}/test_connector_admission.py"
HOLD = f"{TESTS}/test_scheduler_hold.py"
STAGES = f"{TESTS}/test_store_stages.py"
SYNC = f"{TESTS}/test_sync_loads.py"
SCHED = "tests/engine/test_scheduler_connector.py"
DRIVER = "src/kvport/connectors/driver.py"
REGRESSIONS = "tests/connectors/test_framework_regressions.py"
SIM = "tests/sim/test_sim.py"
RECORDING = "tests/connectors/test_recording.py"
# The scheduler half frees the host slots of keys whose promotion failed (two mutants remove it).
FAILED_PROMOTION_FREED = """\
            self.manager.complete_store([k for i, k in enumerate(job.promoted) if i in failed],
                                        success=False)
"""


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # repo-relative file
    old: str  # exact text, must occur exactly once in the file
    new: str  # the same place without the guard
    tests: tuple[str, ...]  # pytest node ids; at least one must fail
    why: str  # what the guard protects, one line


MUTANTS: list[Mutant] = [
    # ---- OffloadingConnector: no job touches blocks the engine reused ----------------------
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
         f"{HOLD}::test_a_finished_request_is_held_until_its_stores_copied"),
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
         f"{HOLD}::test_a_preempted_requests_stores_are_flushed"),
        "a preempted request's stores are flushed before its freed blocks are written"),
    # ---- OffloadingConnector: hits and loads -------------------------------------------------
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
        "inflight-wait-forgotten-at-admission", "src/kvport/connectors/offloading/scheduler/half.py",
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
        "        end = min(end, st.next_store_idx + room)\n",
        "",
        (f"{ENGINE}::test_a_hit_larger_than_the_host_tier_promotes_what_fits",),
        "a run longer than the host tier is stored a part per step, not refused forever"),
    Mutant(
        "promotion-bypasses-admission", "src/kvport/connectors/offloading/scheduler/hits.py",
        "            out = self.manager.prepare_store(lower_keys, bypass_admission=True)\n",
        "            out = self.manager.prepare_store(lower_keys)\n",
        (f"{ADMISSION}::test_disk_hits_are_promoted_whatever_the_admission_count",),
        "promotions from disk are hits: admission control must not hold them back"),
    Mutant(
        "admission-counted-per-admission", "src/kvport/connectors/offloading/manager/policy.py",
        "            num_hits += 1\n        return num_hits\n",
        ("            num_hits += 1\n        self.admission.on_request(keys)\n"
         "        return num_hits\n"),
        (f"{ADMISSION}::test_a_retried_request_counts_once_for_admission",),
        "a request matched several times before admission counts once for store_threshold"),
    # ---- OffloadingConnector: pins and failures ----------------------------------------------
    Mutant(
        "failed-load-not-offered-again", "src/kvport/connectors/offloading/scheduler/hits.py",
        "        if not self.load_enabled or (st is not None and st.load_failed):\n",
        "        if not self.load_enabled:\n",
        ("tests/vllm/test_vllm_scheduler.py::test_a_failed_load_is_recomputed[False]",),
        "a request whose load failed is not offered it again (vLLM would retry it forever)"),
    Mutant(
        "write-through-pins", "src/kvport/connectors/offloading/scheduler/half.py",
        "            self.manager.prepare_load(good)\n"
        "            job.pinned, job.failed_keys = good, bad\n",
        "            job.pinned, job.failed_keys = [], bad\n",
        (f"{RACES}::test_a_write_through_keeps_its_slots_until_it_reports",),
        "host slots stay pinned while the disk write-through reads them"),
    Mutant(
        "failed-slots-reserved-until-every-write", "src/kvport/connectors/offloading/scheduler/half.py",
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
    # ---- the engine's connector bookkeeping (engine/kv_transfer.py, engine/scheduler.py) ------
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
        "            xfer.limit_async_load(req.request_id, first * bs)\n",
        "            pass\n",
        (f"{SCHED}::test_failed_async_load_resumes_from_the_last_good_block",),
        "a parked request resumes with only the tokens before its first failed block"),
    Mutant(
        "failed-load-rewinds", "src/kvport/engine/recovery.py",
        "            req.rewind(first * bs, step_id)\n",
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
        (f"{SCHED}::test_async_scheduling_drops_the_token_of_a_step_in_flight_behind_a_failed_load",),
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
    # ---- the worker call orders (connectors/driver.py, engine/scheduler.py, the recorder) -----
    Mutant(
        "preemptions-before-bind", DRIVER,
        '        self._guarded("handle_preemptions", lambda: c.handle_preemptions(meta), None)\n'
        '        self._guarded("bind_connector_metadata", '
        'lambda: c.bind_connector_metadata(meta), None)\n',
        '        self._guarded("bind_connector_metadata", '
        'lambda: c.bind_connector_metadata(meta), None)\n'
        '        self._guarded("handle_preemptions", lambda: c.handle_preemptions(meta), None)\n',
        (f"{REGRESSIONS}::test_1_handle_preemptions_runs_before_bind[vllm-0.32]",),
        "handle_preemptions runs before the step's metadata is bound, in either order"),
    Mutant(
        "sync-loads-flagged", "src/kvport/engine/scheduler.py",
        "            plan.has_sync_kv_loads = True  # the forward reads what start_load_kv loads\n",
        "            pass\n",
        (f"{SCHED}::test_only_the_step_that_admits_a_sync_load_has_sync_kv_loads",),
        "a step that admits a sync load says so (vllm-0.32 starts its loads before the forward)"),
    Mutant(
        "sync-loads-before-the-forward", DRIVER,
        "        return self.call_order == LEGACY or ctx.has_sync_kv_loads\n",
        "        return self.call_order == LEGACY\n",
        (f"{REGRESSIONS}::test_3_sync_loads_start_before_the_forward_that_reads_them[vllm-0.32]",),
        "vllm-0.32 starts a step's sync loads before the forward that reads them"),
    Mutant(
        "loads-start-after-the-forward", DRIVER,
        "        if not self._load_started:",
        "        if False:",
        ((f"{REGRESSIONS}::test_2_saves_queued_in_wait_for_save_are_lost_in_legacy_no_forward_steps"
          "[DeferredSaveConnector-vllm-0.32]"),),
        "vllm-0.32 starts the loads of a step without sync loads after its forward"),
    Mutant(
        "wait-for-save-every-step", DRIVER,
        "        if did_forward or self.call_order == VLLM_0_32:",
        "        if did_forward:",
        ((f"{REGRESSIONS}::test_2_saves_queued_in_wait_for_save_are_lost_in_legacy_no_forward_steps"
          "[SaveInWaitForSaveConnector-vllm-0.32]"),),
        "vllm-0.32 calls wait_for_save on every step, no-forward steps included"),
    Mutant(
        "driver-records-hook-errors", DRIVER,
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
        (f"{RECORDING}::test_factory_hands_the_header_to_recorders_and_a_multi_connectors_children",),
        "the engine's header reaches the recorder the factory wraps a connector in"),
    Mutant(
        "multi-passes-the-header-to-its-children", "src/kvport/connectors/multi.py",
        "create_connector(c, role, header) for c in children",
        "create_connector(c, role) for c in children",
        (f"{RECORDING}::test_factory_hands_the_header_to_recorders_and_a_multi_connectors_children",),
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
         "tests/connectors/test_call_orders.py::test_loads_give_the_output_of_no_connector_in_either_order"),
        "a MultiConnector child hears only of the async loads it owns (S7 in its own trace)"),
    # ---- the Redis tier ----------------------------------------------------------------------
    Mutant(
        "write-through-waits-for-every-tier", "src/kvport/connectors/offloading/worker/write_throughs.py",
        """        if write.left > 0:
            return None  # another tier still reads the slots: they stay pinned
        del self._writes[job_id]
""",
        """        if write.left == 0:
            del self._writes[job_id]
""",
        (f"{RACES}::test_slots_stay_pinned_until_every_lower_tiers_write_reported",),
        "a store's slots stay pinned until every lower tier's write-through ended"),
    Mutant(
        "redis-checksum-checked", "src/kvport/connectors/offloading/tiers/value_format.py",
        "        return Verdict.OK if checksum(payload) == xxh else Verdict.BAD\n",
        "        return Verdict.OK\n",
        (f"{TESTS}/test_redis_tier.py::test_corrupt_values_fail_are_counted_and_deleted",),
        "a Redis value whose payload does not match its checksum is never loaded"),
    Mutant(
        "redis-corrupt-deleted", "src/kvport/connectors/offloading/tiers/redis/tier.py",
        """        if delete:
            self._delete(delete)
""",
        "",
        (f"{TESTS}/test_redis_tier.py::test_corrupt_values_fail_are_counted_and_deleted",),
        "a corrupt Redis value is deleted (else every lookup finds it and every load fails)"),
    Mutant(
        "redis-promotion-failure-is-a-load-error", "src/kvport/connectors/offloading/worker/loads.py",
        """        load.promote_failed += [position[promotion.dst.slot_ids[i]]
                                for i in result.failed_indices]
""",
        "",
        (f"{RACES}::test_a_hit_from_disk_and_redis_fails_only_the_redis_blocks",),
        "blocks whose promotion from a lower tier failed are load errors, recomputed"),
    # ---- synchronous host loads --------------------------------------------------------------
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
    # ---- disk tier ---------------------------------------------------------------------------
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
        (f"{TESTS}/test_disk_tier.py::test_size_limit_evicts_least_recently_used",),
        "a disk store that cannot fit is skipped without evicting anything"),
    Mutant(
        "disk-store-keeps-its-own-runs", "src/kvport/connectors/offloading/tiers/disk/index.py",
        "                if run_id not in keep:\n",
        "                if True:\n",
        (f"{TESTS}/test_disk_runs.py::test_a_store_never_evicts_the_runs_of_its_own_held_keys",),
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
        (f"{TESTS}/test_disk_runs.py::"
         "test_a_name_found_gone_frees_its_room_before_the_store_makes_room",),
        "a key whose name another process removed no longer holds room or a run in the index"),
    Mutant(
        "disk-run-files-reopened-when-changed", "src/kvport/connectors/offloading/tiers/disk/files.py",
        "            if changed_since_open(cached.run):\n",
        "            if False:\n",
        (f"{TESTS}/test_disk_runs.py::test_runs_stay_open_between_jobs_and_close_when_evicted",
         f"{TESTS}/test_disk_runs.py::test_an_entry_is_hashed_once_until_its_file_changes"),
        "a kept run file another process changed (written, names removed) is reopened and its "
        "entries checked again; one whose every name is gone is closed, not read"),
    Mutant(
        "disk-changed-run-unchecked", "src/kvport/connectors/offloading/tiers/disk/files.py",
        "                cached.run.checked[:] = bytes(len(cached.run.checked))\n",
        "",
        (f"{TESTS}/test_disk_runs.py::"
         "test_a_changed_run_another_job_still_reads_is_handed_out_unchecked",),
        "a run found changed is handed to the next job (two disk threads) with nothing checked"),
    Mutant(
        "disk-hashes-what-changed-while-read", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if unhashed and changed_since_open(run):\n",
        "    if False:\n",
        (f"{TESTS}/test_disk_runs.py::"
         "test_a_run_written_while_a_job_reads_it_is_hashed_after_all",),
        "entries read unhashed from a run file another writer changed during the job are hashed"),
    Mutant(
        "disk-reads-in-one-call-only-what-is-cached", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "            or not holds_whole(run.fd, run.header.offset(first), "
        "len(entries) * payload)):\n",
        "            ):\n",
        (f"{TESTS}/test_disk_runs.py::test_checked_entries_the_cache_holds_are_read_in_one_call",),
        "a cold extent is read in pieces the kernel's readahead streams, not in one call"),
    Mutant(
        "disk-reads-in-one-call-only-what-was-checked", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if (not all(position == first + i and run.checked[position]\n",
        "    if (not all(position == first + i\n",
        (f"{TESTS}/test_disk_runs.py::"
         "test_a_job_across_runs_loads_exactly_and_bad_entries_fail_alone",
         f"{TESTS}/test_disk_tier.py::test_corrupt_entry_is_a_miss_and_removed"),
        "an entry never checked is hashed, however fast the cache could hand it out"),
    Mutant(
        "disk-reads-in-one-call-only-an-extent", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if (not all(position == first + i and run.checked[position]\n",
        "    if (not all(run.checked[position]\n",
        (f"{TESTS}/test_disk_runs.py::test_checked_entries_the_cache_holds_are_read_in_one_call",),
        "one call fills the slots of consecutive positions only (no gap, no key asked twice)"),
    Mutant(
        "disk-asks-for-names-the-index-lacks", "src/kvport/connectors/offloading/tiers/disk/load.py",
        "                    linked = run.links == self.index.num_keys(run_id)\n",
        "                    linked = True\n",
        (f"{TESTS}/test_disk_runs.py::test_a_name_removed_before_its_run_was_opened_is_a_miss",),
        "a key whose name is gone is a miss even while its run is open through another name"),
    Mutant(
        "disk-reads-ahead-only-holes", "src/kvport/connectors/offloading/tiers/disk/page_cache.py",
        "    return prefix is None or prefix[0] != held[0]\n",
        "    return True\n",
        (f"{TESTS}/test_disk_runs.py::test_a_span_cached_with_holes_is_read_ahead_at_once",),
        "a span cached as a prefix (a sequential read's readahead) is not asked for again"),
    Mutant(
        "disk-reads-ahead-holes", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "        _read_ahead_holes(run, entries)\n",
        "",
        (f"{TESTS}/test_disk_runs.py::test_a_span_cached_with_holes_is_read_ahead_at_once",),
        "a span cached with holes is asked for at once, not one miss at a time"),
    Mutant(
        "disk-reads-ahead-only-its-span", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    if size <= 2 * len(entries) * payload and has_holes(run.fd, start, size):\n",
        "    if has_holes(run.fd, start, size):\n",
        (f"{TESTS}/test_disk_runs.py::test_a_span_cached_with_holes_is_read_ahead_at_once",),
        "a job with gaps does not read ahead the entries between its own"),
    Mutant(
        "parts-all-end-before-the-call-does", "src/kvport/connectors/offloading/tiers/parts.py",
        "        wait([f for f in futures if not f.cancel()])\n",
        "        pass\n",
        (f"{TESTS}/test_parts.py::test_every_part_has_ended_when_the_callers_part_raises",),
        "a part on a helper never writes after the call ended (a failed copy's blocks are "
        "recomputed into)"),
    Mutant(
        "parts-late-helper-not-waited-for", "src/kvport/connectors/offloading/tiers/parts.py",
        "        wait([f for f in futures if not f.cancel()])\n",
        "        wait(futures)\n",
        (f"{TESTS}/test_parts.py::test_a_helper_that_has_not_started_is_not_waited_for",),
        "a helper task still queued when the ranges ran out is dropped, not waited for"),
    Mutant(
        "parts-no-range-after-a-failure", "src/kvport/connectors/offloading/tiers/parts.py",
        "        while not failed and (r := next(taken)) < num_ranges:\n",
        "        while (r := next(taken)) < num_ranges:\n",
        (f"{TESTS}/test_parts.py::"
         "test_a_helpers_exception_is_raised_and_no_range_starts_after_it",),
        "once a range raised, no thread starts another (the call fails anyway)"),
    Mutant(
        "disk-split-read-failures-count", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    return all(run_in_parts(len(entries), k, lambda lo, hi: _read_exactly(\n",
        "    return any(run_in_parts(len(entries), k, lambda lo, hi: _read_exactly(\n",
        (f"{TESTS}/test_disk_runs.py::test_a_range_that_fails_to_read_makes_the_job_read_again",),
        "a range of a split read that failed makes the job read again, not a slot left "
        "unfilled"),
    Mutant(
        "disk-split-parts-of-at-least-half-the-split", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "    return max(1, min(num_helpers + 1, num_entries, size // (SPLIT_BYTES // 2)))\n",
        "    return max(1, min(num_helpers + 1, num_entries))\n",
        (f"{TESTS}/test_disk_runs.py::"
         "test_a_split_read_has_one_part_per_thread_of_at_least_half_the_split_size",),
        "many cores do not cut a cached read into parts smaller than half the split size"),
    Mutant(
        "disk-split-parts-at-their-offsets", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "        run.fd, views[lo:hi], offset + lo * payload, payload), helpers))\n",
        "        run.fd, views[lo:hi], offset, payload), helpers))\n",
        (f"{TESTS}/test_disk_runs.py::test_a_large_cached_extent_is_read_by_several_threads",),
        "each part of a split read fills its slots from its own entries"),
    Mutant(
        "host-buffer-faulted-in-at-start", "src/kvport/connectors/offloading/tiers/host/tier.py",
        "        self.buffer = torch.zeros((num_slots, slot_bytes), dtype=torch.uint8)",
        "        self.buffer = torch.empty((num_slots, slot_bytes), dtype=torch.uint8)",
        (f"{TESTS}/test_host_tier.py::test_the_buffer_is_resident_from_the_start",),
        "the host tier's pages are faulted in when it is made, not by stores beside the forward"),
    # ---- transfer handlers: jobs run together ------------------------------------------------
    Mutant(
        "transfer-batch-takes-only-what-fits", "src/kvport/connectors/offloading/worker/threads.py",
        "            if blocks + len(task.dst) > limit:\n"
        "                return tasks, task\n",
        "",
        (f"{TESTS}/test_transfers.py::test_queued_jobs_run_as_one_batch_and_are_reported_alone",),
        "a batch holds at most its size in positions (what a job waits for the others)"),
    Mutant(
        "transfer-batch-sized-by-the-last-rate", "src/kvport/connectors/offloading/worker/threads.py",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, fit, "
        "2 * self._batch_blocks))\n",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, "
        "2 * self._batch_blocks))\n",
        (f"{TESTS}/test_transfers.py::test_a_batch_is_what_the_last_call_moved_in_batch_seconds",),
        "a slow call shrinks the next batch to what its rate moves in batch_seconds"),
    Mutant(
        "transfer-batch-grows-at-most-twofold", "src/kvport/connectors/offloading/worker/threads.py",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, fit, "
        "2 * self._batch_blocks))\n",
        "        self._batch_blocks = max(1, min(self._max_batch_blocks, fit))\n",
        (f"{TESTS}/test_transfers.py::test_a_batch_is_what_the_last_call_moved_in_batch_seconds",),
        "one fast call (bytes read ahead) at most doubles the next batch"),
    Mutant(
        "transfer-batch-leaves-shutdowns-marker", "src/kvport/connectors/offloading/worker/threads.py",
        "                self._queue.put(None)\n",
        "",
        (f"{TESTS}/test_transfers.py::test_shutdown_ends_every_batching_thread",),
        "a thread that takes shutdown's end marker while taking a batch leaves it for another"),
    Mutant(
        "transfer-cancelled-jobs-left-out", "src/kvport/connectors/offloading/worker/threads.py",
        "            started = [t for t in tasks if t.state is _QUEUED]\n",
        "            started = list(tasks)\n",
        (f"{TESTS}/test_transfers.py::test_a_job_cancelled_while_queued_is_left_out_of_its_batch",
         f"{TESTS}/test_transfers.py::test_shutdown_with_a_never_completing_job_does_not_hang"),
        "a job cancelled while queued never runs: its destination stays untouched"),
    Mutant(
        "transfer-waiter-woken-when-all-ended", "src/kvport/connectors/offloading/worker/threads.py",
        "            if not waiter.pending:\n",
        "            if True:\n",
        (f"{TESTS}/test_transfers.py::test_wait_returns_when_the_last_of_its_jobs_ends",),
        "wait returns only once every job it names ended"),
    Mutant(
        "disk-batch-outcomes-per-job", "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "            first += len(src.keys)\n",
        "",
        (f"{TESTS}/test_disk_runs.py::"
         "test_a_batch_of_jobs_is_read_as_one_and_each_job_fails_alone",),
        "each job of a batch gets the outcome of its own entries"),
    Mutant(
        "passes-phases-numbered-on", "src/kvport/bench/workload/passes.py",
        "            records=tuple(dataclasses.replace(r, phase=k * num_phases + r.phase)\n",
        "            records=tuple(r\n",
        ("tests/bench/test_workload_passes.py::"
         "test_passes_pool_into_one_outcome_with_phases_numbered_on",),
        "pooled passes keep a phase per round of one pass: the later requests' wall time counts"),
    Mutant(
        "passes-counters-added", "src/kvport/bench/workload/serving.py",
        "    return _combine(first, second, lambda a, b: a + b, \"\", union=True)\n",
        "    return _combine(first, second, lambda a, b: b, \"\", union=True)\n",
        ("tests/bench/test_workload_passes.py::test_metrics_sum_adds_counters_of_either_side",),
        "the pooled bytes and hits of several passes are their sum, not the last pass's"),
    Mutant(
        "passes-judged-on-the-median", "src/kvport/bench/workload/targets.py",
        "        median = statistics.median(known) if known else None\n",
        "        median = t.ratio\n",
        ("tests/bench/test_workload_passes.py::"
         "test_targets_are_judged_on_the_median_of_the_passes",),
        "a run of passes is judged on its passes' median ratio, not on the pooled requests"),
    # ---- deadlines (D2), shutdown (D3), write-through bound (D13), hash blocks (D17) --------
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
        "        if req is None or not self.store_enabled or not st.hashes_ok:\n",
        "        if req is None or not self.store_enabled:\n",
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
        "vllm-worker-waits-for-sync-loads", "src/kvport/vllm/storage.py",
        "                        caches_failed_sync_loads=True)\n",
        "                        caches_failed_sync_loads=False)\n",
        ("tests/vllm/test_vllm_identity.py::"
         "test_a_shared_tier_sets_vllms_load_failure_policy_to_recompute",),
        "inside vLLM synchronous loads are waited for (vLLM keeps a failed one's blocks)"),
    Mutant(
        "failed-sync-load-stores-nothing", "src/kvport/connectors/offloading/worker/stores.py",
        "            if job.req_id in tainted:  # computed on KV a failed sync load left\n",
        "            if False:\n",
        (f"{SYNC}::test_a_failed_sync_load_stores_nothing_computed_on_it",),
        "a step whose synchronous load failed stores nothing its forward computed on it"),
    # --- soak ---
    Mutant(
        "soak-mismatch-is-a-violation", "src/kvport/bench/soak/result.py",
        "    if reference.mismatches:\n",
        "    if False:\n",
        ("tests/bench/test_soak_bench.py::"
         "test_an_answer_that_differs_from_the_reference_fails_the_run",),
        "an answer unlike the no-connector reference fails the soak"),
    Mutant(
        "soak-reference-compares", "src/kvport/bench/soak/reference.py",
        "        if got != expected:\n",
        "        if False:\n",
        ("tests/bench/test_soak_bench.py::"
         "test_the_reference_finds_an_answer_that_differs_and_counts_failed_requests",),
        "the reference check compares every answer, token by token"),
    Mutant(
        "soak-disk-bounded", "src/kvport/bench/soak/result.py",
        "    bound(\"disk bytes\", peak[\"disk_bytes\"], "
        "disk_max_bytes + bounds.disk_slack_bytes)\n",
        "",
        ("tests/bench/test_soak_bench.py::test_disk_use_above_max_bytes_plus_slack_fails_the_run",),
        "disk use above max_bytes (plus slack) fails the soak"),
    Mutant(
        "soak-temp-files-left", "src/kvport/bench/soak/result.py",
        "    if final_disk.temp_files:\n",
        "    if False:\n",
        ("tests/bench/test_soak_bench.py::test_temp_files_after_the_last_stop_fail_the_run",),
        "a temp file left after the last clean stop fails the soak"),
    Mutant(
        "soak-restart-hits-disk", "src/kvport/bench/soak/result.py",
        "    if kills and not restarted_disk_hits:\n",
        "    if False:\n",
        ("tests/bench/test_soak_bench.py::"
         "test_a_restart_without_disk_hits_or_a_run_without_kills_fails",),
        "a restarted process that never hits the disk fails the soak (the cache must survive)"),
    Mutant(
        "soak-min-kills", "src/kvport/bench/soak/result.py",
        "    if kills < bounds.min_kills:\n",
        "    if False:\n",
        ("tests/bench/test_soak_bench.py::"
         "test_a_restart_without_disk_hits_or_a_run_without_kills_fails",),
        "a soak without its kills proves nothing: it fails"),
    Mutant(
        "soak-crash-is-a-violation", "src/kvport/bench/soak/result.py",
        "        if i.end not in (\"killed\", \"stopped\"):\n",
        "        if False:\n",
        ("tests/bench/test_soak_bench.py::test_a_process_that_crashed_fails_the_run",),
        "a workload process that died unasked fails the soak"),
    Mutant(
        "soak-fd-growth-bounded", "src/kvport/bench/soak/result.py",
        "    bound(\"fd growth\", growth[\"fds\"], bounds.max_fd_growth)\n",
        "",
        ("tests/bench/test_soak_bench.py::test_descriptor_growth_beyond_its_bound_fails_the_run",),
        "--max-fd-growth is checked"),
    Mutant(
        "soak-exit-code", "src/kvport/bench/soak/cli.py",
        "        return 0 if result.ok else 1\n",
        "        return 0\n",
        ("tests/bench/test_soak_bench.py::test_the_command_exits_1_when_a_bound_breaks",),
        "a broken bound makes the command exit 1"),
    Mutant(
        "soak-disk-inode-once", "src/kvport/bench/soak/probe.py",
        "            seen[(st.st_dev, st.st_ino)] = (st.st_size, st.st_blocks * 512)\n",
        "            seen[(st.st_dev, hash(name))] = (st.st_size, st.st_blocks * 512)\n",
        ("tests/bench/test_soak_bench.py::"
         "test_disk_usage_counts_a_run_once_for_all_its_names_and_sees_temp_files",),
        "a run's bytes count once, not once per key's hard link"),
    # --- native ---
    Mutant(
        "private-dir-owner", "src/kvport/private_dir.py",
        "    if st.st_uid != uid:\n        return f\"{lexical} is owned by uid",
        "    if False:\n        return f\"{lexical} is owned by uid",
        ("tests/native/test_private_dir.py::test_a_directory_of_another_user_is_refused",),
        "a directory of another user is not where native code is built or loaded"),
    Mutant(
        "private-dir-mode", "src/kvport/private_dir.py",
        "    if st.st_mode & _OTHERS_WRITE:\n        return f\"{lexical} is writable",
        "    if False:\n        return f\"{lexical} is writable",
        ("tests/native/test_private_dir.py::"
         "test_a_directory_writable_by_group_or_others_is_refused_and_left_as_it_is",
         "tests/native/test_native.py::"
         "test_a_cache_others_can_write_is_passed_over_for_the_user_temp_dir"),
        "a directory others can write is not where native code is built or loaded (D15)"),
    Mutant(
        "private-dir-symlink", "src/kvport/private_dir.py",
        "    if stat.S_ISLNK(st.st_mode):\n        return f\"{lexical} is a symlink\"\n",
        "",
        ("tests/native/test_private_dir.py::test_a_symlinked_directory_is_refused",),
        "the private directory itself is not a symlink someone could re-point"),
    Mutant(
        "private-dir-parent-mode", "src/kvport/private_dir.py",
        "    if st.st_mode & _OTHERS_WRITE and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):",
        "    if False:",
        ("tests/native/test_private_dir.py::test_a_parent_others_can_write_is_refused",),
        "a parent others can write lets them swap our directory for theirs"),
    Mutant(
        "private-dir-sticky-needs-root", "src/kvport/private_dir.py",
        "not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):",
        "not (st.st_mode & stat.S_ISVTX):",
        ("tests/native/test_private_dir.py::test_a_parent_others_can_write_is_refused",),
        "only a root-owned sticky parent (/tmp) protects its entries from other users"),
    Mutant(
        "private-dir-parent-owner", "src/kvport/private_dir.py",
        "    if st.st_uid not in (0, uid):\n",
        "    if False:\n",
        ("tests/native/test_private_dir.py::test_a_parent_of_another_user_is_refused",),
        "a parent owned by another user is theirs to rearrange"),
    Mutant(
        "private-dir-resolved-chain", "src/kvport/private_dir.py",
        "_prefixes(lexical) + _prefixes(resolved)",
        "_prefixes(lexical)",
        ("tests/native/test_private_dir.py::test_a_symlink_above_is_checked_both_ways",),
        "the directories a symlinked path resolves to are checked too"),
    Mutant(
        "private-dir-made-0o700", "src/kvport/private_dir.py",
        "            missing.mkdir(mode=0o700)\n",
        "            missing.mkdir()\n",
        ("tests/native/test_private_dir.py::"
         "test_a_new_directory_is_made_0o700_with_each_missing_parent",),
        "each directory kvport makes for itself is 0o700, whatever the umask"),
    Mutant(
        "private-file-mode", "src/kvport/private_dir.py",
        "    if st.st_mode & _OTHERS_WRITE:\n        return f\"{name} is writable",
        "    if False:\n        return f\"{name} is writable",
        ("tests/native/test_native.py::"
         "test_a_library_someone_else_could_have_written_is_replaced_not_loaded",),
        "a group- or world-writable library is never loaded"),
    Mutant(
        "private-file-regular", "src/kvport/private_dir.py",
        "    if not stat.S_ISREG(st.st_mode):\n",
        "    if False:\n",
        ("tests/native/test_native.py::"
         "test_a_library_someone_else_could_have_written_is_replaced_not_loaded",),
        "only a regular file is loaded (a FIFO would hang the load)"),
    Mutant(
        "private-file-owner", "src/kvport/private_dir.py",
        "    if st.st_uid != uid:\n        return f\"{name} is owned by uid",
        "    if False:\n        return f\"{name} is owned by uid",
        ("tests/native/test_private_dir.py::test_a_file_is_checked_for_type_owner_and_mode",),
        "a library of another user is never loaded"),
    Mutant(
        "native-checks-the-library", "src/kvport/native.py",
        "    problem = private_dir.file_problem(path)\n    if problem is not None:\n",
        "    problem = private_dir.file_problem(path)\n    if False:\n",
        ("tests/native/test_native.py::"
         "test_a_library_someone_else_could_have_written_is_replaced_not_loaded",),
        "the library is checked right before it is loaded"),
    Mutant(
        "native-private-build-dir", "src/kvport/native.py",
        "    directory, refused = private_dir.first_private_dir(kernel_dir_candidates())\n",
        "    directory, refused = kernel_dir_candidates()[0], []\n",
        ("tests/native/test_native.py::"
         "test_a_cache_others_can_write_is_passed_over_for_the_user_temp_dir",),
        "native code is built and loaded only in a private directory (D15)"),
    Mutant(
        "native-built-0o755", "src/kvport/native.py",
        "        os.chmod(partial, 0o755)",
        "        pass",
        ("tests/native/test_native.py::test_built_in_the_cache_0o755_in_a_0o700_directory",),
        "a library is built 0o755 whatever the umask"),
    Mutant(
        "example-default-private", "src/kvport/connectors/example.py",
        "            if problem is not None:\n"
        "                raise ValueError(f\"ExampleConnector:",
        "            if False:\n                raise ValueError(f\"ExampleConnector:",
        ("tests/connectors/test_example.py::test_the_default_store_is_private_to_the_user",),
        "ExampleConnector's default store is refused where another user could read or fill it"),
    Mutant(
        "row-checks-negative", "src/kvport/connectors/offloading/tiers/host/row_checks.py",
        "min(a) >= 0 and max(a) < num_a",
        "max(a) < num_a",
        (f"{TESTS}/test_host_bounds.py::test_copy_segments_refuses_a_negative_block_it_would_wrap",
         f"{TESTS}/test_host_bounds.py::test_the_checks_find_the_first_bad_pair_on_either_side"),
        "a negative id is refused, not wrapped to the other end of the pool (D14)"),
    Mutant(
        "row-checks-past-the-end", "src/kvport/connectors/offloading/tiers/host/row_checks.py",
        "min(b) >= 0 and max(b) < num_b",
        "min(b) >= 0",
        (f"{TESTS}/test_host_bounds.py::test_copy_rows_refuses_a_destination_row_out_of_range",),
        "an id past the end is refused, not clipped to the last row (D14)"),
    Mutant(
        "host-numpy-checks-ids", "src/kvport/connectors/offloading/tiers/host/tier.py",
        "    check_rows(src_rows, src.shape[0], dst_rows, dst.shape[0])\n    num_bytes",
        "    num_bytes",
        (f"{TESTS}/test_host_bounds.py::test_the_numpy_copy_refuses_a_source_row_it_would_clip",),
        "the numpy copy checks ids: take(mode='clip') would copy the wrong block (D14)"),
    Mutant(
        "host-strategies-check-ids", "src/kvport/bench/transfer/strategies.py",
        "    check_rows(src_rows, src.shape[0], dst_rows, dst.shape[0])\n"
        "    if strategy == \"runs\":",
        "    if strategy == \"runs\":",
        ("tests/bench/test_transfer_strategies.py::"
         "test_copy_rows_refuses_a_destination_row_out_of_range",),
        "the bench's torch strategies check ids before copying any piece"),
    Mutant(
        "copy-segments-checks-ids", "src/kvport/connectors/offloading/tiers/host/engine_pool.py",
        "    check_pairs(block_ids, pool.num_blocks, row_ids, rows.shape[0])\n",
        "",
        (f"{TESTS}/test_host_bounds.py::test_copy_segments_refuses_a_host_row_out_of_range",
         f"{TESTS}/test_host_bounds.py::test_copy_segments_refuses_a_negative_block_it_would_wrap"),
        "a pool of several segments checks ids: slices would copy fewer or other rows"),
    Mutant(
        "block-copy-c-bounds", "src/kvport/connectors/offloading/tiers/host/block_copy.c",
        "        if (host_rows[i] < 0 || host_rows[i] >= num_rows || blocks[i] < 0 ||\n"
        "            blocks[i] >= num_blocks)\n",
        "        if (0)\n",
        (f"{TESTS}/test_host_bounds.py::"
         "test_the_c_copy_refuses_an_id_past_either_end_of_either_side",),
        "review M4: the C copy checks every id; one out of range writes over other memory"),
    Mutant(
        "paged-attention-block-bounds", "src/kvport/model/paged_attention.c",
        "            if (id < 0 || id >= g->num_blocks)\n",
        "            if (0)\n",
        ("tests/model/test_kernel_bounds.py::"
         "test_decode_attention_refuses_a_block_outside_the_pool",),
        "decode attention reads no block outside the pool (D14)"),
    Mutant(
        "paged-attention-length-bounds", "src/kvport/model/paged_attention.c",
        "        if (len < 0 || len > g->table_len * g->block_size)\n",
        "        if (0)\n",
        ("tests/model/test_kernel_bounds.py::"
         "test_decode_attention_refuses_a_length_beyond_its_table",),
        "a length beyond its block table is refused, not read past the table's row"),
    Mutant(
        "paged-attention-checks-first", "src/kvport/model/paged_attention.c",
        "    if (bad != 0)\n        return bad;\n",
        "",
        ("tests/model/test_kernel_bounds.py::"
         "test_decode_attention_refuses_a_block_outside_the_pool",),
        "decode attention runs its table check before any read"),
    Mutant(
        "store-kv-slot-bounds", "src/kvport/model/paged_attention.c",
        "        if (slot_blocks[t] < 0 || slot_blocks[t] >= g->num_blocks || "
        "slot_offsets[t] < 0 ||\n"
        "            slot_offsets[t] >= g->block_size)\n",
        "        if (0)\n",
        ("tests/model/test_kernel_bounds.py::"
         "test_store_kv_refuses_a_slot_outside_the_pool_and_writes_nothing",),
        "the KV write writes no slot outside the pool (D14)"),
    Mutant(
        "kernels-raise-on-bad-table", "src/kvport/model/kernels.py",
        "    if rc > 0:  # an id or length out of range: C read nothing\n",
        "    if False:\n",
        ("tests/model/test_kernel_bounds.py::"
         "test_decode_attention_refuses_a_block_outside_the_pool",),
        "a table the C code refused is an error, not a silent fallback to torch"),
    Mutant(
        "kernels-raise-on-bad-slot", "src/kvport/model/kernels.py",
        "    if bad >= 0:\n        raise kernel_checks.slot_error",
        "    if False:\n        raise kernel_checks.slot_error",
        ("tests/model/test_kernel_bounds.py::"
         "test_store_kv_refuses_a_slot_outside_the_pool_and_writes_nothing",),
        "a slot the C code refused is an error, not a write reported done"),
    # --- diskchaos ---
    Mutant(
        "diskchaos-other-format-is-the-runs-verdict", "src/kvport/connectors/offloading/tiers/disk/load.py",
        "            header = bad.get(run_id) or read_run_header(",
        "            header = (Verdict.BAD if run_id in bad else None) or read_run_header(",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_a_run_of_another_format_version_is_a_miss_for_every_key_and_left_alone",),
        "every key of another version's run is a miss left alone, not 'bad' from the second on"),
    Mutant(
        "diskchaos-other-format-is-a-miss", "src/kvport/connectors/offloading/tiers/disk/runs.py",
        "    if version != RUN_VERSION:\n        return Verdict.OTHER_FORMAT\n",
        "",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_a_run_of_another_format_version_is_a_miss_for_every_key_and_left_alone",),
        "a run file of another format version is a miss and left alone, not deleted (D12)"),
    Mutant(
        "diskchaos-header-within-the-file", "src/kvport/connectors/offloading/tiers/disk/runs.py",
        "            or h > file_size):\n",
        "            ):\n",
        (f"{TESTS}/test_disk_hostile.py::test_huge_counts_are_bad_without_reading_them",),
        "a damaged count never makes the header parser read or allocate past the file"),
    Mutant(
        "diskchaos-evicts-until-the-ledger-fits", "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "            self.stats.add(evictions=len(eviction.keys))\n",
        "            self.stats.add(evictions=len(eviction.keys))\n            break\n",
        (f"{TESTS}/test_disk_shared.py::"
         "test_eviction_goes_on_until_the_shared_ledger_says_the_run_fits",),
        "eviction stops when the shared ledger, not this process's index, says the run fits"),
    Mutant(
        "diskchaos-lost-ledger-write-undoes-the-reserve", "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "        if entry.lost is not None:",
        "        if False:",
        (f"{TESTS}/test_disk_full.py::"
         "test_data_pages_full_from_the_first_store_skips_stores_and_they_resume",),
        "a reserve the ledger could not count is not written"),
    Mutant(
        "diskchaos-ledger-write-failure-is-not-raised", "src/kvport/connectors/offloading/tiers/disk/ledger.py",
        "                    except OSError as exc:\n                        entry.lost = exc\n",
        "                    except OSError as exc:\n                        raise\n",
        (f"{TESTS}/test_disk_full.py::"
         "test_data_pages_full_from_the_first_store_skips_stores_and_they_resume",),
        "a full file system makes a skipped store, never an OSError out of it"),
    Mutant(
        "diskchaos-ledger-gets-its-bytes-at-open", "src/kvport/connectors/offloading/tiers/disk/ledger.py",
        "                if os.fstat(fd).st_size < _USED.size:\n",
        "                if False:\n",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "the ledger's bytes are allocated at open, so a later full disk cannot fail its writes"),
    Mutant(
        "diskchaos-full-disk-at-start-is-no-refusal", "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "        if exc.errno in FULL_DISK:\n",
        "        if False:\n",
        (f"{TESTS}/test_disk_full.py::"
         "test_a_restart_on_a_full_file_system_serves_and_stores_resume",),
        "an engine restarted on a full disk starts and serves what the disk holds"),
    Mutant(
        "diskchaos-loads-close-runs-others-evicted", "src/kvport/connectors/offloading/tiers/disk/load.py",
        "        self.files.close_unlinked(SWEEP_EVERY_S)\n",
        "",
        (f"{TESTS}/test_disk_shared.py::test_runs_another_process_evicted_are_closed_by_loads_too",),
        "a process that only loads does not pin the space of runs others evicted"),
    Mutant(
        "diskchaos-unlinked-sweep-rate-limited", "src/kvport/connectors/offloading/tiers/disk/files.py",
        "            if now - self._swept < every_s:\n",
        "            if False:\n",
        (f"{TESTS}/test_disk_shared.py::"
         "test_a_sweep_of_unlinked_runs_is_not_repeated_within_its_interval",),
        "loads sweep the open runs at most every SWEEP_EVERY_S (a sweep costs ~0.1 ms)"),
    Mutant(
        "diskchaos-entry-checksum-checked", "src/kvport/connectors/offloading/tiers/disk/read.py",
        "        elif checksum(views[j]) != entries[k][2]:\n",
        "        elif False:\n",
        (f"{TESTS}/test_disk_chaos.py::"
         "test_power_loss_of_named_files_data_is_misses_never_wrong_bytes",
         f"{TESTS}/test_disk_tier.py::test_corrupt_entry_is_a_miss_and_removed"),
        "M3: a torn, zeroed or rotten entry is a miss, never wrong bytes (there is no fsync)"),
    Mutant(
        "diskchaos-symlink-never-followed", "src/kvport/connectors/offloading/tiers/disk/load.py",
        "_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK",
        "_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_a_symlink_at_a_name_is_never_followed_and_is_removed",),
        "a symlink planted at a key's name is never read through (D9)"),
    Mutant(
        "diskchaos-only-regular-files-are-runs", "src/kvport/connectors/offloading/tiers/disk/load.py",
        "            if not stat.S_ISREG(st.st_mode):\n                os.close(fd)\n",
        "            if False:\n                os.close(fd)\n",
        (f"{TESTS}/test_disk_hostile.py::test_a_fifo_at_a_name_neither_hangs_a_load_nor_a_store",),
        "a FIFO (or other non-file) at a key's name is a miss and removed (D9)"),
    Mutant(
        "diskchaos-store-removes-a-non-file-name", "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "            if not held:\n                self.ledger.remove_names([path])\n",
        "            if False:\n                self.ledger.remove_names([path])\n",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_a_symlink_at_a_name_is_never_followed_and_is_removed",),
        "a store replaces a symlink or FIFO at its key's name with its own entry"),
    Mutant(
        "diskchaos-scan-indexes-regular-files-only", "src/kvport/connectors/offloading/tiers/disk/location.py",
        "            if not stat.S_ISREG(st.st_mode):\n                return",
        "            if False:\n                return",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_a_symlink_at_a_name_is_never_followed_and_is_removed",),
        "the start's scan never indexes a symlink or FIFO as an entry"),
    Mutant(
        "diskchaos-another-users-directory-refused", "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "    if not group_access:\n",
        "    if False:\n",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "a namespace directory of another user is refused (its entries could be planted)"),
    Mutant(
        "diskchaos-wide-directory-narrowed", "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "        if mode & ~location.dir_mode:\n",
        "        if False:\n",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "our namespace directory with too wide a mode is narrowed to 0o700"),
    Mutant(
        "diskchaos-world-writable-directory-refused", "src/kvport/connectors/offloading/tiers/disk/setup.py",
        "    if mode & stat.S_IWOTH:\n",
        "    if False:\n",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_files_are_private_and_a_directory_anyone_could_plant_in_is_refused",),
        "even with group_access, a directory every user may write is refused"),
    Mutant(
        "diskchaos-dead-writers-temps-swept", "src/kvport/connectors/offloading/tiers/disk/location.py",
        "                if now - st.st_mtime > stale_temp_seconds or self._writer_dead(entry.name):",
        "                if now - st.st_mtime > stale_temp_seconds:",
        (f"{TESTS}/test_disk_chaos.py::"
         "test_kill_9_at_each_point_leaves_exact_entries_and_no_temp_file",),
        "a killed writer's temp file is removed (and uncounted) by the next process to start"),
    Mutant(
        "diskchaos-symlinked-key-directory-removed", "src/kvport/connectors/offloading/tiers/disk/location.py",
        "            if entry.is_symlink():\n",
        "            if False:\n",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_a_symlink_in_place_of_a_key_directory_is_removed_at_start",),
        "no load or store goes through a symlink planted in place of a key directory"),
    Mutant(
        "diskchaos-ledger-must-be-a-file", "src/kvport/connectors/offloading/tiers/disk/ledger.py",
        "            if not stat.S_ISREG(os.fstat(fd).st_mode):",
        "            if False:",
        (f"{TESTS}/test_disk_hostile.py::"
         "test_a_fifo_or_symlink_at_the_ledger_is_refused_at_start",),
        "a FIFO planted at the ledger is refused at start with a clear error"),
    # --- vllmid ---
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
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[dtype-bfloat16]",),
        "the model identity (the shared tiers' namespace) includes the dtype"),
    Mutant(
        "vllmid-identity-quantization", "src/kvport/vllm/identity.py",
        '        "quantization": getattr(mc, "quantization", None),\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[quantization-fp8]",),
        "the model identity (the shared tiers' namespace) includes the quantization"),
    Mutant(
        "vllmid-identity-load-format", "src/kvport/vllm/identity.py",
        '        "load_format": getattr(vllm_config.load_config, "load_format", None),\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[load_format-gguf]",),
        "the model identity (the shared tiers' namespace) includes the load format"),
    Mutant(
        "vllmid-identity-model-impl", "src/kvport/vllm/identity.py",
        '        "model_impl": getattr(mc, "model_impl", None),\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[model_impl-transformers]",),
        "the model identity (the shared tiers' namespace) includes the model impl"),
    Mutant(
        "vllmid-identity-code-revision", "src/kvport/vllm/identity.py",
        '        "code_revision": getattr(mc, "code_revision", None),\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[code_revision-v2]",),
        "the model identity (the shared tiers' namespace) includes the code revision"),
    Mutant(
        "vllmid-identity-kv-cache-dtype", "src/kvport/vllm/identity.py",
        '        "kv_cache_dtype": getattr(vllm_config.cache_config, "cache_dtype", None),\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[kv_cache_dtype-fp8]",),
        "the model identity (the shared tiers' namespace) includes the kv cache dtype"),
    Mutant(
        "vllmid-identity-hf-overrides", "src/kvport/vllm/identity.py",
        '        "hf_overrides": getattr(mc, "hf_overrides", None),\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[hf_overrides-value6]",),
        "the model identity (the shared tiers' namespace) includes the hf overrides"),
    Mutant(
        "vllmid-identity-loaded-config", "src/kvport/vllm/identity.py",
        '        "config": loaded_config(getattr(mc, "hf_config", None)),\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_each_setting_that_changes_the_kv_changes_the_identity[hf-value7]",),
        "the model identity (the shared tiers' namespace) includes the loaded config"),
    Mutant(
        "vllmid-identity-revision", "src/kvport/vllm/identity.py",
        '        return "|".join(["vllm-model-v2", name, self.revision or "-", '
        'self.weights_digest or "-",\n',
        '        return "|".join(["vllm-model-v2", name, "-", self.weights_digest or "-",\n',
        ("tests/vllm/test_vllm_identity.py::"
         "test_a_hub_id_missing_from_the_cache_is_identified_only_by_a_recorded_commit",),
        "the identity includes the resolved revision"),
    Mutant(
        "vllmid-identity-weights-digest", "src/kvport/vllm/identity.py",
        '        return "|".join(["vllm-model-v2", name, self.revision or "-", '
        'self.weights_digest or "-",\n',
        '        return "|".join(["vllm-model-v2", name, self.revision or "-", "-",\n',
        ("tests/vllm/test_vllm_identity.py::test_local_dirs_of_one_name_are_told_apart_by_their_weights",
         "tests/vllm/test_vllm_identity.py::test_a_directory_with_bin_weights_is_identified_by_their_content"),
        "the identity includes the weights' content digest (a local directory is not its name)"),
    Mutant(
        "vllmid-identity-snapshot-revision", "src/kvport/vllm/identity.py",
        "        revision = weights.name  # a Hugging Face cache snapshot is named by its commit\n",
        "        pass\n",
        ("tests/vllm/test_vllm_identity.py::test_a_hub_id_is_pinned_by_its_cached_snapshot",),
        "a hub id's revision is the commit of the cache snapshot its weights are read from"),
    Mutant(
        "vllmid-identity-recorded-commit", "src/kvport/vllm/identity.py",
        "    if isinstance(recorded, str) and FULL_HASH.fullmatch(recorded):\n",
        "    if False:\n",
        ("tests/vllm/test_vllm_identity.py::"
         "test_a_hub_id_missing_from_the_cache_is_identified_only_by_a_recorded_commit",),
        "the commit transformers recorded loading the config pins a hub id"),
    Mutant(
        "vllmid-identity-dummy-weights", "src/kvport/vllm/identity.py",
        '    if weights is None or str(load_format) == "dummy":\n',
        "    if weights is None:\n",
        ("tests/vllm/test_vllm_identity.py::test_dummy_weights_are_not_an_identity",),
        "dummy (random) weights are not identified by the checkpoint they were not read from"),
    Mutant(
        "vllmid-identity-needs-weight-files", "src/kvport/vllm/identity.py",
        "        if weights.is_dir() and not any(p.suffix in WEIGHT_SUFFIXES for p in "
        "weights.rglob(\"*\")\n",
        "        if False and not any(p.suffix in WEIGHT_SUFFIXES for p in weights.rglob(\"*\")\n",
        ("tests/vllm/test_vllm_identity.py::test_a_model_without_weights_shares_no_tier_unless_a_namespace_is_named",),
        "a directory without weight files does not identify the model"),
    Mutant(
        "vllmid-refuse-unidentified", "src/kvport/vllm/storage.py",
        "    if not identity.established and namespace is None:\n",
        "    if False:\n",
        ("tests/vllm/test_vllm_identity.py::test_a_model_without_weights_shares_no_tier_unless_a_namespace_is_named",),
        "shared tiers refuse a model that cannot be identified unless a namespace is named"),
    Mutant(
        "vllmid-namespace-in-geometry", "src/kvport/connectors/offloading/geometry.py",
        '            namespace += b"|namespace=" + config.namespace.encode()\n',
        "            pass\n",
        ("tests/offloading/test_geometry.py::"
         "test_a_configured_namespace_separates_the_shared_tiers_entries",
         "tests/vllm/test_vllm_identity.py::test_a_model_without_weights_shares_no_tier_unless_a_namespace_is_named"),
        "a configured namespace separates the shared tiers' entries (both engines)"),
    Mutant(
        "vllmid-policy-override", "src/kvport/vllm/storage.py",
        '    ktc.kv_load_failure_policy = "recompute"\n',
        "",
        ("tests/vllm/test_vllm_identity.py::test_a_shared_tier_sets_vllms_load_failure_policy_to_recompute",),
        "with shared tiers, vLLM's kv_load_failure_policy 'fail' is set to 'recompute'"),
    Mutant(
        "vllmid-policy-override-called", "src/kvport/vllm/connector.py",
        "                recompute_failed_loads(ktc, where)\n",
        "                pass\n",
        ("tests/vllm/test_vllm_identity.py::test_a_shared_tier_sets_vllms_load_failure_policy_to_recompute",),
        "the scheduler-side connector applies the policy before vLLM reads it"),
    Mutant(
        "vllmid-recording-carries-policy", "src/kvport/vllm/recording_inner.py",
        "        outer.kv_load_failure_policy = inner_ktc.kv_load_failure_policy\n",
        "        pass\n",
        ("tests/vllm/test_vllm_identity.py::test_the_recording_connector_carries_the_policy_to_vllm",),
        "a recorded connector's policy reaches the outer config vLLM's scheduler reads"),
    Mutant(
        "vllmid-disk-bytes-per-rank", "src/kvport/connectors/offloading/config.py",
        "        tiers = tuple(dataclasses.replace(t, max_bytes=max(1, t.max_bytes // tp_size))\n",
        "        tiers = tuple(dataclasses.replace(t, max_bytes=t.max_bytes)\n",
        ("tests/vllm/test_vllm_identity.py::test_each_tensor_parallel_rank_gets_its_share_of_the_budgets",),
        "the disk's max_bytes is the engine's: each tensor-parallel rank gets its share"),
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
    # --- redischaos ---
    Mutant(
        "redis-down-state-skips", "src/kvport/connectors/offloading/tiers/redis/node.py",
        "            if self._probing or time.monotonic() < self._down_until:\n"
        "                return None\n",
        "",
        (f"{TESTS}/test_redis_faults.py::"
         "test_a_half_open_connection_costs_one_timeout_then_skips",),
        "M5: while a server is down calls skip at once (one probe per backoff), never a wait each"),
    Mutant(
        "redis-header-namespace-checked", "src/kvport/connectors/offloading/tiers/value_format.py",
        "        if (ns != self.namespace_digest or kd != key_digest(key)",
        "        if (kd != key_digest(key)",
        (f"{TESTS}/test_redis_values.py::"
         "test_another_namespaces_value_under_this_name_is_a_miss_and_removed",),
        "M2: a value of another namespace under this name is never decoded"),
    Mutant(
        "redis-moved-followed", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "            self._run(moved, commands, results, deadline)\n",
        "",
        (f"{TESTS}/test_redis_cluster_chaos.py::test_a_moved_slot_is_followed_within_the_call",),
        "D6: a MOVED position goes to the slot's new owner within the same call"),
    Mutant(
        "redis-ask-followed", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "            self._run(asked, commands, results, deadline, asking=True)\n",
        "",
        (f"{TESTS}/test_redis_cluster_chaos.py::"
         "test_an_ask_during_a_slots_migration_is_followed_with_asking",),
        "D6: an ASK position goes once to the importing server behind ASKING"),
    Mutant(
        "redis-down-per-node", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "        node.health.down(f\"{self.url} ({node.name}): {why}\")\n",
        "        for other in (list(self._slots._nodes.values()) if self._slots else [node]):\n"
        "            other.health.down(f\"{self.url} ({node.name}): {why}\")\n",
        (f"{TESTS}/test_redis_cluster_chaos.py::test_a_dead_master_costs_its_slots_only",),
        "D6: one dead master costs its own slots' hits, not the whole tier's"),
    Mutant(
        "redis-unserved-slot-is-a-miss", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "            if node is None:\n                results[i] = _NO_MAP\n"
        "                unrouted += 1\n            else:\n"
        "                groups.setdefault(node, []).append(i)\n",
        "            groups.setdefault(node, []).append(i)  # type: ignore[arg-type]\n",
        (f"{TESTS}/test_redis_cluster_chaos.py::"
         "test_a_cluster_nobody_answers_is_a_miss_counted_and_down",
         f"{TESTS}/test_redis_cluster_chaos.py::"
         "test_slots_nobody_serves_miss_and_the_served_ones_hit"),
        "D1: a key whose slot nobody serves (or no map at all) is a miss, never an exception"),
    Mutant(
        "redis-load-batches-bounded", "src/kvport/connectors/offloading/tiers/redis/tier.py",
        "        for b in range(0, len(src.keys), per_batch):\n",
        "        per_batch = max(1, len(src.keys))\n"
        "        for b in range(0, len(src.keys), per_batch):\n",
        (f"{TESTS}/test_redis_values.py::"
         "test_a_load_larger_than_a_batch_goes_out_in_several_pipelines",),
        "D7: a promotion's GETs go out in batches of at most STORE_BATCH_BYTES"),
    Mutant(
        "redis-mac-checked", "src/kvport/connectors/offloading/tiers/value_format.py",
        "            return Verdict.OK if good else Verdict.FORGED\n",
        "            return Verdict.OK\n",
        (f"{TESTS}/test_redis_values.py::"
         "test_a_value_without_a_valid_mac_is_a_miss_counted_and_removed[tampered payload]",),
        "D10: with a MAC key, a value without a valid MAC is never decoded"),
    Mutant(
        "redis-wrongtype-removed", "src/kvport/connectors/offloading/tiers/redis/tier.py",
        "                if why in (\"corrupt\", \"forged\", \"wrong_type\"):\n",
        "                if why in (\"corrupt\", \"forged\"):\n",
        (f"{TESTS}/test_redis_values.py::test_a_wrongtype_key_is_a_miss_and_removed",),
        "D12: a WRONGTYPE key under a kvport name is removed (else it fails every load)"),
    Mutant(
        "redis-other-format-left-alone", "src/kvport/connectors/offloading/tiers/value_format.py",
        "        if version != FORMAT_VERSION or hsize not in (HEADER.size, HEADER.size + "
        "MAC_BYTES):\n            return Verdict.OTHER_FORMAT\n",
        "        if version != FORMAT_VERSION or hsize not in (HEADER.size, HEADER.size + "
        "MAC_BYTES):\n            return Verdict.BAD\n",
        (f"{TESTS}/test_redis_values.py::test_another_format_version_is_a_miss_and_left_alone",),
        "D12: a value of another format version is a miss and left for its readers"),
    Mutant(
        "redis-config-entry-redacted", "src/kvport/connectors/offloading/config.py",
        "                         f\"got {redacted(entry)!r}\")\n",
        "                         f\"got {entry!r}\")\n",
        (f"{TESTS}/test_offloading_config.py::test_no_config_error_shows_a_password",),
        "D11: a bad tier entry's error shows its URL without the password"),
    Mutant(
        "redis-config-url-redacted", "src/kvport/connectors/offloading/config.py",
        "            shown = redacted_url(url) if isinstance(url, str) else url\n",
        "            shown = url\n",
        (f"{TESTS}/test_redis_values.py::test_no_redis_tier_config_error_shows_a_password",),
        "D11: a bad URL's error shows it without the password"),
    Mutant(
        "redis-tenant-prefix", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "        tenant = config.tenant.encode() + b\":\" if config.tenant else b\"\"\n",
        "        tenant = b\"\"\n",
        (f"{TESTS}/test_redis_values.py::"
         "test_a_tenants_keys_carry_its_prefix_and_an_acl_scopes_them",),
        "D10: a tenant's keys carry its name first, so an ACL key pattern scopes them"),
    Mutant(
        "redis-tenant-salt-env", "src/kvport/connectors/offloading/tiers/redis/client.py",
        "        salt = _env(config, \"tenant_salt_env\", \"the tenant salt\") or "
        "config.tenant_salt\n",
        "        salt = config.tenant_salt\n",
        (f"{TESTS}/test_redis_values.py::"
         "test_tenant_salt_env_names_the_salt_and_no_message_shows_it",),
        "D10: the salt read from tenant_salt_env is part of the namespace"),
    Mutant(
        "redis-redirects-counted", "src/kvport/connectors/offloading/metrics.py",
        "    redirects: int = 0  # positions a cluster sent elsewhere",
        "    _no_redirects: int = 0  # positions a cluster sent elsewhere",
        (f"{TESTS}/test_redis_cluster_chaos.py::"
         "test_a_moved_slot_is_followed_within_the_call",),
        "the worker tier counts redirects (without the field a MOVED raised AttributeError)"),
    Mutant(
        "redis-whole-call-deadline", "src/kvport/connectors/offloading/tiers/redis/node.py",
        "        alarm = WATCHDOG.arm(deadline, lambda: _shut_down(conn))  # the blocked read "
        "fails\n",
        "        alarm = WATCHDOG.arm(deadline + 3600.0, lambda: _shut_down(conn))\n",
        (f"{TESTS}/test_redis_faults.py::"
         "test_a_trickled_reply_is_cut_at_the_whole_calls_deadline",),
        "a reply trickling in within each socket timeout is still cut at the call's deadline"),
    # --- sim ---
    Mutant(
        "sim-fence-wait", "src/kvport/connectors/offloading/worker/half.py",
        "            submitter.router.wait([k for k in submitter.in_flight if k.stage is Stage.COPY\n"
        "                                   and k.job_id in meta.jobs_to_flush])\n",
        "            pass\n",
        (f"{SIM}::test_seeds_that_preempt_a_request_with_stores_in_flight[40]",
         f"{SIM}::test_seeds_that_preempt_a_request_with_stores_in_flight[43]"),
        "the simulation finds the preemption race by itself (a store reads reused blocks: torn)"),
    Mutant(
        "sim-failed-copy-reported", "src/kvport/connectors/offloading/worker/loads.py",
        "            load.engine_failed += [load.copy_dst[i] for i in result.failed_indices]\n",
        "            pass\n",
        (f"{SIM}::test_seeds_with_failed_copies_into_the_engine[29]",),
        "the simulation's failed HOST->ENGINE copies are recomputed (else wrong tokens)"),
    Mutant(
        "sim-late-load-reported", "src/kvport/connectors/offloading/worker/half.py",
        "                late.add(loads.give_up(job_id))\n",
        "                loads.give_up(job_id)\n",
        (f"{SIM}::test_ci_seed[7]", f"{SIM}::test_ci_seed[9]"),
        "a load stuck in a promotion reports its request at load_timeout_s (else it hangs)"),
]


def check_applicable(mutants: list[Mutant]) -> list[str]:
    """Problems that make mutants inapplicable: missing files, old text not exactly once."""
    problems = []
    for m in mutants:
        path = REPO / m.path
        if not path.is_file():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        count = path.read_text().count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its old text occurs {count} times in {m.path} (need 1)")
        if not m.tests:
            problems.append(f"{m.name}: no tests")
    names = [m.name for m in mutants]
    problems += [f"duplicate mutant name {n}" for n in sorted({n for n in names
                                                               if names.count(n) > 1})]
    return problems


def check_imports(src: Path, env: dict[str, str]) -> None:
    """The mutated copy is what the tests import, here and in a spawned worker process."""
    probe = ("import multiprocessing as mp, kvport\n"
             "def where(q):\n    import kvport; q.put(kvport.__file__)\n"
             "if __name__ == '__main__':\n"
             "    q = mp.get_context('spawn').Queue()\n"
             "    p = mp.get_context('spawn').Process(target=where, args=(q,)); p.start()\n"
             "    print(kvport.__file__); print(q.get(timeout=60)); p.join()\n")
    script = src.parent / "probe_imports.py"
    script.write_text(probe)
    out = subprocess.run([sys.executable, str(script)], check=False, env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    found = out.stdout.split()
    if out.returncode or len(found) != 2 or not all(f.startswith(str(src)) for f in found):
        raise SystemExit(f"mutation_check: the tests would not import the mutated copy under "
                         f"{src}: {out.stdout!r} {out.stderr[-1000:]!r}")


# Third-party modules the tests import, loaded once in each job's zygote. Without them a
# mutant's pytest run spends about 7 of its 9 seconds starting up (torch alone, with the
# torch._dynamo that torch.nn.attention pulls in, is 2-3 s); with them it forks ready.
PRELOAD = ("numpy", "torch", "torch.nn.functional", "torch.nn.attention.bias", "safetensors.torch",
           "tokenizers", "xxhash", "redis", "psutil", "pytest", "multiprocessing",
           "concurrent.futures", "ctypes", "mmap")  # not hypothesis: pytest rewrites its plugin


def serve() -> int:
    """The zygote (`--serve`): import PRELOAD, then for each request line on stdin (JSON:
    pytest args and a log path) fork a child that runs pytest with stdout and stderr in the log,
    and answer with its exit code. kvport itself is never imported here: each child imports the
    copy that holds its mutant (PYTHONPATH)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the tests that need it fail in the child, as they would without a zygote
    assert "kvport" not in sys.modules, "the zygote must not import kvport (the copies do)"
    # torch starts its thread pools at first use, not at import: nothing runs here yet, so a
    # fork copies a process with one thread.
    assert threading.active_count() == 1, f"zygote has threads: {threading.enumerate()}"
    # What is loaded now stays: a child's collections (pytest runs five at its end) skip it.
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pid = os.fork()
        if pid == 0:  # the child: one pytest run, then out without the zygote's cleanup
            code = 3
            try:
                # A mutant whose tests hang (a loop its guard ended) is stopped, not waited on
                # forever: the default SIGALRM action ends the child (run_mutant: killed).
                signal.alarm(MUTANT_LIMIT_S)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                import pytest
                code = int(pytest.main(request["args"]))
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(log)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


class Zygote:
    """A `--serve` process with one job's environment (its copy on PYTHONPATH)."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.log = log_dir / "pytest.log"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=REPO, text=True)

    def pytest(self, args: list[str]) -> tuple[int, str]:
        """pytest's exit code and output for args, run in a fresh fork."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"args": args, "log": str(self.log)}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"mutation_check: the zygote {self.proc.pid} died "
                             f"(exit {self.proc.wait()})")
        return int(json.loads(answer)["code"]), self.log.read_text(errors="replace")

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_mutant(m: Mutant, src: Path, zygote: Zygote) -> tuple[str, float, str]:
    """(outcome, seconds, the failure lines of the test run)."""
    target = src.parent / m.path
    original = target.read_text()
    target.write_text(original.replace(m.old, m.new, 1))
    start = time.monotonic()
    try:
        code, output = zygote.pytest(["-x", "-q", "-p", "no:cacheprovider", *m.tests])
    finally:
        target.write_text(original)
    seconds = time.monotonic() - start
    lines = output.strip().splitlines()
    failures = "\n".join(f"    {line}" for line in lines if line.startswith(("E ", "FAILED")))
    if code == 0:
        return "SURVIVED", seconds, ""
    if code == 1:  # tests ran and failed
        return "killed", seconds, failures
    if code == -signal.SIGALRM:  # they hung: the guard is what ended them
        return "killed", seconds, f"    (no result within {MUTANT_LIMIT_S} s: the tests hung)"
    tail = "\n".join(f"    {line}" for line in lines[-8:])
    return f"ERROR (pytest exit {code})", seconds, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--why", action="store_true", help="print how each killed mutant failed")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="mutants tested at once, each in a copy of src/ of its own")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a zygote
    args = parser.parse_args(argv)
    if args.serve:
        return serve()
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    mutants = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
        if unknown:
            print(f"unknown mutant(s) {unknown}; see --list", file=sys.stderr)
            return 2
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        width = max(len(m.name) for m in mutants)
        for m in mutants:
            print(f"{m.name:<{width}}  {m.path}: {m.why}")
        return 0
    problems = check_applicable(mutants)
    if problems:
        print("mutation_check: cannot apply:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    results: list[tuple[Mutant, str, float]] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvport-mutants-") as tmp, \
            contextlib.ExitStack() as zygotes:
        # One copy of src/ per job: a copy holds one mutant at a time, and a zygote forks
        # the copy's pytest runs.
        copies: queue.SimpleQueue[tuple[Path, Zygote]] = queue.SimpleQueue()
        for j in range(args.jobs):
            src = Path(tmp) / f"job{j}" / "src"
            shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
            env = {**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"}
            if args.jobs > 1:  # jobs side by side: one thread each, or the cores thrash
                env["OMP_NUM_THREADS"] = "1"
            check_imports(src, env)
            zygote = Zygote(env, src.parent)
            zygotes.callback(zygote.close)
            copies.put((src, zygote))

        def run_in_a_copy(m: Mutant) -> tuple[str, float, str]:
            src, zygote = copies.get()
            try:
                return run_mutant(m, src, zygote)
            finally:
                copies.put((src, zygote))

        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(run_in_a_copy, m): m for m in mutants}
            for future in as_completed(futures):
                m = futures[future]
                outcome, seconds, details = future.result()
                results.append((m, outcome, seconds))
                print(f"{outcome:<9} {seconds:6.1f}s  {m.name}", flush=True)
                if details and (args.why or outcome != "killed"):
                    print(details, flush=True)
    bad = [m.name for m, outcome, _ in results if outcome != "killed"]
    print(f"{len(results) - len(bad)}/{len(results)} mutants killed in "
          f"{time.monotonic() - start:.0f}s" + (f"; not killed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
