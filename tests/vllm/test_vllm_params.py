"""kv_transfer_params per request inside vLLM (run_params.py): max_load_tokens and
kv_load_tiers honoured by kvport's connector with output unchanged; max_offload_tokens bounds
what is stored; a bad value is refused at admission with a message naming it, for that request
only."""

from __future__ import annotations

from typing import Any

import pytest
from engine_pool import EnginePool


@pytest.fixture(scope="module")
def result(engine_pool: EnginePool) -> dict[str, Any]:
    done, _ = engine_pool.run("params", {})
    assert "error" not in done, done.get("traceback", done)
    return done


def test_limits_are_honoured_and_output_is_unchanged(result: dict[str, Any]) -> None:
    cases = result["cases"]
    assert all(c["tokens"] == result["stored"] for c in cases.values()), cases
    # max_offload_tokens=384 stored three 128-token blocks of the prompt; the case without
    # limits loads them and stores the other two full ones
    assert cases["none"]["cached"] == 384
    assert cases["load_from_cpu"]["cached"] == 640
    assert cases["max_load_256"]["cached"] == 256
    assert cases["max_load_0"]["cached"] == 0
    assert cases["load_from_storage"]["cached"] == 0
    assert result["num_limited_hits"] == 3


def test_a_bad_value_fails_its_request_alone(result: dict[str, Any]) -> None:
    assert "max_load_tokens must be an integer >= 0, got -5" in result["refused"]
    assert result["after_error"] == result["stored"]
    assert result["num_bad_transfer_params"] == 0  # refused before the connector saw it
