"""MultiConnector and KV cache groups: it is SupportsHMA exactly when every child is (vLLM's rule),
known from the config before any connector is built, and the instance agrees. On tiny-gemma3
(tests/connectors/hybrid_engine.py has the setting): over two SupportsHMA children the engine keeps the
groups, every child gets the tables per group and finishes through request_finished_all_groups,
and hits come back after a reset; with a child that is not, the engine keeps one group. Greedy
output equals no connector either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybrid_engine import (
    aligned, example, finish, gemma, hybrid_prompts, one_by_one, reference_tokens, tokens,
)

from kvport.config import KVTransferConfig
from kvport.connectors.base import KVConnectorRole
from kvport.connectors.factory import config_supports_hma, create_connector
from kvport.connectors.hma import supports_hma
from kvport.connectors.multi import HMAMultiConnector, MultiConnector
from kvport.trace.events import read_events

OFFLOADING = {"kv_connector": "OffloadingConnector",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 32 << 20}}
NOOP = {"kv_connector": "NoOpConnector"}


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return reference_tokens()


def multi(*children: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [dict(c) for c in children]}}


def recorded(config: dict[str, Any], trace: Path) -> dict[str, Any]:
    """`config` with every child recording into `trace` too (each is checked on its own)."""
    for child in config["kv_connector_extra_config"]["connectors"]:
        child["kv_connector_extra_config"] = {**child.get("kv_connector_extra_config", {}),
                                              "record_trace": str(trace)}
    return config


def config_of(value: dict[str, Any]) -> KVTransferConfig:
    config = KVTransferConfig.from_any(value)
    assert config is not None
    return config


@pytest.mark.parametrize(("kinds", "hma"), [
    pytest.param(kinds, hma, id="+".join(kinds)) for kinds, hma in [
        (("example", "offloading"), True),
        (("example", "noop"), False),
        (("noop", "offloading"), False),
        (("multi-of-example", "offloading"), True),  # nested: HMA all the way down
        (("multi-of-example-noop", "example"), False),
    ]])
def test_a_multi_connector_is_hma_exactly_when_every_child_is(
        tmp_path: Path, kinds: tuple[str, ...], hma: bool) -> None:
    configs = {"example": example(tmp_path / "s"), "offloading": OFFLOADING, "noop": NOOP,
               "multi-of-example": multi(example(tmp_path / "s")),
               "multi-of-example-noop": multi(example(tmp_path / "s"), NOOP)}
    config = config_of(multi(*(configs[k] for k in kinds)))
    assert config_supports_hma(config) == hma
    conn = create_connector(config, KVConnectorRole.SCHEDULER)
    assert type(conn) is (HMAMultiConnector if hma else MultiConnector)
    assert supports_hma(conn) == hma
    conn.shutdown()
    # Its recorder is SupportsHMA exactly when it is.
    recorded_config = config_of(multi(*(configs[k] for k in kinds)))
    recorded_config.kv_connector_extra_config["record_trace"] = str(tmp_path / "t.jsonl")
    recorder = create_connector(recorded_config, KVConnectorRole.SCHEDULER)
    assert supports_hma(recorder) == hma
    recorder.shutdown()


def test_an_hma_multi_connector_refuses_a_child_without_hma(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not every child is"):
        HMAMultiConnector(config_of(multi(example(tmp_path), NOOP)), KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize("first", ["example", "offloading"])
def test_two_hma_children_keep_the_groups_and_hits_come_back(
        tmp_path: Path, reference: list[list[int]], first: str) -> None:
    # The first child with a hit loads: the ExampleConnector's entries, or the host tier.
    children = [example(tmp_path / "s"), OFFLOADING]
    if first == "offloading":
        children.reverse()
    trace = tmp_path / "t.jsonl"
    llm = gemma(recorded(multi(*children), trace), trace)
    assert llm.engine.kv_cache_manager.group_windows == (48, 48, None)
    prompts = hybrid_prompts()
    assert tokens(llm, prompts) == reference
    assert len(list((tmp_path / "s").iterdir())) == 4  # the example child stored every prompt
    llm.reset_prefix_cache()
    assert one_by_one(llm, prompts) == (reference, aligned(prompts))
    finish(llm, trace)
    # Every child (and the MultiConnector) finished every request with all its groups.
    events = read_events(str(trace))
    finished = {e.connector for e in events if e.method == "request_finished_all_groups"}
    assert finished == {"HMAMultiConnector", "ExampleConnector", "OffloadingConnector"}
    assert not any(e.method == "request_finished" for e in events)


@pytest.mark.parametrize("children", [pytest.param((OFFLOADING, NOOP), id="offloading+noop"),
                                      pytest.param((NOOP, OFFLOADING), id="noop+offloading")])
def test_a_child_without_hma_keeps_one_group(
        tmp_path: Path, reference: list[list[int]], children: tuple[dict[str, Any], ...]) -> None:
    trace = tmp_path / "t.jsonl"
    llm = gemma(recorded(multi(*children), trace), trace)
    assert llm.engine.kv_cache_manager.group_windows == (None,)  # one group of every layer
    prompts = hybrid_prompts()
    assert tokens(llm, prompts) == reference
    llm.reset_prefix_cache()
    assert one_by_one(llm, prompts) == (reference, aligned(prompts))
    finish(llm, trace)
    events = read_events(str(trace))
    assert not any(e.method == "request_finished_all_groups" for e in events)
