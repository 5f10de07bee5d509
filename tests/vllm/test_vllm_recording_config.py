"""The recorder's `check_loads` key (rule C3's fingerprints): on by default, off on request, and
anything but a bool refused naming the value."""

from __future__ import annotations

import pytest

from kvport.vllm.recording_config import parse_recording_config

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
