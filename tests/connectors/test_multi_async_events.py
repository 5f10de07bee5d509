"""MultiConnector(Example, Example) under async scheduling: each child's scheduler-side events of
a request, anchored at that request's first event, are the same in every run, whatever the
timing (an idle step's trailing events may land anywhere between requests). 50 rounds, each
with different timing (a jitter child busy-waits random times in the worker hooks)."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

from kvport import LLM, SamplingParams
from kvport.connectors.example import num_aligned_tokens
from kvport.trace.checker import check_file
from kvport.trace.events import read_events

BLOCK_SIZE = 4
ROUNDS = 50
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ANCHORED = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished")


def example_child(tmp_path: Path, name: str) -> dict[str, object]:
    return {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {
        "shared_storage_path": str(tmp_path / f"storage_{name}"),
        "record_trace": str(tmp_path / f"trace_{name}.jsonl")}}


def per_request_events(path: Path) -> dict[str, list[tuple[object, ...]]]:
    """Scheduler-side events naming each request, in order from its first one."""
    out: dict[str, list[tuple[object, ...]]] = defaultdict(list)
    for ev in read_events(str(path)):
        if ev.role == "scheduler" and ev.method in ANCHORED and ev.req_ids:
            result = ev.result if ev.method == "get_num_new_matched_tokens" else None
            out[ev.req_ids[0]].append((ev.method, tuple(ev.ints), ev.num_blocks is not None, result))
    return out


def expected(prompt_len: int, hit: bool, loads: bool) -> list[tuple[object, ...]]:
    aligned = num_aligned_tokens(prompt_len, BLOCK_SIZE)
    return [
        ("get_num_new_matched_tokens", (0,), False, [aligned if hit else 0, False]),
        ("update_state_after_alloc", (aligned if loads else 0,), True, None),
        ("request_finished", (), True, None),
    ]


def test_multi_example_events_are_stable_under_async_scheduling(tmp_path: Path) -> None:
    rng = random.Random(0)
    rounds = []
    for r in range(ROUNDS):  # fresh prompts each round: the first pass stores, the second loads
        lengths = [rng.randrange(9, 40) for _ in range(rng.randrange(1, 4))]
        rounds.append([[rng.randrange(1, 250) for _ in range(n)] for n in lengths])
    reference_llm = LLM("builtin:tiny-llama", block_size=BLOCK_SIZE)
    flat = [p for ps in rounds for p in ps]
    reference = [o.outputs[0].token_ids for o in reference_llm.generate(flat, GREEDY, use_tqdm=False)]

    llm = LLM("builtin:tiny-llama", block_size=BLOCK_SIZE, async_scheduling=True, kv_transfer_config={
        "kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            example_child(tmp_path, "1"), example_child(tmp_path, "2"),
            {"kv_connector": "JitterConnector", "kv_connector_module_path": "connector_mock",
             "kv_connector_extra_config": {"seed": 1}}]}})
    outputs = []
    plan: dict[str, tuple[int, bool, bool, bool]] = {}  # req_id -> (len, child1 hit, child2 hit, child1 loads)
    for prompts in rounds:
        for second_pass in (False, True):
            if second_pass:
                llm.reset_prefix_cache()
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            llm.engine.check_no_leaks()
            for p, o in zip(prompts, outs):
                plan[o.request_id] = (len(p), second_pass, second_pass, second_pass)
                assert o.num_cached_tokens == (num_aligned_tokens(len(p), BLOCK_SIZE) if second_pass else 0)
            outputs.append([o.outputs[0].token_ids for o in outs])
    firsts = [outputs[i] for i in range(0, len(outputs), 2)]
    seconds = [outputs[i] for i in range(1, len(outputs), 2)]
    assert [t for ts in firsts for t in ts] == reference
    assert [t for ts in seconds for t in ts] == reference

    child1 = per_request_events(tmp_path / "trace_1.jsonl")
    child2 = per_request_events(tmp_path / "trace_2.jsonl")
    for rid, (n, hit1, hit2, loads1) in plan.items():
        assert child1[rid] == expected(n, hit1, loads1), rid  # the first child with a hit loads
        assert child2[rid] == expected(n, hit2, False), rid  # the second gets the blocks with 0
    llm.shutdown()
    for name in ("1", "2"):
        assert check_file(str(tmp_path / f"trace_{name}.jsonl")) == []
