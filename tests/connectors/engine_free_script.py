"""Run by test_engine_free.py in a fresh interpreter where `kvport.engine` cannot be imported.

It plays another engine: its own request and scheduler-output records (only the attributes of
kvport.connectors.views), its own KV pool, kvport's worker driver. Request "a" computes a prompt
and the connector stores it; request "b" with the same prompt loads it into other blocks, which
must then hold exactly a's KV (b's load is synchronous: it must land before the forward, in
either call order). Usage: engine_free_script.py CONFIG_JSON [CALL_ORDER]
"""

from __future__ import annotations

import importlib.abc
import json
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any


class _NoEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "kvport.engine" or name.startswith("kvport.engine."):
            raise ImportError(f"{name} imported: connectors must not need kvport's engine")
        return None


sys.meta_path.insert(0, _NoEngine())
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: view_records

import torch  # noqa: E402

from kvport.config import KVTransferConfig  # noqa: E402
from kvport.connectors.base import (  # noqa: E402
    ForwardContext, KVCacheSpec, KVConnectorBase, KVConnectorRole,
)
from kvport.connectors.driver import KVConnectorDriver  # noqa: E402
from kvport.connectors.factory import create_connector  # noqa: E402
from kvport.connectors.views import RequestView, SchedulerOutputView  # noqa: E402
from view_records import ViewNewRequest, ViewRequest, ViewSchedulerOutput  # noqa: E402

BLOCK_SIZE, NUM_LAYERS, NUM_BLOCKS = 4, 2, 16


@dataclass
class ViewStep(ViewSchedulerOutput):
    """A scheduler output with every attribute of the view, has_sync_kv_loads included."""

    has_sync_kv_loads: bool = False

PROMPT = list(range(3, 16))  # 13 tokens: 3 full blocks and one token


def step(sched: KVConnectorBase, driver: KVConnectorDriver, kv: torch.Tensor,
         out: ViewStep, write: list[int]) -> None:
    """One engine step: metadata, the worker's hooks around a 'forward' that writes random KV
    into the blocks `write`, then the connector output back to the scheduler half."""
    out.kv_connector_metadata = sched.build_connector_meta(out)
    ctx = ForwardContext(kv, out.num_scheduled_tokens, out.step)
    driver.pre_forward(out, ctx)  # type: ignore[arg-type]
    for layer in range(NUM_LAYERS):
        driver.before_attention(layer)
        kv[write, layer] = torch.randn(kv[write, layer].shape)
        driver.after_attention(layer, kv)
    kv_out = driver.post_forward(out, did_forward=True)  # type: ignore[arg-type]
    assert not kv_out.errors, kv_out.errors
    sched.update_connector_output(kv_out)


def main(config: dict[str, Any], call_order: str) -> None:
    ktc = KVTransferConfig.from_any(config)
    assert ktc is not None
    sched = create_connector(ktc, KVConnectorRole.SCHEDULER)
    spec = KVCacheSpec(NUM_BLOCKS, BLOCK_SIZE, NUM_LAYERS, 1, 8, "float32", "other-layout",
                       hash_root=b"other-engine")
    sched.set_kv_cache_spec(spec)
    kv = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, 1, 8)
    driver = KVConnectorDriver(create_connector(ktc, KVConnectorRole.WORKER), kv, spec,
                               call_order)

    a, b = ViewRequest("a", PROMPT, BLOCK_SIZE), ViewRequest("b", PROMPT, BLOCK_SIZE)
    assert isinstance(a, RequestView)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, [0, 1, 2, 3], 0)
    out = ViewStep([ViewNewRequest("a", [0, 1, 2, 3], 0)], {"a": 13}, step=0)
    assert isinstance(out, SchedulerOutputView)
    step(sched, driver, kv, out, write=[0, 1, 2, 3])
    sched.request_finished(a, [0, 1, 2, 3])

    num_external, is_async = sched.get_num_new_matched_tokens(b, 0)
    assert (num_external, is_async) == (12, False), (num_external, is_async)
    sched.update_state_after_alloc(b, [4, 5, 6, 7], 12)
    out = ViewStep([ViewNewRequest("b", [4, 5, 6, 7], 0)], {"b": 1}, step=1,
                   finished_req_ids={"a"}, has_sync_kv_loads=True)
    step(sched, driver, kv, out, write=[7])
    assert torch.equal(kv[4:7], kv[0:3]), "b's blocks do not hold a's KV"
    sched.request_finished(b, [4, 5, 6, 7])
    sched.shutdown()
    driver.shutdown()
    assert not any(m == "kvport.engine" or m.startswith("kvport.engine.") for m in sys.modules)
    print("ok")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "vllm-0.32")
