"""The connectors and the job runner that the claim and load tests (test_vllm_claims.py,
test_vllm_loads.py) share: each job is one run_claims.py workload on a fresh vLLM engine, and a
module's jobs run side by side on the engine pool's workers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from engine_pool import EnginePool

OFFLOADING: dict[str, Any] = {
    "kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20}}


def example(tmp: Path, name: str = "ExampleConnector") -> dict[str, Any]:
    """vLLM's ExampleConnector, or a planted variant of it from trace_connectors.py."""
    module = {"kv_connector_module_path": "trace_connectors"} if name != "ExampleConnector" else {}
    return {"kv_connector": name, **module,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "kv")}}


def run_all(engine_pool: EnginePool, tmp_path_factory: pytest.TempPathFactory,
            jobs: dict[str, tuple[dict[str, Any], Any]]) -> dict[str, dict[str, Any]]:
    """Each job's result by name. A job is (workload, connector): a kv_transfer_config, the
    name of an ExampleConnector (vLLM's or a planted one), or a callable of a directory."""
    def one(name: str) -> dict[str, Any]:
        workload, connector = jobs[name]
        tmp = tmp_path_factory.mktemp(name)
        inner = (example(tmp, connector) if isinstance(connector, str)
                 else connector(tmp) if callable(connector) else connector)
        result, _ = engine_pool.run("claims", {**workload, "connector": inner,
                                               "trace": str(tmp / "trace.jsonl")})
        return result

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(jobs, pool.map(one, jobs)))
