"""Mutants of the OffloadingConnector's KV cache events (scheduler/block_events.py and the tiers'
reports) and of a request's own limits (kv_transfer_params): each removes one guard, and the
tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

EVENTS = "tests/offloading/test_kv_events_tiers.py"
PARAMS = "tests/offloading/test_transfer_params.py"
HOST_DISK = f"{EVENTS}::test_host_and_disk_events_match_the_tiers_after_evictions_and_a_reset"
REDIS = (f"{EVENTS}::test_redis_events_match_redis_and_a_value_redis_lost_is_announced_once_"
         "found_gone")
BLOCK_EVENTS = "src/kvport/connectors/offloading/scheduler/block_events.py"
HITS = "src/kvport/connectors/offloading/scheduler/hits.py"
STORES = "src/kvport/connectors/offloading/scheduler/stores.py"
LIMITS = "src/kvport/connectors/transfer_params.py"

MUTANTS: list[Mutant] = [
    # ---- events: what a router replays is what each tier holds ---------------------------------
    Mutant(
        "events-stored-once-per-tier", BLOCK_EVENTS,
        "            if desc is None or content is None or medium in self._held.get(key, ()):\n",
        "            if desc is None or content is None:\n",
        (HOST_DISK, REDIS),
        "a tier announces a block once while it holds it (a store found present says nothing new)"),
    Mutant(
        "events-removal-of-held-only", BLOCK_EVENTS,
        "            if not held or medium not in held or desc is None:\n",
        "            if desc is None:\n",
        (HOST_DISK, REDIS),
        "a removal names only blocks the tier was announced to hold"),
    Mutant(
        "events-one-run-per-event", BLOCK_EVENTS,
        "            if run and not self._continues(run[-1], key):\n",
        "            if False:\n",
        (f"{EVENTS}::test_one_stored_event_per_run_of_consecutive_blocks",),
        "a stored event is one run of consecutive blocks (its parent is its first block's)"),
    Mutant(
        "events-off-keeps-nothing", BLOCK_EVENTS,
        "        if not self.enabled:\n            return\n        f, bs = ",
        "        f, bs = ",
        (f"{EVENTS}::test_one_stored_event_per_run_of_consecutive_blocks",),
        "without a reader of events nothing is described (no memory, no cost)"),
    Mutant(
        "events-disk-eviction-announced", "src/kvport/connectors/offloading/tiers/disk/tier.py",
        "            self.dropped.add(list(eviction.keys))\n",
        "",
        (HOST_DISK,),
        "the disk tier's evictions are announced as removals"),
    Mutant(
        "events-redis-found-gone", "src/kvport/connectors/offloading/tiers/redis/lookup.py",
        "        self.absent.add([k for k, r in zip(keys, replies) if type(r) is int and r == 0])\n",
        "",
        (REDIS,),
        "a Redis value found gone (Redis dropped it) is announced as removed"),
    Mutant(
        "events-redis-error-is-not-gone", "src/kvport/connectors/offloading/tiers/redis/lookup.py",
        "if type(r) is int and r == 0])\n",
        "if r != 1])\n",
        (f"{EVENTS}::test_only_redis_saying_no_is_a_removal",),
        "an error or a timeout says nothing about a Redis value: only a 0 is a removal"),
    Mutant(
        "events-write-through-announced", "src/kvport/connectors/offloading/worker/stores.py",
        "        if held.keys:\n            self.submitter.changes.append(held)\n",
        "",
        (HOST_DISK, REDIS),
        "what a write-through wrote is announced as stored in that tier"),
    # ---- a request's own limits ----------------------------------------------------------------
    Mutant(
        "limits-max-load-tokens", HITS,
        "            groups = tuple(ks[:last] for ks in groups)\n",
        "",
        (f"{PARAMS}::test_max_load_tokens_caps_a_hit_at_a_block_boundary",),
        "a hit covers at most max_load_tokens beyond the engine's own"),
    Mutant(
        "limits-max-offload-tokens", STORES,
        "            num_tokens_done = min(num_tokens_done, st.limits.max_offload_tokens)\n",
        "            pass\n",
        (f"{PARAMS}::test_max_offload_tokens_stores_only_the_first_tokens",),
        "only blocks within max_offload_tokens are stored"),
    Mutant(
        "limits-no-store-tiers", STORES,
        " or not st.hashes_ok or not st.limits.stores:\n",
        " or not st.hashes_ok:\n",
        (f"{PARAMS}::test_store_tiers_keep_a_request_off_the_shared_tiers",),
        "kv_store_tiers=[] (or max_offload_tokens=0) stores nothing"),
    Mutant(
        "limits-store-tiers", STORES,
        "                  if st.limits.stores_to(medium)]\n",
        "                  ]\n",
        (f"{PARAMS}::test_store_tiers_keep_a_request_off_the_shared_tiers",),
        "a request's blocks are written through only to the tiers it names"),
    Mutant(
        "limits-load-tiers-host", HITS,
        "        if num_host and not limits.loads_from(HOST):\n",
        "        if False:\n",
        (f"{PARAMS}::test_load_tiers_choose_where_a_hit_may_come_from",),
        "no hit from host memory for a request whose kv_load_tiers leave it out"),
    Mutant(
        "limits-load-tiers-lower", HITS,
        "            if cut is not None:  # the run ends at a block of a tier the request does",
        "            if False:  # the run ends at a block of a tier the request does",
        (f"{PARAMS}::test_load_tiers_choose_where_a_hit_may_come_from",),
        "no hit from a lower tier a request's kv_load_tiers leave out"),
    Mutant(
        "limits-unreadable-run-untouched", "src/kvport/connectors/offloading/scheduler/requests.py",
        "                limits = NOTHING\n",
        "                limits = NO_LIMITS\n",
        (f"{PARAMS}::test_a_request_the_connector_cannot_read_neither_loads_nor_stores",),
        "a request whose limits cannot be read neither loads nor stores"),
    Mutant(
        "limits-bool-is-not-a-count", LIMITS,
        "    if isinstance(value, bool) or not isinstance(value, int) or value < 0:\n",
        "    if not isinstance(value, int) or value < 0:\n",
        (f"{PARAMS}::test_a_bad_value_is_an_error_naming_it",),
        "True is not a token count"),
    Mutant(
        "limits-negative-count", LIMITS,
        " or not isinstance(value, int) or value < 0:\n",
        " or not isinstance(value, int):\n",
        (f"{PARAMS}::test_a_bad_value_is_an_error_naming_it",),
        "a token count is >= 0"),
    Mutant(
        "limits-store-tiers-name-host", LIMITS,
        "        if store and \"HOST\" not in store:\n",
        "        if False:\n",
        (f"{PARAMS}::test_a_bad_value_is_an_error_naming_it",),
        "host memory stages every store: a store tier list without it is refused"),
    Mutant(
        "limits-unknown-medium", LIMITS,
        "    if medium is not None and (not isinstance(medium, str) or medium.upper() not in _MEDIUMS):\n",
        "    if False:\n",
        (f"{PARAMS}::test_a_bad_value_is_an_error_naming_it",),
        "an unknown medium in a tier matcher is refused, not matched to nothing"),
    # ---- decision metrics ----------------------------------------------------------------------
    Mutant(
        "decisions-first-admission-only", "src/kvport/connectors/offloading/scheduler/half.py",
        "        if old is None:  # a first admission (not a preempted request's return)\n",
        "        if True:\n",
        ("tests/offloading/test_decisions.py::test_a_preempted_request_counts_its_prompt_once",),
        "a prompt's tokens are counted by source once, not again when a preempted request returns"),
    Mutant(
        "decisions-present-blocks", "src/kvport/connectors/offloading/scheduler/stores.py",
        "        self.decisions.host_present_blocks += (len(wanted) - len(out.keys_to_store)\n"
        "                                               - len(out.deferred_keys))\n",
        "",
        ("tests/offloading/test_decisions.py::"
         "test_prompt_tokens_by_source_add_up_and_store_outcomes_are_counted",),
        "blocks offered to the host tier that it held already are counted as present"),
    Mutant(
        "observations-kept-once-read", "src/kvport/connectors/offloading/scheduler/decisions.py",
        "        if not self.read:\n            return\n",
        "",
        ("tests/offloading/test_decisions.py::"
         "test_observations_are_bounded_between_takes_and_kept_only_once_read",),
        "no measurement is kept for a reader that never came (kvport's engine: a soak's growth)"),
]
