"""The files written for a finding (kvport.conformance.repro): a script that needs nothing of the
run that found it, the workload as JSON, the trace. Running the script is tested on vLLM
(tests/vllm/test_vllm_conformance.py)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from kvport.conformance.connectors import PRESETS
from kvport.conformance.repro import STORE, write_finding
from kvport.conformance.workload import EngineShape, RequestPlan, Workload, WorkloadPlan
from kvport.trace.events import read_events


def test_a_finding_is_written_as_a_script_with_everything_it_needs(tmp_path: Path) -> None:
    workload = WorkloadPlan((130,), (RequestPlan((0,), 0, salt=1),
                                     RequestPlan((0,), 2, salt=2))).materialize(5, 1000)
    events = [{"seq": 0, "pid": 1, "role": "scheduler", "connector": "C", "step": 0,
               "method": "trace_step"}]
    script = write_finding(
        tmp_path / "C2", key="C2", title="example breaks C2", found="seed 0",
        connector=PRESETS["vllm-multi"](Path(STORE)), sees_all_stores=True,
        shape=EngineShape(), workload=workload, events=events)
    text = script.read_text()
    tree = ast.parse(text)  # valid Python
    names = {n.targets[0].id: n for n in tree.body if isinstance(n, ast.Assign)
             and isinstance(n.targets[0], ast.Name)}
    assert {"CONNECTOR", "SHAPE", "STEPS", "EXPECTED", "SEES_ALL_STORES"} <= set(names)
    # stands alone: kvport's recorder and checker, and the adapters' weights (kvport.conformance
    # .lora: torch and safetensors), nothing of the search
    assert "hypothesis" not in text
    assert set(re.findall(r"kvport\.conformance\.\w+", text)) == {"kvport.conformance.lora"}
    steps = json.loads(ast.literal_eval(names["STEPS"].value.args[0]))  # type: ignore[attr-defined]
    assert Workload.from_json(steps) == workload
    connector = ast.literal_eval(names["CONNECTOR"].value.args[0])  # type: ignore[attr-defined]
    assert "{store}/kvport-example" in connector and '"record_trace": "{trace}"' in connector
    assert json.loads((script.parent / "workload.json").read_text())["steps"] == steps
    assert [e.method for e in read_events(str(script.parent / "trace.jsonl"))] == ["trace_step"]
