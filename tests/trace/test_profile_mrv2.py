"""The vllm-mrv2 profile: vLLM's Model Runner V2 (vLLM 0.33's default GPU runner, 0.34's only one)
calls finish_forward after the forward and, with a drafter, defers wait_for_save past the draft
model's forward. Hand-made traces: MRV2's order passes under its header, a break of an
MRV2-only rule fails, and the older profiles judge the same steps as they did."""

from __future__ import annotations

import pytest
from test_profiles import (
    ASYNC_FORWARD,
    HEAD,
    LAYERS,
    NO_FORWARD,
    SYNC_FORWARD,
    TAIL,
    header,
    moved_before,
    rules,
    steps,
    swap,
)

from kvport.trace.checker import check_trace
from kvport.trace.events import TraceEvent

MRV2_HEADER = {"engine": "vllm", "version": "0.34.0", "call_order": "vllm-mrv2"}
# gpu/kv_connector.py (vLLM 0.34): pre_forward, the forward, finish_forward, post_forward
MRV2_ASYNC = HEAD + LAYERS + ["finish_forward", "start_load_kv=0"] + TAIL
MRV2_SYNC = HEAD + ["start_load_kv=1"] + LAYERS + ["finish_forward"] + TAIL
MRV2_NO_FORWARD = HEAD + ["finish_forward", "start_load_kv=0"] + TAIL  # no_forward()
# With a drafter: post_forward(defer_finalize=True) collects the results, the draft model's
# forward calls its own layers' hooks, then finalize_step: wait_for_save, clear_connector_metadata.
DRAFT_LAYERS = ["wait_for_layer_load:draft.0", "save_kv_layer:draft.0"]
_COLLECT = [c for c in TAIL if c not in ("wait_for_save", "clear_connector_metadata")]
MRV2_DRAFTER = (HEAD + LAYERS + ["finish_forward", "start_load_kv=0"] + _COLLECT
                + DRAFT_LAYERS + ["wait_for_save", "clear_connector_metadata"])
MRV2_SYNC_DRAFTER = (HEAD + ["start_load_kv=1"] + LAYERS + ["finish_forward"] + _COLLECT
                     + DRAFT_LAYERS + ["wait_for_save", "clear_connector_metadata"])


def mrv2(trace: list[TraceEvent]) -> list[TraceEvent]:
    return [header(MRV2_HEADER)] + trace


def test_an_mrv2_trace_passes_under_its_header_and_fails_w10_under_vllm_0_32() -> None:
    trace = steps(MRV2_ASYNC, MRV2_NO_FORWARD, MRV2_SYNC, MRV2_DRAFTER, MRV2_SYNC_DRAFTER)
    assert check_trace(mrv2(trace)) == []
    assert check_trace(trace, "vllm-mrv2") == []
    # vLLM 0.32's runner has no finish_forward, and saves before get_finished
    found = check_trace(trace, "vllm-0.32")
    assert [v.step for v in found if v.rule == "W10"] == [0, 1, 2, 3, 4]
    assert "finish_forward in a vllm-0.32 step: that order has no such hook (Model Runner V2's " \
        "has: --profile vllm-mrv2)" in found[0].message
    drafter = {v.rule for v in found if v.step in (3, 4)}
    assert drafter == {"W4", "W5", "W10"}


def test_vllm_0_32_steps_pass_under_mrv2_finish_forward_is_optional() -> None:
    # a recorder that does not see finish_forward (a MultiConnector's child, an older recorder)
    trace = steps(ASYNC_FORWARD, NO_FORWARD, SYNC_FORWARD)
    assert check_trace(trace, "vllm-mrv2") == check_trace(trace, "vllm-0.32") == []


@pytest.mark.parametrize("calls, found", [
    # finish_forward: after the forward (every target layer hook), before get_finished
    (moved_before(MRV2_ASYNC, "finish_forward", "wait_for_layer_load:layers.1"), ["W10"]),
    (moved_before(MRV2_ASYNC, "finish_forward", "wait_for_layer_load:layers.0"), ["W10"]),
    (swap(MRV2_NO_FORWARD, "finish_forward", "start_load_kv=0"), ["W10"]),
    (moved_before(MRV2_NO_FORWARD, "finish_forward", "bind_connector_metadata"), ["W10", "W2"]),
    (moved_before(MRV2_NO_FORWARD, "finish_forward", "get_block_ids_with_load_errors"),
     ["W10", "W10", "W10"]),  # after start_load_kv, wait_for_save, get_finished
    (moved_before(MRV2_ASYNC, "finish_forward", "start_load_kv=0") + ["finish_forward"],
     ["W9", "W10"]),
    (moved_before(MRV2_SYNC, "start_load_kv=1", "wait_for_save"), ["W4", "W10"]),
    # a drafter's deferred wait_for_save: after build_connector_worker_meta, not between
    (moved_before(MRV2_DRAFTER, "wait_for_save", "get_block_ids_with_load_errors"),
     ["W5", "W5"]),  # before the draft hooks, and before build_connector_worker_meta
    (moved_before(MRV2_DRAFTER, "wait_for_layer_load:draft.0", "get_kv_connector_stats"),
     ["W4"]),
    (swap(MRV2_DRAFTER, "save_kv_layer:draft.0", "wait_for_save"), ["W5"]),
    # without a wait_for_save, hooks after get_finished are not a drafter's
    ([c for c in MRV2_DRAFTER if c != "wait_for_save"], ["W4", "W4", "W10", "W5"]),
], ids=["ff-between-layers", "ff-before-forward", "ff-after-deferred-load", "ff-before-bind",
        "ff-after-finished", "two-ff", "sync-load-after-ff", "drafter-save-between",
        "draft-hook-before-meta", "draft-hook-after-save", "drafter-no-save"])
def test_mrv2_rules(calls: list[str], found: list[str]) -> None:
    trace = steps(calls)
    assert rules(trace, "vllm-mrv2") == found, check_trace(trace, "vllm-mrv2")
