"""Mutants of the claim rules (trace/claim_rules.py, trace/identity.py) and of what the recorders
write for them: each removes one guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

RULES = "tests/trace/test_claim_rules.py"
ENGINE = "tests/trace/test_claims_in_engine.py"
CLAIMS = "src/kvport/trace/claim_rules.py"

MUTANTS: list[Mutant] = [
    Mutant(
        "match-answer-never-negative", "src/kvport/trace/scheduler_rules.py",
        "            elif isinstance(answer[0], int) and answer[0] < 0:\n",
        "            elif False:\n",
        ("tests/trace/test_checker.py::test_scheduler_contract_breaks_are_flagged",),
        "a negative match count is S3 (vLLM's ExampleConnector answers -128)"),
    Mutant(
        "claim-blocks-must-be-handed", CLAIMS,
        "            if names.hashes[j] in self.by_hash:\n",
        "            if True:\n",
        (f"{RULES}::test_a_claim_beyond_the_first_chunk_of_a_chunked_prompt_is_c1",
         f"{ENGINE}::test_a_connector_that_claims_what_it_was_only_asked_about_is_c1"),
        "a claimed block must have been computed with the connector attached"),
    Mutant(
        "claim-handed-only-up-to-computed", CLAIMS,
        "        full = min(end // names.block_size, len(names.hashes))\n",
        "        full = len(names.hashes)\n",
        (f"{RULES}::test_a_claim_beyond_the_first_chunk_of_a_chunked_prompt_is_c1",),
        "only the blocks a step computed are handed, not the whole prompt"),
    Mutant(
        "claim-salt-boundary", CLAIMS,
        "            if other is not None and (other.salt, other.lora) != (names.salt, "
        "names.lora):\n",
        "            if False:\n",
        (f"{RULES}::test_a_hit_across_a_salt_is_c2_and_names_both",
         f"{RULES}::test_a_hit_across_a_lora_is_c2"),
        "a hit on tokens computed under another salt or LoRA is told apart (C2)"),
    Mutant(
        "claim-judged-only-when-all-stores-seen", CLAIMS,
        "            if not self.judged:\n",
        "            if False:\n",
        (f"{RULES}::test_a_store_others_may_write_is_not_judged_and_a_note_says_so",),
        "a store others may write is not judged: a note, not a violation"),
    Mutant(
        "claim-partial-block-not-judged", CLAIMS,
        "        first, end = -(-local // bs), min((local + tokens) // bs, len(names.hashes))\n",
        "        first, end = -(-local // bs), min(-(-(local + tokens) // bs), "
        "len(names.hashes))\n",
        (f"{RULES}::test_the_block_a_claim_ends_inside_and_the_local_blocks_are_not_judged",),
        "the block a claim ends inside is not judged (never hashed by the engine)"),
    Mutant(
        "blocks-recorded-once", "src/kvport/trace/identity.py",
        "    state.recorded = upto\n",
        "    pass\n",
        (f"{RULES}::test_blocks_are_recorded_once_in_bounded_records",),
        "a request's blocks are written once"),
    Mutant(
        "recorder-private-store-is-judged", "src/kvport/connectors/recording.py",
        "        if header is not None and (inner.holds_only_what_it_was_handed()\n",
        "        if header is not None and (False\n",
        (f"{ENGINE}::test_kvports_offloading_connector_is_judged_and_keeps_its_claims",),
        "a connector with a private store is judged (its recorder says it sees all its stores)"),
    Mutant(
        "load-distance-judged", "src/kvport/trace/loaded.py",
        "            if float(distance) > MAX_DISTANCE:\n",
        "            if float(distance) > 1.0:\n",
        ("tests/trace/test_load_rule.py::test_rounding_is_not_c3_and_a_later_bad_load_is",),
        "a loaded block far from its computed KV is C3"),
    Mutant(
        "load-unjudged-not-a-violation", "src/kvport/trace/loaded.py",
        "            if distance is None:\n                self.unjudged += 1\n"
        "                continue\n",
        "            if distance is None:\n                distance = 1.0\n",
        ("tests/trace/test_load_rule.py::"
         "test_blocks_never_seen_computed_are_not_judged_and_a_note_counts_them",),
        "a block never seen computed is not judged: a note, not a violation"),
    # ---- the vllm-mrv2 profile (trace/worker_rules.py) -------------------------------------------
    Mutant(
        "mrv2-finish-forward-after-the-layers", "src/kvport/trace/worker_rules.py",
        "        self.hooks([i for i in layers if i > ff], ",
        "        self.hooks([], ",
        ("tests/trace/test_profile_mrv2.py::test_mrv2_rules[ff-between-layers]",
         "tests/trace/test_profile_mrv2.py::test_mrv2_rules[ff-before-forward]"),
        "under vllm-mrv2 finish_forward comes after every layer hook of the target forward"),
    Mutant(
        "finish-forward-only-under-mrv2", "src/kvport/trace/worker_rules.py",
        "        if not self.profile.finish_forward:\n",
        "        if False:\n",
        ("tests/trace/test_profile_mrv2.py::test_an_mrv2_trace_passes_under_its_header_and_fails_w10_under_vllm_0_32",),
        "a finish_forward under legacy or vllm-0.32 is W10: the trace is Model Runner V2's"),
    Mutant(
        "mrv2-drafter-defers-the-save", "src/kvport/trace/worker_rules.py",
        "        deferred = (self.profile.finalize_after_drafter and finished is not None\n",
        "        deferred = (False and finished is not None\n",
        ("tests/trace/test_profile_mrv2.py::test_an_mrv2_trace_passes_under_its_header_and_fails_w10_under_vllm_0_32",),
        "with a drafter, MRV2's wait_for_save follows the draft forward (after get_finished)"),
]
