"""Regression tests for the failure shapes of KV connector frameworks, under both worker call
orders the engine can run (kv_connector_call_order). Each one fails if the defect is put back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvport import LLM, SamplingParams
from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorMetadata
from kvport.connectors.driver import KVConnectorDriver, StepContext
from kvport.engine.core import EngineCore
from kvport.trace.checker import check_file
from kvport.trace.events import LEGACY, VLLM_0_32, read_events

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[(i * 7 + j * 3) % 200 + 1 for j in range(n)] for i, n in enumerate([30, 22, 41, 9, 35, 27])]

# legacy and vllm-0.32; vllm-mrv2 (vllm-0.32 plus finish_forward) is run in test_call_orders.py
# and tests/trace/test_profile_mrv2.py, not here: each engine run costs CI time
TWO_ORDERS = (LEGACY, VLLM_0_32)


def mock_config(kind: str, trace: Path | None = None, **extra: object) -> dict[str, object]:
    if trace is not None:
        extra["record_trace"] = str(trace)
    return {"kv_connector": kind, "kv_connector_module_path": "connector_mock",
            "kv_connector_extra_config": extra}


def reference_tokens(prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM("builtin:tiny-llama", block_size=4, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def make_llm(driver_cls: type[KVConnectorDriver], **kwargs: Any) -> LLM:
    """An LLM whose runner drives its connector through `driver_cls` (a defect put back)."""
    return LLM.from_engine(EngineCore(EngineConfig.from_kwargs(**kwargs), driver_cls=driver_cls))


def worker_steps(trace: Path) -> dict[int, list[str]]:
    """The worker's calls per step, in file order."""
    steps: dict[int, list[str]] = {}
    for e in read_events(str(trace)):
        if e.role == "worker" and e.step is not None and e.method != "trace_step":
            steps.setdefault(e.step, []).append(e.method)
    return steps


class BindFirstDriver(KVConnectorDriver):
    """The defect: metadata bound before handle_preemptions."""

    def _preempt_and_bind(self, meta: KVConnectorMetadata) -> None:
        c = self.connector
        self._guarded("bind_connector_metadata", lambda: c.bind_connector_metadata(meta), None)
        self._guarded("handle_preemptions", lambda: c.handle_preemptions(meta), None)


def run_with_preemption(tmp_path: Path, call_order: str, broken_driver: bool,
                        ) -> tuple[LLM, list[list[int]], Path]:
    trace = tmp_path / f"trace-{broken_driver}.jsonl"
    llm = make_llm(BindFirstDriver if broken_driver else KVConnectorDriver,
                   model="builtin:tiny-llama", block_size=4, num_kv_blocks=24, max_model_len=96,
                   kv_transfer_config=mock_config("FenceConnector", trace),
                   kv_connector_call_order=call_order)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if not broken_driver:
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    return llm, [o.outputs[0].token_ids for o in outs], trace


@pytest.mark.parametrize("call_order", TWO_ORDERS)
def test_1_handle_preemptions_runs_before_bind(tmp_path: Path, call_order: str) -> None:
    reference = [o.outputs[0].token_ids for o in LLM("builtin:tiny-llama", block_size=4).generate(
        PROMPTS, GREEDY, use_tqdm=False)]
    llm, outs, trace = run_with_preemption(tmp_path, call_order, broken_driver=False)
    assert outs == reference
    assert check_file(str(trace)) == []
    llm.engine.check_no_leaks()
    # Put the defect back: the checker and the connector's own fence both catch it.
    llm, outs, trace = run_with_preemption(tmp_path, call_order, broken_driver=True)
    rules = {v.rule for v in check_file(str(trace))}
    assert {"W1", "W2"} & rules, rules
    assert outs != reference  # every step's requests failed: handle_preemptions saw bound metadata
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("call_order", TWO_ORDERS)
@pytest.mark.parametrize("kind", ["DeferredSaveConnector", "SaveInWaitForSaveConnector"])
def test_2_saves_queued_in_wait_for_save_are_lost_in_legacy_no_forward_steps(
    tmp_path: Path, kind: str, call_order: str,
) -> None:
    # Legacy skips wait_for_save on steps without a forward, so a connector that queues its
    # saves there loses them; vllm-0.32 calls it on every step, so the same connector does not.
    loses_saves = kind == "SaveInWaitForSaveConnector" and call_order == LEGACY
    trace = tmp_path / "trace.jsonl"
    llm = LLM("builtin:tiny-llama", block_size=4, kv_transfer_config=mock_config(kind, trace),
              kv_connector_call_order=call_order)
    core = llm.engine
    for i, p in enumerate(PROMPTS[:2]):
        core.add_request(str(i), p, GREEDY)
    # The last request finishes in a step after which nothing is scheduled: its save is planned
    # for a step without a forward.
    for _ in range(200):
        if not core.has_pending_work():
            break
        core.step()
    if loses_saves:
        assert core.has_pending_work(), "the engine should still be waiting for the lost save"
        with pytest.raises(RuntimeError, match="still hold blocks"):
            core.check_no_leaks()
        llm.shutdown()
        assert any(v.rule == "S6" for v in check_file(str(trace)))  # a True never reported
    else:
        core.check_no_leaks()
        llm.shutdown()
        assert check_file(str(trace)) == []
    # The scenario did reach a step without a forward (no layer hooks) ...
    no_forward = [calls for calls in worker_steps(trace).values() if "save_kv_layer" not in calls]
    assert no_forward
    # ... where only vllm-0.32 called wait_for_save.
    assert all(("wait_for_save" in calls) == (call_order == VLLM_0_32) for calls in no_forward)


class LoadAfterForwardDriver(KVConnectorDriver):
    """The defect: under vllm-0.32, every load starts after the forward, sync loads included."""

    def _loads_before_forward(self, ctx: StepContext) -> bool:
        return self.call_order == LEGACY


def run_example_twice(tmp_path: Path, call_order: str, broken_driver: bool,
                      ) -> tuple[LLM, list[list[int]], list[int], Path]:
    """ExampleConnector stores the prompts, then loads them synchronously into a zeroed pool.
    The first run loads nothing (the prompts share no prefix), so a broken driver changes only
    the second."""
    trace = tmp_path / f"trace-{broken_driver}.jsonl"
    ktc = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {
        "shared_storage_path": str(tmp_path / f"store-{broken_driver}"),
        "record_trace": str(trace)}}
    llm = make_llm(LoadAfterForwardDriver if broken_driver else KVConnectorDriver,
                   model="builtin:tiny-llama", block_size=4, kv_connector_call_order=call_order,
                   kv_transfer_config=ktc)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in first] == [0] * len(PROMPTS)
    llm.reset_prefix_cache()
    # Zeros: blocks reused from the first run must not already hold the KV a load would bring.
    llm.engine.runner.kv_cache.zero_()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.engine.check_no_leaks()
    llm.shutdown()
    return (llm, [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs],
            trace)


@pytest.mark.parametrize("call_order", TWO_ORDERS)
def test_3_sync_loads_start_before_the_forward_that_reads_them(
    tmp_path: Path, call_order: str,
) -> None:
    reference = reference_tokens(PROMPTS)
    _, outs, cached, trace = run_example_twice(tmp_path, call_order, broken_driver=False)
    assert outs == reference
    assert all(n > 0 for n in cached), cached  # every prompt loaded its aligned prefix
    assert check_file(str(trace)) == []
    loads = [e for e in read_events(str(trace)) if e.method == "start_load_kv"]
    assert {e.ints[0] for e in loads} == {0, 1}  # steps with and without sync loads
    if call_order == LEGACY:
        return
    # Put the defect back: the layers read zeros instead of the loaded KV; the checker sees it.
    _, outs, _, trace = run_example_twice(tmp_path, call_order, broken_driver=True)
    assert outs != reference
    assert "W4" in {v.rule for v in check_file(str(trace))}
