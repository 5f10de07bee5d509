"""kvport's connectors under the worker call orders the engine runs (kv_connector_call_order):
stored prompts come back into a zeroed pool with the output of no connector, nothing leaks, the
recorded trace carries the engine's header and checks clean, and its worker calls follow the
order the engine was asked for. Every connector kind runs under legacy and vllm-0.32; vllm-mrv2
(vllm-0.32's order plus finish_forward) runs the ExampleConnector and the OffloadingConnector,
whose loads take both of its paths (sync: before the forward; async: after finish_forward)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import kvport
from kvport import LLM, SamplingParams
from kvport.cli import _engine_kwargs, build_parser
from kvport.config import DEFAULT_KV_CONNECTOR_CALL_ORDER, KVTransferConfig
from kvport.connectors.factory import connector_class_for
from kvport.trace.checker import check_file
from kvport.trace.events import (
    CALL_ORDERS,
    HEADER,
    LEGACY,
    VLLM_0_32,
    VLLM_MRV2,
    TraceEvent,
    TraceHeader,
    read_events,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 4


def prompts() -> list[list[int]]:
    """Pairs share a 24-token prefix; lengths not aligned to blocks."""
    out = []
    for i in range(6):
        base = [(t * 29 + 17 * (i // 2)) % 240 + 5 for t in range(24)]
        out.append(base + [(t * 11 + i) % 240 + 5 for t in range(9 + i)])
    return out


def example(root: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(root)}}


def offloading(sync_host_loads: bool = True) -> dict[str, Any]:
    return {"kv_connector": "OffloadingConnector",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 16 << 20, "block_size": 8,
                                          "sync_host_loads": sync_host_loads}}


def connector_config(kind: str, tmp_path: Path) -> dict[str, Any]:
    if kind == "example":
        return example(tmp_path / "example")
    if kind == "noop":
        return {"kv_connector": "NoOpConnector"}
    if kind.startswith("offloading"):
        return offloading(sync_host_loads=kind == "offloading")
    children = [example(tmp_path / "example"), offloading(sync_host_loads=False)]
    if kind == "multi-offloading-first":
        children.reverse()
    return {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": children}}


# kind -> whether its loads are synchronous (None: it never loads)
KINDS: dict[str, bool | None] = {
    "example": True, "noop": None, "offloading": True, "offloading-async": False,
    "multi-example-first": True, "multi-offloading-first": False,  # (async offloading child)
}
MODES: dict[str, dict[str, Any]] = {"sync": {}, "async": {"async_scheduling": True},
                                    "process": {"worker": "process"}}
CASES = [(order, kind, mode) for order in (LEGACY, VLLM_0_32) for kind in KINDS
         for mode in ("sync", "async")] + [
    (order, kind, "process") for order in (LEGACY, VLLM_0_32) for kind in ("example", "offloading")
] + [(VLLM_MRV2, "example", "sync"), (VLLM_MRV2, "offloading-async", "async")]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("builtin:tiny-llama", block_size=BLOCK_SIZE, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def generate(llm: LLM) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    llm.engine.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def worker_steps(events: list[TraceEvent], connector: str) -> list[list[TraceEvent]]:
    """The worker calls of one connector per step (markers and header left out)."""
    steps: dict[int, list[TraceEvent]] = {}
    for e in events:
        if e.role == "worker" and e.connector == connector and e.step is not None \
                and e.method != "trace_step":
            steps.setdefault(e.step, []).append(e)
    return list(steps.values())


def assert_follows(order: str, steps: list[list[TraceEvent]]) -> None:
    """Where start_load_kv and wait_for_save fall in each step, as `order` places them."""
    assert steps
    for calls in steps:
        names = [e.method for e in calls]
        (load,) = [e for e in calls if e.method == "start_load_kv"]
        layers = [i for i, name in enumerate(names) if name == "save_kv_layer"]
        at = names.index("start_load_kv")
        if order == LEGACY or load.ints == [1]:
            assert at == 2 and all(i > at for i in layers), names  # right after bind
        else:
            assert all(i < at for i in layers), names  # after the forward
        assert ("wait_for_save" in names) == (order != LEGACY or bool(layers)), names
        # vllm-mrv2: finish_forward once, when the forward (if any) has ended
        assert names.count("finish_forward") == (order == VLLM_MRV2), names
        if order == VLLM_MRV2:
            ff = names.index("finish_forward")
            assert all(i < ff for i in layers) and names[ff + 1:ff + 3] == (
                ["wait_for_save", "get_finished"] if load.ints == [1]
                else ["start_load_kv", "wait_for_save"]), names


@pytest.mark.parametrize("call_order, kind, mode", CASES)
def test_loads_give_the_output_of_no_connector_in_each_order(
    tmp_path: Path, reference: list[list[int]], kind: str, mode: str, call_order: str,
) -> None:
    config = connector_config(kind, tmp_path)
    trace = tmp_path / "trace.jsonl"
    recorded = [config]
    if kind.startswith("multi"):  # its children record into the same file too: each child is
        # told only of its own completions (an async load's owner, a save's keepers)
        recorded += config["kv_connector_extra_config"]["connectors"]
    for c in recorded:
        c.setdefault("kv_connector_extra_config", {})["record_trace"] = str(trace)
    llm = LLM("builtin:tiny-llama", block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=64,
              kv_transfer_config=config, kv_connector_call_order=call_order, **MODES[mode])
    assert generate(llm)[0] == reference
    llm.reset_prefix_cache()
    if mode != "process":
        # Zeros: a load that lands after the forward read its blocks cannot go unnoticed.
        llm.engine.runner.kv_cache.zero_()
    tokens, cached = generate(llm)
    assert tokens == reference
    loads = KINDS[kind]
    assert all(n > 0 for n in cached) == (loads is not None), cached
    llm.shutdown()

    assert check_file(str(trace)) == []
    events = read_events(str(trace))
    header = TraceHeader("kvport", kvport.__version__, call_order)
    by_group: dict[tuple[int, str, str], list[TraceEvent]] = {}
    for e in events:
        by_group.setdefault((e.pid, e.role, e.connector), []).append(e)
    # scheduler and worker (in its own process or not), for each connector
    assert len(by_group) == 2 * len(recorded), list(by_group)
    for group in by_group.values():
        # (sees_all_stores: whether the connector keeps its store to itself; test_recording.py)
        assert group[0].method == HEADER and dataclasses.replace(
            TraceHeader.from_event(group[0]), sees_all_stores=False) == header
    for c in recorded:
        # recorded under the class the factory built (HMAMultiConnector: every child is HMA)
        ktc = KVTransferConfig.from_any(c)
        assert ktc is not None
        steps = worker_steps(events, connector_class_for(ktc).__name__)
        assert_follows(call_order, steps)
        sync_flags = {load.ints[0] for calls in steps for load in calls
                      if load.method == "start_load_kv"}
        assert sync_flags == ({0, 1} if loads else {0})


def test_the_default_order_is_vllm_0_32_and_a_bad_one_is_named() -> None:
    assert DEFAULT_KV_CONNECTOR_CALL_ORDER == VLLM_0_32
    assert (LEGACY, VLLM_0_32, VLLM_MRV2) == CALL_ORDERS
    llm = LLM("builtin:tiny-llama", block_size=BLOCK_SIZE, max_model_len=64,
              kv_transfer_config={"kv_connector": "NoOpConnector"})
    assert llm.config.kv_connector_call_order == VLLM_0_32
    assert llm.engine.runner.driver is not None and llm.engine.runner.driver.call_order == VLLM_0_32
    llm.shutdown()
    with pytest.raises(ValueError, match=r"kv_connector_call_order must be one of "
                                         r"\('legacy', 'vllm-0.32', 'vllm-mrv2'\), "
                                         r"got 'vllm-0.31'"):
        LLM("builtin:tiny-llama", kv_connector_call_order="vllm-0.31")


def test_the_command_line_takes_the_order() -> None:
    parser = build_parser()
    assert _engine_kwargs(parser.parse_args(["generate"]))["kv_connector_call_order"] == VLLM_0_32
    args = parser.parse_args(["generate", "--kv-connector-call-order", "legacy"])
    assert _engine_kwargs(args)["kv_connector_call_order"] == LEGACY
    args = parser.parse_args(["generate", "--kv-connector-call-order", "vllm-mrv2"])
    assert _engine_kwargs(args)["kv_connector_call_order"] == VLLM_MRV2
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["generate", "--kv-connector-call-order", "vllm-0.31"])
