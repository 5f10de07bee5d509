"""Conformance workloads as data (kvport.conformance.workload, strategies, connectors): what a
plan materializes to, what the strategies draw, how connectors are named. No vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings

from kvport.conformance.connectors import PRESETS, connector_under_test
from kvport.conformance.strategies import workload_plans
from kvport.conformance.workload import (
    TOKEN_HIGH,
    TOKEN_LOW,
    Arrival,
    EngineShape,
    RequestPlan,
    Step,
    Workload,
    WorkloadPlan,
)

PLAN = WorkloadPlan(
    segment_lengths=(300, 50),
    requests=(RequestPlan((0,), arrive=0, salt=1), RequestPlan((0, 1), arrive=2, abort_after=1),
              RequestPlan((0,), arrive=2, salt=2, max_tokens=3, lora=1)),
    resets=((1, "running"),), extra_steps=1)


def test_a_plan_materializes_to_prompts_that_share_its_segments() -> None:
    w = PLAN.materialize(seed=7, max_prompt_len=1000)
    r0, r1, r2 = w.arrivals
    assert len(r0.prompt) == 300 and r1.prompt[:300] == r0.prompt and len(r1.prompt) == 350
    assert r2.prompt == r0.prompt and (r0.cache_salt, r2.cache_salt) == ("tenant-1", "tenant-2")
    assert r1.cache_salt is None and r2.max_tokens == 3
    assert (r0.lora, r2.lora) == (None, "adapter-1")
    assert [s.reset for s in w.steps] == [None, "running", None, None, None]
    assert w.steps[3].aborts == ("r1",) and [a.req_id for a in w.steps[2].arrivals] == ["r1", "r2"]
    assert all(TOKEN_LOW <= t <= TOKEN_HIGH for t in r1.prompt)
    assert w.summary() == ("step 0: r0:300/tenant-1; step 1: reset running; "
                           "step 2: r1:350, r2:300/tenant-2@adapter-1; step 3: abort r1")


def test_seeds_give_other_tokens_and_prompts_are_cut_to_the_limit() -> None:
    a, b = PLAN.materialize(1, 1000), PLAN.materialize(2, 1000)
    assert a.arrivals[0].prompt != b.arrivals[0].prompt  # no prefix shared across workloads
    assert PLAN.materialize(1, 1000) == a  # deterministic
    assert max(len(x.prompt) for x in PLAN.materialize(1, 120).arrivals) == 120


def test_a_workload_round_trips_through_json() -> None:
    w = PLAN.materialize(3, 1000)
    assert Workload.from_json(json.loads(json.dumps(w.to_json()))) == w


@settings(max_examples=60, deadline=None)
@given(workload_plans())
def test_every_drawn_plan_is_a_workload_vllm_accepts(plan: WorkloadPlan) -> None:
    w = plan.materialize(0, 1000)
    added: set[str] = set()
    for step in w.steps:
        assert set(step.aborts) <= added, "an abort names a request added at an earlier step"
        for a in step.arrivals:
            assert 1 <= len(a.prompt) <= 1000 and 1 <= a.max_tokens <= 6
            assert a.req_id not in added
            added.add(a.req_id)
    assert added == {f"r{i}" for i in range(len(plan.requests))}


@settings(max_examples=40, deadline=None)
@given(workload_plans(loras=2))
def test_with_adapters_requests_draw_one_of_them_or_none(plan: WorkloadPlan) -> None:
    assert all(0 <= r.lora <= 2 for r in plan.requests)


@settings(max_examples=40, deadline=None)
@given(workload_plans())
def test_without_adapters_no_request_has_one(plan: WorkloadPlan) -> None:
    assert all(r.lora == 0 for r in plan.requests)


def test_a_session_refuses_a_workload_whose_adapter_its_engine_lacks(tmp_path: Path) -> None:
    from kvport.conformance.driver import EngineSession

    session = EngineSession(lambda store: {}, EngineShape(max_loras=1), tmp_path, tmp_path)
    lora_2 = Workload((Step((Arrival("r0", (5, 6), lora="adapter-2"),)),))
    with pytest.raises(ValueError, match=r"\['adapter-2'\]; the engine shape has max_loras=1"):
        session.run(lora_2)


@pytest.mark.parametrize("bad", [{"num_gpu_blocks": 0}, {"max_num_seqs": -1},
                                 {"long_prefill_token_threshold": -2}, {"max_loras": -1}])
def test_an_engine_shape_names_its_bad_value(bad: dict[str, int]) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        EngineShape(**bad)


def test_a_step_refuses_an_unknown_reset() -> None:
    with pytest.raises(ValueError, match="'all'"):
        Step(reset="all")


def test_presets_put_their_storage_in_the_directory_given(tmp_path: Path) -> None:
    for name in PRESETS:
        c = connector_under_test(name)
        assert c.store_starts_empty and c.name == name
        text = json.dumps(c.config_for(tmp_path))
        assert "kv_connector" in text
        if "shared_storage_path" in text or "root_dir" in text:
            assert str(tmp_path) in text


def test_a_json_connector_gets_a_fresh_store_and_is_judged_only_when_declared(
        tmp_path: Path) -> None:
    spec = '{"kv_connector": "Mine", "kv_connector_module_path": "my.mod", ' \
           '"kv_connector_extra_config": {"path": "{store}/x"}}'
    c = connector_under_test(spec)
    assert c.name == "Mine" and not c.store_starts_empty
    store = tmp_path / 'a "quoted" dir'
    assert c.config_for(store)["kv_connector_extra_config"]["path"] == f"{store}/x"
    assert connector_under_test(spec, store_starts_empty=True).store_starts_empty


@pytest.mark.parametrize("spec, match", [
    ("nope", "unknown connector 'nope'"), ("{bad json", "not valid JSON"),
    ('{"kv_role": "kv_both"}', "'kv_connector' name"), ("[1]", "unknown connector")])
def test_a_bad_connector_is_named(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        connector_under_test(spec)
