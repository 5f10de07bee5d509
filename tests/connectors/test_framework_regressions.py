"""Regression tests for the three failure shapes of KV connector frameworks. Each one fails if the
defect is put back."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvport import LLM, SamplingParams
from kvport.connectors.driver import KVConnectorDriver
from kvport.engine.outputs import SchedulerOutput
from kvport.trace.checker import check_file

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[(i * 7 + j * 3) % 200 + 1 for j in range(n)] for i, n in enumerate([30, 22, 41, 9, 35, 27])]


def mock_config(kind: str, trace: Path | None = None, **extra: object) -> dict[str, object]:
    if trace is not None:
        extra["record_trace"] = str(trace)
    return {"kv_connector": kind, "kv_connector_module_path": "connector_mock",
            "kv_connector_extra_config": extra}


class BindFirstDriver(KVConnectorDriver):
    """The defect: metadata bound before handle_preemptions."""

    def pre_forward(self, sched_out: SchedulerOutput, ctx: object) -> None:  # type: ignore[override]
        self._ctx = ctx  # type: ignore[assignment]
        self._errors, self._error_req_ids = {}, set()
        self.connector.trace_step(sched_out.step)
        self._call("bind_connector_metadata", sched_out.kv_connector_metadata)
        self._call("handle_preemptions", sched_out.kv_connector_metadata)
        self._call("start_load_kv", ctx)


def run_with_preemption(tmp_path: Path, broken_driver: bool) -> tuple[LLM, list[list[int]], Path]:
    trace = tmp_path / f"trace-{broken_driver}.jsonl"
    llm = LLM("builtin:tiny-llama", block_size=4, num_kv_blocks=24, max_model_len=96,
              kv_transfer_config=mock_config("FenceConnector", trace))
    if broken_driver:
        llm.engine.runner.driver.__class__ = BindFirstDriver
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if not broken_driver:
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemption"
    return llm, [o.outputs[0].token_ids for o in outs], trace


def test_1_handle_preemptions_runs_before_bind(tmp_path: Path) -> None:
    reference = [o.outputs[0].token_ids for o in LLM("builtin:tiny-llama", block_size=4).generate(
        PROMPTS, GREEDY, use_tqdm=False)]
    llm, outs, trace = run_with_preemption(tmp_path, broken_driver=False)
    assert outs == reference
    assert check_file(str(trace)) == []
    llm.engine.check_no_leaks()
    # Put the defect back: the checker and the connector's own fence both catch it.
    llm, outs, trace = run_with_preemption(tmp_path, broken_driver=True)
    rules = {v.rule for v in check_file(str(trace))}
    assert {"W1", "W2"} & rules, rules
    assert outs != reference  # every step's requests failed: handle_preemptions saw bound metadata
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("kind, loses_saves", [
    ("DeferredSaveConnector", False), ("SaveInWaitForSaveConnector", True)])
def test_2_saves_queued_in_wait_for_save_are_lost_on_no_forward_steps(
    tmp_path: Path, kind: str, loses_saves: bool,
) -> None:
    trace = tmp_path / "trace.jsonl"
    llm = LLM("builtin:tiny-llama", block_size=4, kv_transfer_config=mock_config(kind, trace))
    core = llm.engine
    for i, p in enumerate(PROMPTS[:2]):
        core.add_request(str(i), p, GREEDY)
    # The last request finishes in a step after which nothing is scheduled: its save is planned
    # for a step without a forward, so without wait_for_save.
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
