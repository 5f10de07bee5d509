"""What a connector's loads bring back (rule C3) and what a composite reports finished (S7),
inside vLLM's CPU build (run_claims.py: SmolLM2-135M, float32, the recorder judging):

- a planted connector that stores late (trace_connectors.LateStoreExample: the ExampleConnector
  with each step's saves run at the end of the next step) on a workload whose first request
  finishes at once and whose blocks go to the next one: a later hit loads the other request's KV
  (C3, at the load, with its step, request and block), and nothing else notices; vLLM's own
  ExampleConnector and kvport's OffloadingConnector on the same workload load exactly what was
  computed, every loaded block judged;
- vLLM's MultiConnector over the ExampleConnector and a child that reports the zero-token
  allocation of a non-chosen child as a finished load (trace_connectors.ZeroLoadRecvExample):
  the composite's recorder reports the load nobody started (S7, at update_connector_output, with
  its step and request) before vLLM's scheduler stops on its assert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from claim_jobs import OFFLOADING, example, run_all
from engine_pool import EnginePool

# a: 400 tokens, done after one step; b: 896 tokens, given most of a's freed blocks in a 9-block
# pool; c: a again, once b is done (block 0 still in vLLM's prefix cache, the rest from the store)
A_PROMPT = [(t * 7) % 500 + 3 for t in range(400)]
B_PROMPT = [(t * 11) % 500 + 5 for t in range(896)]
REUSED = {"steps": [[{"id": "a", "prompt": A_PROMPT, "max_tokens": 1}],
                    [{"id": "b", "prompt": B_PROMPT, "max_tokens": 2}],
                    [{"id": "c", "prompt": A_PROMPT, "max_tokens": 2}]],
          "num_gpu_blocks": 9, "max_num_batched_tokens": 1024}
ONE_PROMPT = {"steps": [[{"id": "a", "prompt": A_PROMPT}]]}


def zero_load_multi(tmp: Path) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {**example(tmp / "a"), "kv_role": "kv_both"},
        {**example(tmp / "b", "ZeroLoadRecvExample"), "kv_role": "kv_both"}]}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         engine_pool: EnginePool) -> dict[str, dict[str, Any]]:
    return run_all(engine_pool, tmp_path_factory, {
        "late_reused": (REUSED, "LateStoreExample"),
        "example_reused": (REUSED, "ExampleConnector"),
        "offloading_reused": (REUSED, OFFLOADING),
        "zero_load_multi": (ONE_PROMPT, zero_load_multi)})


def test_a_store_that_reads_blocks_after_they_were_given_to_another_request_is_c3(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["late_reused"]
    assert "error" not in run, run.get("traceback")  # nothing crashed: only C3 sees it
    rules = [v["rule"] for v in run["violations"]]
    assert rules and set(rules) == {"C3"}, run["violations"]
    c3 = run["violations"][0]
    assert c3["req_id"].startswith("c-") and c3["step"] is not None
    assert "the load of block 1" in c3["message"]
    assert max(d for d in run["loaded"] if d is not None) > 0.5


@pytest.mark.parametrize("name", ["example_reused", "offloading_reused"])
def test_connectors_that_store_in_time_load_what_was_computed(
        runs: dict[str, dict[str, Any]], name: str) -> None:
    run = runs[name]
    assert "error" not in run, run.get("traceback")
    assert run["violations"] == [] and run["notes"] == []
    assert len(run["loaded"]) >= 2 and None not in run["loaded"]  # every loaded block judged
    assert max(run["loaded"]) <= 0.001


def test_a_composite_that_reports_a_load_nobody_started_is_s7_before_vllm_stops(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["zero_load_multi"]
    assert run.get("error", "").startswith("AssertionError"), run  # vLLM's scheduler stops
    s7 = run["violations"][0]
    assert s7["rule"] == "S7" and s7["req_id"].startswith("a-") and s7["step"] == 0, run
    assert "unexpected finished_recving" in s7["message"]
