"""The connectors `kvport conformance` can test by name, and any other by its kv_transfer_config.

Each preset is a kv_transfer_config given a fresh, empty directory for its storage (a new one
for every engine the run starts), so its store holds only what the recorded engine handed it
and its claims can be judged (the recorder's `sees_all_stores`). A config given as JSON may name
that directory as "{store}", and the run's trace file as "{trace}" (to record the children of a
composite with `recorded`'s config); whether its store starts empty only its author knows
(`--store-starts-empty`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvport.conformance.driver import TRACE, ConfigFor

_HOST_BYTES = 256 << 20


def _example(store: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(store / "example")}}


def _kvport(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": name, "kv_connector_module_path": "kvport.vllm",
            "kv_connector_extra_config": extra}


def _offloading(store: Path) -> dict[str, Any]:
    return _kvport("OffloadingConnector", {"cpu_bytes_to_use": _HOST_BYTES})


def _offloading_disk(store: Path) -> dict[str, Any]:
    return _kvport("OffloadingConnector", {
        "cpu_bytes_to_use": 16 << 20,  # small: most loads come back from disk
        "secondary_tiers": [{"type": "disk", "root_dir": str(store / "disk"),
                             "max_bytes": 1 << 30}]})


def _kvport_example(store: Path) -> dict[str, Any]:
    return _kvport("ExampleConnector", {"shared_storage_path": str(store / "kvport-example")})


def recorded(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A child of a composite, recorded into the run's trace under `name`: its calls are
    checked as a connector of their own (what the composite asks of it, and answers for it)."""
    return {"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvport.vllm",
            "kv_role": "kv_both",  # vLLM's MultiConnector builds each child's config alone
            "kv_connector_extra_config": {"record_trace": TRACE, "name": name,
                                          "sees_all_stores": True, "connector": config}}


def _vllm_multi(store: Path) -> dict[str, Any]:
    # vLLM's own MultiConnector over two of kvport's connectors, each child recorded too.
    return {"kv_connector": "MultiConnector", "kv_connector_extra_config": {
        "connectors": [recorded(_offloading(store), "child-offloading"),
                       recorded(_kvport_example(store), "child-example")]}}


def _kvport_multi(store: Path) -> dict[str, Any]:
    return _kvport("MultiConnector", {"connectors": [
        {"kv_connector": "OffloadingConnector",
         "kv_connector_extra_config": {"cpu_bytes_to_use": _HOST_BYTES}},
        {"kv_connector": "ExampleConnector",
         "kv_connector_extra_config": {"shared_storage_path": str(store / "kvport-multi")}}]})


PRESETS: Mapping[str, ConfigFor] = {
    "example": _example,  # vLLM's ExampleConnector
    "kvport-offloading": _offloading,
    "kvport-offloading-disk": _offloading_disk,
    "kvport-example": _kvport_example,
    "kvport-multi": _kvport_multi,
    "vllm-multi": _vllm_multi,
}


@dataclass(frozen=True)
class ConnectorUnderTest:
    name: str  # the preset's name, or the config's kv_connector
    config_for: ConfigFor
    store_starts_empty: bool
    config_text: str  # a preset's name or the JSON as given: what a reproduction script carries


def connector_under_test(spec: str, *, store_starts_empty: bool = False) -> ConnectorUnderTest:
    """`spec` is a preset name or a kv_transfer_config as JSON (a ValueError names what is
    wrong). Presets always start empty; a JSON config only when the caller says so."""
    if spec in PRESETS:
        return ConnectorUnderTest(spec, PRESETS[spec], True, spec)
    if not spec.lstrip().startswith("{"):
        raise ValueError(f"unknown connector {spec!r}: pass one of {sorted(PRESETS)} or a "
                         "kv_transfer_config as JSON, e.g. '{\"kv_connector\": \"MyConnector\", "
                         "\"kv_connector_module_path\": \"my_pkg.connectors\"}'")
    try:
        config = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"connector config is not valid JSON ({exc}): {spec[:200]!r}") from None
    if not isinstance(config, dict) or not isinstance(config.get("kv_connector"), str):
        raise ValueError(  # noqa: TRY004  # a bad argument value, like the others
            f"connector config must be a JSON object with a 'kv_connector' name, "
                         f"got {spec[:200]!r}")

    def config_for(store: Path) -> dict[str, Any]:
        filled = json.loads(spec.replace("{store}", json.dumps(str(store))[1:-1]))
        assert isinstance(filled, dict), "checked above"
        return filled

    return ConnectorUnderTest(config["kv_connector"], config_for, store_starts_empty, spec)
