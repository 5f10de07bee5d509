"""The RecordingConnector's half of rule C3 (kvport.vllm.recording_kv), on CPU tensors and
scheduler outputs shaped as vLLM 0.32's: which blocks a step completes and which a load fills
(by block id and engine hash), and the fingerprints that measure a load against the compute."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvport.trace.identity import short_hash
from kvport.vllm.recording_kv import KvPlan, KvProbe, LoadChecks, LoadedBlocks, LoadPlanner

BS = 4
HASHES = {"r1": [bytes([1, j]) * 4 for j in range(6)], "r2": [bytes([2, j]) * 4 for j in range(6)]}


def key(rid: str, j: int) -> str:
    return short_hash(HASHES[rid][j])


def output(new: dict[str, list[int]], scheduled: dict[str, int],
           cached: dict[str, list[int] | None] | None = None,
           resumed: frozenset[str] = frozenset()) -> Any:
    cached = cached or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in new.items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), resumed_req_ids=set(resumed),
            new_block_ids=[None if ids is None else (ids,) for ids in cached.values()]),
        num_scheduled_tokens=scheduled)


def test_a_step_hands_over_the_blocks_its_forward_completes_by_id_and_hash() -> None:
    planner = LoadPlanner(BS)
    # 10 tokens of a chunked prompt: blocks 0 and 1 are full after the step, block 2 is not
    plan = planner.plan(output({"r1": [7, 8, 9]}, {"r1": 10}), {"r1": 0}, HASHES.__getitem__)
    assert plan.computed == ((7, key("r1", 0)), (8, key("r1", 1))) and plan.loads == ()
    # the next chunk completes block 2 (its block ids grew by one) and block 3
    plan = planner.plan(output({}, {"r1": 6}, {"r1": [10]}), {"r1": 10}, HASHES.__getitem__)
    assert plan.computed == ((9, key("r1", 2)), (10, key("r1", 3)))


def test_a_negative_computed_count_hands_over_nothing_before_block_zero() -> None:
    # vLLM's count after a connector answered a negative match (S3): the plan stays whole
    planner = LoadPlanner(BS)
    plan = planner.plan(output({"r1": []}, {"r1": 8}), {"r1": -4}, HASHES.__getitem__)
    assert plan.computed == ()


def test_a_resumed_request_is_given_its_block_ids_whole() -> None:
    planner = LoadPlanner(BS)
    planner.plan(output({"r1": [7, 8]}, {"r1": 8}), {"r1": 0}, HASHES.__getitem__)
    plan = planner.plan(output({}, {"r1": 12}, {"r1": [3, 4, 5]}, frozenset({"r1"})),
                        {"r1": 0}, HASHES.__getitem__)
    assert [b for b, _ in plan.computed] == [3, 4, 5]


def test_a_load_covers_the_full_blocks_after_the_local_hit_and_keeps_its_kind() -> None:
    planner = LoadPlanner(BS)
    planner.asked("r1", 4, (14, True))  # local: block 0; external: blocks 1..3 and half of 4
    planner.allocated("r1", [7, 8, 9, 10, 11, 12], 14, HASHES["r1"])
    planner.asked("r2", 0, (8, False))
    planner.allocated("r2", [3, 4], 8, HASHES["r2"])
    planner.allocated("r2", [3, 4], 0, HASHES["r2"])  # no external tokens: no load
    plan = planner.plan(output({}, {}), {}, HASHES.__getitem__)
    assert plan.loads == (
        LoadedBlocks("r1", 1, (8, 9, 10), tuple(key("r1", j) for j in range(1, 4)), True),
        LoadedBlocks("r2", 0, (3, 4), (key("r2", 0), key("r2", 1)), False))
    assert planner.plan(output({}, {}), {}, HASHES.__getitem__).loads == ()  # handed once


def probe(layout: str = "cpu") -> tuple[KvProbe, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (16, 2, BS, 16) if layout == "cpu" else (2, 16, BS, 2, 8)
    layer = torch.randn(shape, generator=gen)
    return KvProbe(layer, 16), layer


def block(layer: torch.Tensor, dim: int, b: int) -> torch.Tensor:
    return layer.select(dim, b)


@pytest.mark.parametrize("layout,dim", [("cpu", 0), ("cuda", 1)])
def test_a_load_of_the_computed_kv_measures_zero_and_another_blocks_far(layout: str,
                                                                        dim: int) -> None:
    p, layer = probe(layout)
    p.end_of_forward(KvPlan(((3, "k3"), (4, "k4")), ()), [])
    block(layer, dim, 9).copy_(block(layer, dim, 3))  # a right load: k3's KV into block 9
    block(layer, dim, 10).copy_(block(layer, dim, 5))  # a wrong one: block 5's KV as k4
    p.end_of_forward(KvPlan((), (LoadedBlocks("r", 2, (9, 10), ("k3", "k4"), False),)), [])
    (record,) = list(p.end_of_step())
    near, far = record["result"]["distances"]
    assert near == 0.0 and far > 0.5
    assert record["ints"] == [2] and record["result"]["block_ids"] == [9, 10]
    assert list(p.end_of_step()) == []  # written once


def test_an_async_load_is_measured_when_its_request_is_reported_finished() -> None:
    p, layer = probe()
    p.end_of_forward(KvPlan(((3, "k3"),), ()), [])
    p.end_of_forward(KvPlan((), (LoadedBlocks("r", 0, (9,), ("k3",), True),)), [])
    assert list(p.end_of_step()) == []  # not done yet: the block holds anything
    layer[9].copy_(layer[3])
    p.end_of_forward(None, ["r"])
    (record,) = list(p.end_of_step())
    assert record["result"]["distances"] == [0.0]


def test_failed_and_never_computed_blocks_have_no_distance() -> None:
    p, _ = probe()
    p.end_of_forward(KvPlan(((3, "k3"), (4, "k4")), ()), [])
    p.end_of_forward(KvPlan((), (LoadedBlocks("r", 0, (9, 10, 11), ("k3", "k4", "k?"),
                                              False),)), [])
    p.load_errors([10])
    (record,) = list(p.end_of_step())
    d = record["result"]["distances"]
    assert d[0] is not None and d[1:] == [None, None]


def test_the_first_fingerprint_of_a_hash_wins() -> None:
    p, layer = probe()
    p.end_of_forward(KvPlan(((3, "k"),), ()), [])
    p.end_of_forward(KvPlan(((5, "k"),), ()), [])  # recomputed elsewhere: not replaced
    layer[9].copy_(layer[3])
    p.end_of_forward(KvPlan((), (LoadedBlocks("r", 0, (9,), ("k",), False),)), [])
    assert next(p.end_of_step())["result"]["distances"] == [0.0]


def test_a_kv_tensor_without_a_block_dimension_turns_the_checks_off_not_the_engine() -> None:
    with pytest.raises(ValueError, match="no dimension of 16 blocks"):
        KvProbe(torch.zeros(3, 4, 5), 16)
    checks = LoadChecks(True, BS, 16, HASHES.__getitem__)
    checks.registered({"layer.0": torch.zeros(3, 4, 5)})
    checks.finished(SimpleNamespace(kv_plan=KvPlan(((1, "k"),), ())), [])
    assert checks.records() == []


def test_a_failure_inside_the_checks_turns_them_off_without_raising() -> None:
    checks = LoadChecks(True, BS, 16, HASHES.__getitem__)
    checks.asked("r1", 0, (8, False))
    checks.allocated("r1", object(), 8)  # not a KVCacheBlocks: the planner fails, quietly
    assert checks.plan(output({"r1": [1, 2]}, {"r1": 8}), {"r1": 0}) is None
