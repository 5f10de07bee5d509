"""A SupportsHMA connector on a hybrid model: the engine keeps the model's KV cache groups and
hands the connector a block table per group everywhere (the spec, update_state_after_alloc, the
step's view, request_finished_all_groups), with the null block where a window moved past."""

from __future__ import annotations

import pytest
import torch
from hma_connector import GroupsConnector

from kvport import LLM, SamplingParams
from kvport.connectors.base import KVCacheGroupSpec
from kvport.connectors.hma import supports_hma
from kvport.connectors.noop import NoOpConnector
from kvport.engine.kv_transfer import connector_view
from kvport.engine.step import CachedRequestData, NewRequestData, SchedulerOutput

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
KTC = {"kv_connector": "GroupsConnector", "kv_connector_module_path": "hma_connector",
       "kv_role": "kv_both"}


def test_supports_hma_is_declared_not_guessed() -> None:
    assert supports_hma(GroupsConnector) and not supports_hma(NoOpConnector)


@pytest.mark.parametrize("worker", ["inproc", "process"])
def test_an_hma_connector_gets_every_group(worker: str) -> None:
    GroupsConnector.calls.clear()
    llm = LLM("builtin:tiny-gemma3", block_size=16, num_kv_blocks=200, kv_transfer_config=KTC,
              worker=worker)
    plain = LLM("builtin:tiny-gemma3", block_size=16, num_kv_blocks=200)
    prompt = [256, *torch.randint(32, 127, (150,), generator=torch.Generator().manual_seed(5))
              .tolist()]
    try:
        assert llm.engine.kv_cache_manager.group_windows == (48, 48, None)
        got = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got == plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.engine.check_no_leaks()
    finally:
        llm.shutdown()
        plain.shutdown()
    calls = GroupsConnector.calls
    (spec,) = [c[1] for c in calls if c[0] == "set_kv_cache_spec"]
    assert spec.groups == (KVCacheGroupSpec((0, 3), 48), KVCacheGroupSpec((1, 4), 48),
                           KVCacheGroupSpec((2, 5), None))
    assert spec.num_slots == 2 and spec.layer_slot(4) == 1
    if worker == "inproc":  # the worker half's calls are in the child process otherwise
        (shape, worker_spec), = [c[1] for c in calls if c[0] == "register_kv_caches"]
        assert shape[1] == 2 and worker_spec == spec
    (alloc,) = [c[1] for c in calls if c[0] == "update_state_after_alloc"]
    assert isinstance(alloc, tuple) and [len(t) for t in alloc] == [10, 10, 10]
    (new,) = [c[1] for c in calls if c[0] == "new_block_ids"]
    assert new == alloc
    cached = [c[1] for c in calls if c[0] == "cached_block_ids"]
    assert all(isinstance(t, tuple) and len(t) == 3 for t in cached)
    (finished,) = [c[1] for c in calls if c[0] == "request_finished_all_groups"]
    # 150 + 20 tokens: 11 blocks each; the sliding groups' tables start with null blocks
    assert [len(t) for t in finished] == [11, 11, 11]
    assert finished[0][0] == 0 and finished[1][0] == 0 and 0 not in finished[2]


def test_the_view_keeps_every_group_for_an_hma_connector() -> None:
    new = NewRequestData("r", [1], [], SamplingParams(), 0, ([0, 5], [0, 6], [3, 4]), 0)
    cached = CachedRequestData("r", ([7], [8], [9]), 4)
    out = SchedulerOutput([new], [cached], {"r": 1}, 1, set(), set())
    view = connector_view(out, all_groups=True)
    assert view.scheduled_new_reqs[0].block_ids == ([0, 5], [0, 6], [3, 4])
    assert view.scheduled_cached_reqs[0].new_block_ids == ([7], [8], [9])
    with pytest.raises(AssertionError, match="one KV cache group"):
        connector_view(out)
