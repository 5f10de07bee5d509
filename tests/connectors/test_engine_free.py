"""Connectors import and run without kvport's engine: another engine that supplies objects with
the attributes of kvport.connectors.views can drive them (kvport.vllm does that for vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from utils import make_request

from kvport.connectors.views import (
    CachedRequestView, NewRequestView, RequestView, SchedulerOutputView,
)
from kvport.engine.kv_transfer import connector_view
from kvport.engine.step import CachedRequestData, NewRequestData, SchedulerOutput
from kvport.sampling_params import SamplingParams
from kvport.trace.events import LEGACY, VLLM_0_32

SCRIPT = Path(__file__).with_name("engine_free_script.py")

# legacy and vllm-0.32; vllm-mrv2 (vllm-0.32 plus finish_forward) is run in test_call_orders.py
# and tests/trace/test_profile_mrv2.py, not here: each engine run costs CI time
TWO_ORDERS = (LEGACY, VLLM_0_32)


def example(path: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.mark.parametrize("call_order", TWO_ORDERS)
@pytest.mark.parametrize("kind", ["example", "multi", "recorded"])
def test_a_connector_runs_with_kvport_engine_unimportable(tmp_path: Path, kind: str,
                                                          call_order: str) -> None:
    config = example(tmp_path)
    if kind == "multi":
        config = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "NoOpConnector"}, example(tmp_path)]}}
    if kind == "recorded":
        config["kv_connector_extra_config"]["record_trace"] = str(tmp_path / "trace.jsonl")
    result = subprocess.run([sys.executable, str(SCRIPT), json.dumps(config), call_order],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    if kind == "recorded":
        assert "update_state_after_alloc" in (tmp_path / "trace.jsonl").read_text()


def test_the_engine_hands_its_connector_views() -> None:
    """kvport's engine passes its own requests, and of each step a view with one block table
    per request (its records hold a table per KV cache group)."""
    assert isinstance(make_request("r", [1, 2, 3, 4, 5]), RequestView)
    new = NewRequestData("r", [1], [], SamplingParams(), 0, ([0, 1],), 0)
    cached = CachedRequestData("r", ([2],), 4)
    view = connector_view(SchedulerOutput([new], [cached], {"r": 1}, 1, set(), set(), step=3))
    assert isinstance(view, SchedulerOutputView) and view.step == 3
    (v_new,), (v_cached,) = view.scheduled_new_reqs, view.scheduled_cached_reqs
    assert isinstance(v_new, NewRequestView) and isinstance(v_cached, CachedRequestView)
    assert v_new.block_ids == [0, 1] and v_cached.new_block_ids == [2]
