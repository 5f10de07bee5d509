"""`kvport conformance` on vLLM's CPU build (SmolLM2-135M), as a user runs it:

- vLLM's ExampleConnector: generated workloads find it serving one cache_salt's KV to another
  (C2), reported with the workload step and request of the claim and why it matters, shrunk to
  a few requests, and the script written for it reproduces it alone, in a fresh process;
- kvport's OffloadingConnector and vLLM's own MultiConnector over two of kvport's connectors:
  the same kind of workloads (preemptions and cache_salts among them) break no rule;
- a planted composite named by module path (tests/vllm/trace_connectors.py), which hands its
  children the preemptions after their metadata, is caught in its recorded children (W1, W2).

BENCHMARKS.md and docs/vllm.md have the full-size runs (hundreds of workloads per connector).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvport.conformance.connectors import PRESETS, recorded
from kvport.conformance.repro import STORE

HERE = Path(__file__).parent


def conformance(tmp: Path, *args: str, env: dict[str, str] | None = None
                ) -> tuple[int, str, dict[str, Any]]:
    out = tmp / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvport.cli", "conformance", "--out", str(tmp / "findings"),
         "--json", str(out), *args], check=False, capture_output=True, text=True,
        timeout=900,
        env={**os.environ, **(env or {})})
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, proc.stdout, json.loads(out.read_text())


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    return conformance(tmp_path_factory.mktemp("example"), "--connector", "example",
                       "--examples", "12", "--max-shrink", "6", "--seed", "0")


def test_the_example_connector_is_found_crossing_a_salt_with_step_and_request(
        example_run: tuple[int, str, dict[str, Any]]) -> None:
    code, stdout, doc = example_run
    assert code == 1, stdout[-3000:]
    (run,) = doc["connectors"]
    c2 = next(f for f in run["findings"] if f["key"] == "C2")
    assert c2["first"].startswith("workload step ") and ", request r" in c2["first"]
    assert "tenant" not in c2["first"]  # salts appear as digests only
    assert "tenant-" in c2["summary"]  # the workload, in one line
    assert "why: a hit across a salt or LoRA boundary" in stdout  # the report says why
    assert "get_num_new_matched_tokens" in stdout  # ... and shows the calls around it
    assert f"example | {run['examples']} |" in stdout  # the table


def test_the_script_written_for_a_finding_reproduces_it_alone(
        example_run: tuple[int, str, dict[str, Any]]) -> None:
    _, _, doc = example_run
    c2 = next(f for f in doc["connectors"][0]["findings"] if f["key"] == "C2")
    script = Path(c2["script"])
    assert (script.parent / "workload.json").exists() and (script.parent / "trace.jsonl").exists()
    proc = subprocess.run([sys.executable, str(script)], check=False, capture_output=True,
                          text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "C2: reproduced" in proc.stdout and "C2 [scheduler ExampleConnector" in proc.stdout


def test_kvports_connectors_and_vllms_multiconnector_over_them_break_no_rule(
        tmp_path: Path) -> None:
    code, stdout, doc = conformance(tmp_path, "--connector", "kvport-offloading",
                                    "--connector", "vllm-multi", "--examples", "18")
    assert code == 0, stdout[-3000:]
    for run in doc["connectors"]:
        assert run["findings"] == [] and run["after_others"] == [], run
        assert run["clean"] == run["examples"] == 18, run
        assert run["preempted"] > 0 and run["salted"] > 0, run  # what the workloads covered
        assert run["engines"] == 1, run


def test_a_planted_composite_named_by_module_path_is_caught(tmp_path: Path) -> None:
    # tests/vllm/trace_connectors.py: vLLM's MultiConnector, except that on a step that
    # preempted requests it binds its children's metadata before handing them the
    # preemptions. Its children (kvport's, clean) are recorded into the run's trace: they see
    # the broken order (W1: handle_preemptions first; W2: bind right after it).
    config = {"kv_connector": "PreemptionsAfterBindMulti",
              "kv_connector_module_path": "trace_connectors",
              "kv_connector_extra_config": {"connectors": [
                  recorded(PRESETS["kvport-offloading"](Path(STORE)), "child-offloading"),
                  recorded(PRESETS["kvport-example"](Path(STORE)), "child-example")]}}
    code, stdout, doc = conformance(
        tmp_path, "--connector", json.dumps(config), "--examples", "15", "--max-shrink", "3",
        env={"PYTHONPATH": str(HERE)})
    assert code == 1, stdout[-3000:]
    keys = {f["key"] for f in doc["connectors"][0]["findings"]}
    assert keys & {"W1", "W2"}, doc
    first = next(f["first"] for f in doc["connectors"][0]["findings"] if f["key"] in keys)
    assert "[worker child-" in first, first  # reported in the child that saw it


def test_requests_under_lora_adapters_are_played_and_kvports_connector_keeps_them_apart(
        tmp_path: Path) -> None:
    code, stdout, doc = conformance(tmp_path, "--connector", "kvport-offloading", "--loras", "2",
                                    "--examples", "6")
    assert code == 0, stdout[-3000:]
    (run,) = doc["connectors"]
    assert run["lora"] > 0 and f"{run['lora']} with LoRAs" in stdout
