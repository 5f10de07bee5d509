"""kvport.vllm's RecordingConnector: vLLM connectors recorded inside vLLM's CPU build (SmolLM2-135M,
float32, one engine per process: run_trace.py), checked by kvport's trace checker under the
"vllm-0.32" call order the trace header names.

The workload: four prompts sharing a 256-token prefix (two of vLLM's 128-token blocks), each
with 120 tokens of its own, two rounds with vLLM's prefix cache dropped in between (round 2 hits
the connector), and a KV pool of 9 blocks (8 and vLLM's null block), too small for four requests
that each grow into a fourth block: vLLM preempts. Every recorded run must give the output of
vLLM without a connector.

The engines run in the session's engine pool (conftest.py): processes that import vLLM once and
build a fresh engine per configuration, side by side.
"""

from __future__ import annotations

import inspect
import json
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import vllm
from base_hooks import ADDED
from engine_pool import EnginePool
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvport.trace.checker import check_trace
from kvport.trace.events import HEADER, STEP_MARKER, TraceEvent, TraceHeader, read_events
from kvport.vllm.recording import RecordingConnector
from kvport.vllm.recording_stats import RecordingStats

PREFIX_TOKENS = 256
PREFIX = [(i * 37) % 30000 + 100 for i in range(PREFIX_TOKENS)]
PROMPTS = [PREFIX + [(1000 + q * 101 + j * 13) % 30000 + 50 for j in range(120)] for q in range(4)]
WORKLOAD = {"prompts": PROMPTS, "rounds": 2, "max_tokens": 12,
            "llm_kwargs": {"num_gpu_blocks_override": 9}}
# The kvport-vs-vLLM comparison: each prompt in a generate() of its own (nothing waits beside
# a request: the engines admit waiting requests differently, and vLLM 0.32 shares a prefix that
# is being computed in the same step, kvport's engine does not), a pool that never preempts,
# offload blocks of 128 tokens in both engines (kvport: 8 of its 16-token blocks; vLLM: one
# block), so the prefix is two offload blocks in both and every local hit a multiple of 128.
COMPARE_PROMPTS = PROMPTS[:3]
COMPARE = {"prompts": COMPARE_PROMPTS, "rounds": 2, "max_tokens": 6, "one_at_a_time": True}
OFFLOAD_EXTRA = {"cpu_bytes_to_use": 256 << 20, "block_size": 128}
# Calls one engine makes and the other has no counterpart for (or makes a different number of
# times for the same work): left out of the per-request comparison.
FINISHES = ("request_finished", "request_finished_all_groups")
SCHEDULER_CALLS_COMPARED = ("on_new_request", "get_num_new_matched_tokens",
                            "update_state_after_alloc", "request_finished",
                            "request_finished_all_groups")


def recording(trace: Path, inner: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvport.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"record_trace": str(trace), "connector": inner,
                                          **extra}}


def example(store: Path, **kw: Any) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(store)}, **kw}


def offloading() -> dict[str, Any]:
    return {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
            "kv_connector_extra_config": dict(OFFLOAD_EXTRA)}


def kvport_connector(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A kvport connector inside vLLM (kvport.vllm holds it and translates vLLM's objects)."""
    return {"kv_connector": name, "kv_connector_module_path": "kvport.vllm",
            "kv_connector_extra_config": extra}


def trace_connector(kind: str, store: Path, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": kind, "kv_connector_module_path": "trace_connectors",
            "kv_connector_extra_config": {"shared_storage_path": str(store), **extra}}


def run_kvport(trace: Path) -> list[list[int]]:
    """kvport's own engine, its own recorder, the same connector and prompts as "compare"."""
    from kvport import LLM, SamplingParams

    llm = LLM("builtin:smollm2-135m", dtype="float32", block_size=16,
              max_model_len=1024, kv_transfer_config={
                  "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {**OFFLOAD_EXTRA, "record_trace": str(trace)}})
    params = SamplingParams(max_tokens=COMPARE["max_tokens"], temperature=0.0, ignore_eos=True)
    tokens = []
    for _ in range(COMPARE["rounds"]):
        tokens.append([o.outputs[0].token_ids for p in COMPARE_PROMPTS
                       for o in llm.generate([p], params, use_tqdm=False)])
        llm.reset_prefix_cache()
    llm.shutdown()
    return tokens


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, engine_pool: EnginePool) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("vllm-trace")
    multi_children = [
        recording(d / "multi-children.jsonl", example(d / "store-a", kv_role="kv_both"),
                  name="child-a"),
        recording(d / "multi-children.jsonl", example(d / "store-b", kv_role="kv_both"),
                  name="child-b")]
    configs: dict[str, dict[str, Any]] = {
        "plain": WORKLOAD,
        "example": {**WORKLOAD, "kv_transfer_config": recording(
            d / "example.jsonl", example(d / "store-example"))},
        # The outer MultiConnector recorded, and each child by a recorder of its own (children
        # of a MultiConnector are built by vLLM's factory too). async_scheduling is asked for:
        # vLLM's CPU platform turns it off (the run reports what the engine used).
        "multi": {**WORKLOAD, "llm_kwargs": {**WORKLOAD["llm_kwargs"], "async_scheduling": True},
                  "kv_transfer_config": recording(d / "multi.jsonl", {
                      "kv_connector": "MultiConnector",
                      "kv_connector_extra_config": {"connectors": multi_children}})},
        # With vLLM's stats logger on: kvport's stats reach it through RecordingStats, and the
        # logger rebuilds them with RecordingConnector.build_kv_connector_stats every step.
        "offloading": {**WORKLOAD, "llm_kwargs": {**WORKLOAD["llm_kwargs"],
                                                  "disable_log_stats": False},
                       "kv_transfer_config": recording(d / "offloading.jsonl", offloading())},
        "async": {**WORKLOAD, "kv_transfer_config": recording(
            d / "async.jsonl", trace_connector("AsyncLoadExample", d / "store-async"))},
        "stale": {**WORKLOAD, "kv_transfer_config": recording(
            d / "stale.jsonl", trace_connector("StaleAnswerAsyncExample", d / "store-stale",
                                              stale_log=str(d / "stale-log.jsonl")))},
        # The same children under a composite that hands them preemptions after their bind.
        "late-preemptions": {**WORKLOAD, "kv_transfer_config": recording(
            d / "late-preemptions.jsonl", {
                "kv_connector": "PreemptionsAfterBindMulti",
                "kv_connector_module_path": "trace_connectors",
                "kv_connector_extra_config": {"connectors": [
                    recording(d / "late-children.jsonl",
                              example(d / "store-late-a", kv_role="kv_both"), name="child-a"),
                    recording(d / "late-children.jsonl",
                              example(d / "store-late-b", kv_role="kv_both"), name="child-b"),
                ]}})},
        "compare": {**COMPARE, "kv_transfer_config": recording(d / "compare.jsonl",
                                                                offloading())},
        # kvport's other connectors inside vLLM, each recorded.
        "kvport-example": {**WORKLOAD, "kv_transfer_config": recording(
            d / "kvport-example.jsonl", kvport_connector("ExampleConnector", {
                "shared_storage_path": str(d / "store-kvport-example")}))},
        "kvport-multi": {**WORKLOAD, "kv_transfer_config": recording(
            d / "kvport-multi.jsonl", kvport_connector("MultiConnector", {"connectors": [
                {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {
                    "shared_storage_path": str(d / "store-kvport-multi")}},
                {"kv_connector": "OffloadingConnector",
                 "kv_connector_extra_config": dict(OFFLOAD_EXTRA)}]}))},
        "kvport-noop": {**WORKLOAD, "kv_transfer_config": recording(
            d / "kvport-noop.jsonl", kvport_connector("NoOpConnector", {}))},
    }
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = {name: pool.submit(engine_pool.run, "trace", cfg)
                   for name, cfg in configs.items()}
        kvport_tokens = run_kvport(d / "kvport.jsonl")
        results = {name: f.result()[0] for name, f in futures.items()}
    results["kvport_tokens"] = kvport_tokens
    results["dir"] = d
    return results


def events(runs: dict[str, Any], name: str) -> list[TraceEvent]:
    return read_events(str(runs["dir"] / f"{name}.jsonl"))


def assert_same_output(run: dict[str, Any], plain: dict[str, Any]) -> None:
    assert "error" not in run, run.get("traceback")
    for got, want in zip(run["rounds"], plain["rounds"], strict=True):
        assert got["tokens"] == want["tokens"]
        diff = max(abs(x - y) for a, b in zip(got["logprobs"], want["logprobs"])
                   for x, y in zip(a, b))
        assert diff <= 1e-4, f"logprobs differ by {diff}"


# ---- the recorded runs ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["example", "multi", "offloading", "async", "kvport-example",
                                  "kvport-multi", "kvport-noop"])
def test_recorded_connectors_give_plain_output_and_pass_the_checker(
        runs: dict[str, Any], name: str) -> None:
    run = runs[name]
    assert_same_output(run, runs["plain"])
    assert run["preemptions"] > 0, "the pool was meant to force preemption"
    trace = events(runs, name)
    assert check_trace(trace) == []
    # One header per recorder, first; the scheduler numbered one step per build.
    headers = [e for e in trace if e.method == HEADER]
    assert {(e.role, TraceHeader.from_event(e)) for e in headers} == {
        (role, TraceHeader("vllm", vllm.__version__, "vllm-0.32"))
        for role in ("scheduler", "worker")}
    for role in ("scheduler", "worker"):
        mine = [e for e in trace if e.role == role]
        assert mine[0].method == HEADER
    builds = [e for e in trace if e.method == "build_connector_meta"]
    assert [e.step for e in builds] == list(range(run["steps"]))


def test_round_two_hits_the_connector(runs: dict[str, Any]) -> None:
    """After vLLM's prefix cache is dropped the prompts come from the connector: synchronously
    for ExampleConnector and kvport's host tier (start_load_kv before the forward, ints [1]),
    asynchronously for the async example (a no-forward step whose start_load_kv says [0])."""
    for name, is_async in (("example", False), ("multi", False), ("offloading", False),
                           ("async", True), ("kvport-example", False), ("kvport-multi", False)):
        trace = events(runs, name)
        answers = [e.result for e in trace if e.method == "get_num_new_matched_tokens"
                   and e.result and e.result[0]]
        assert answers and all(a[1] is is_async for a in answers), (name, answers)
        sync_loads = [e for e in trace if e.method == "start_load_kv" and e.ints == [1]]
        assert bool(sync_loads) is not is_async, name
        recvd = [r for e in trace if e.method == "update_connector_output"
                 for r in e.finished_recving]
        assert bool(recvd) is is_async, (name, recvd)
        assert runs[name]["rounds"][1]["num_cached_tokens"] == [PREFIX_TOKENS] * 4


def test_worker_follows_vllm_0_32_order(runs: dict[str, Any]) -> None:
    """What the vllm-0.32 profile encodes, seen in a raw trace: layer hooks come before
    start_load_kv on steps without sync loads and after it on steps with them (kvport's host
    hits), and wait_for_save runs on every step."""
    trace = [e for e in events(runs, "offloading") if e.role == "worker"]
    steps: dict[int, list[str]] = defaultdict(list)
    sync_steps = {e.step for e in trace if e.method == "start_load_kv" and e.ints == [1]}
    for e in trace:
        if e.step is not None and e.method not in (STEP_MARKER, "has_connector_metadata"):
            steps[e.step].append(e.method)
    assert all(names.count("wait_for_save") == 1 for names in steps.values())
    forward = {step: names for step, names in steps.items() if "save_kv_layer" in names}
    assert sync_steps and set(forward) - sync_steps
    for step, names in forward.items():
        load_first = names.index("start_load_kv") < names.index("save_kv_layer")
        assert load_first == (step in sync_steps), (step, names)
    assert steps[0][:2] == ["handle_preemptions", "bind_connector_metadata"]


def test_multi_connector_outer_and_children(runs: dict[str, Any]) -> None:
    """The outer MultiConnector and each child (recorded by RecordingConnectors that vLLM's
    MultiConnector built from its child configs) all pass the checker. Per request, anchored at
    its own first event: the first child with a hit loads, the second gets the blocks with 0.
    vLLM's CPU platform turned the requested async scheduling off."""
    assert runs["multi"]["async_scheduling"] is False
    children = read_events(str(runs["dir"] / "multi-children.jsonl"))
    assert check_trace(children) == []
    per_child: dict[str, dict[str, list[tuple[Any, ...]]]] = defaultdict(lambda: defaultdict(list))
    for e in children:
        if e.role == "scheduler" and e.method in ("get_num_new_matched_tokens",
                                                  "update_state_after_alloc"):
            result = e.result if e.method == "get_num_new_matched_tokens" else None
            per_child[e.connector][e.req_ids[0]].append((e.method, tuple(e.ints), result))
    assert set(per_child) == {"child-a", "child-b"}
    loads = {child: sum(1 for seq in reqs.values() for m, ints, _ in seq
                        if m == "update_state_after_alloc" and ints[0] > 0)
             for child, reqs in per_child.items()}
    assert loads["child-a"] > 0 and loads["child-b"] == 0, loads
    # Both children were asked the same questions, and answered alike (they hold the same KV).
    assert per_child["child-a"].keys() == per_child["child-b"].keys()
    for rid, seq in per_child["child-a"].items():
        asked = [(m, ints, res) for m, ints, res in seq if m == "get_num_new_matched_tokens"]
        assert asked == [(m, ints, res) for m, ints, res in per_child["child-b"][rid]
                         if m == "get_num_new_matched_tokens"], rid


# ---- a seed defect on real vLLM ------------------------------------------------------------------


def test_stale_answer_after_preemption_is_reported_at_its_step_and_request(
        runs: dict[str, Any]) -> None:
    """The preemption seed, re-created: a connector keeps per-request state across a preemption
    (its first match answer) and answers (0, True) when vLLM asks again. vLLM 0.32 stops on a
    bare assertion in its scheduler; the checker names the broken rule (S3) at the step and
    request the connector logged itself, and nothing else but that the step was cut short (S1:
    vLLM never built its metadata). The same workload with the correct connector
    (AsyncLoadExample) passes (test_recorded_connectors_give_plain_output_and_pass_the_checker).
    """
    stale = runs["stale"]
    assert stale["error"].startswith("AssertionError"), stale.get("error")
    assert "vllm/v1/core/sched/scheduler.py" in stale["traceback"]
    assert stale["rounds"][0]["tokens"] == runs["plain"]["rounds"][0]["tokens"]  # before it
    log = [json.loads(line) for line in (runs["dir"] / "stale-log.jsonl").read_text().splitlines()]
    assert len(log) == 1, log
    violations = check_trace(events(runs, "stale"))
    by_rule = {v.rule: (v.step, v.req_id) for v in violations}
    assert len(violations) == len(by_rule) == 2, [str(v) for v in violations]
    assert by_rule["S3"] == (log[0]["step"], log[0]["req_id"])
    assert by_rule["S1"] == (log[0]["step"], None)


def test_preemptions_handed_over_after_the_bind_are_reported_at_the_preempting_steps(
        runs: dict[str, Any]) -> None:
    """The seed "metadata used before preemptions are handled", re-created in a composite
    (PreemptionsAfterBindMulti): vLLM calls the composite in order, so its own trace is clean;
    each child, recorded on its own, gets bind_connector_metadata before handle_preemptions on
    exactly the steps vLLM preempted on, and the checker says so there (W1, and W2 for the bind
    that no longer follows handle_preemptions), nowhere else. The same children under vLLM's
    MultiConnector pass (test_recorded_connectors_give_plain_output_and_pass_the_checker)."""
    run = runs["late-preemptions"]
    assert_same_output(run, runs["plain"])  # ExampleConnector has nothing to do on a preemption
    assert run["preempted_steps"], "the pool was meant to force preemption"
    assert check_trace(events(runs, "late-preemptions")) == []
    violations = check_trace(events(runs, "late-children"))
    for child in ("child-a", "child-b"):
        found = [(v.rule, v.step) for v in violations if child in v.message]
        want = [(rule, step) for step in run["preempted_steps"] for rule in ("W1", "W2")]
        assert found == want, [str(v) for v in violations]


# ---- the same connector in kvport's engine and in vLLM ------------------------------------------


def per_request(trace: list[TraceEvent]) -> dict[int, list[tuple[Any, ...]]]:
    """Scheduler calls naming each request, in order; requests numbered in arrival order (the
    engines name them differently)."""
    order: dict[str, int] = {}
    out: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for e in trace:
        if e.role != "scheduler":
            continue
        if e.method == "on_new_request":
            order.setdefault(e.req_ids[0], len(order))
        if e.method in SCHEDULER_CALLS_COMPARED:
            # One group: both finish calls are one contract (kvport's engine calls the one of
            # a SupportsHMA connector, vLLM with its allocator off the other)
            method = "request_finished" if e.method in FINISHES else e.method
            result = e.result if method in ("get_num_new_matched_tokens",
                                            "request_finished") else None
            ints = tuple(e.ints) if method != "on_new_request" else ()
            out[order[e.req_ids[0]]].append((method, ints, result))
        elif e.method == "update_connector_output":
            for rid in e.finished_recving:
                out[order[rid]].append(("finished_recving",))
    return out


def test_same_connector_same_scheduler_calls_in_kvport_and_vllm(runs: dict[str, Any]) -> None:
    """kvport's OffloadingConnector recorded by kvport's own recorder in kvport's engine, and
    by RecordingConnector inside vLLM: per request, the same scheduler calls with the same
    arguments and answers (round 1 stores; round 2 loads the prefix asynchronously, then the
    next request finds it in the engine's own cache; the load is synchronous in both, a host
    hit, and its request prefills in the step that admits it). Engine-specific calls are left out:
    build_connector_meta (how often a request is scheduled), take_events, stats, vLLM-only
    hooks. num_blocks differs with the engines' block sizes and is not compared."""
    n = COMPARE["max_tokens"]
    for got, plain in zip(runs["compare"]["rounds"], runs["plain"]["rounds"], strict=True):
        assert got["tokens"] == [t[:n] for t in plain["tokens"][:len(COMPARE_PROMPTS)]]
    kvport = per_request(read_events(str(runs["dir"] / "kvport.jsonl")))
    vllm = per_request(events(runs, "compare"))
    assert kvport == vllm
    # round 2's first request loaded the prefix synchronously: no finished_recving
    assert vllm[3][1] == ("get_num_new_matched_tokens", (0,), [PREFIX_TOKENS, False])
    assert ("finished_recving",) not in vllm[3]
    # then the next request finds the loaded prefix in the engine's own cache
    assert vllm[4][1] == ("get_num_new_matched_tokens", (PREFIX_TOKENS,), [0, False])
    assert check_trace(events(runs, "compare")) == []


# ---- the wrapper itself (no engine) --------------------------------------------------------------


def test_every_public_base_hook_is_forwarded() -> None:
    public = {n for n, _ in inspect.getmembers(KVConnectorBase_V1) if not n.startswith("_")}
    public |= set(ADDED)  # 0.33's and 0.34's
    missed = sorted(n for n in public if n not in vars(RecordingConnector) and n != "role")
    assert missed == [], f"vLLM connector hooks the recorder does not forward: {missed}"
    assert not inspect.isabstract(RecordingConnector)


def test_stats_dict_names_the_inner_connector() -> None:
    from kvport.vllm.stats import KvportStats

    ref = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm"}
    stats = RecordingStats(KvportStats(data={"host.hit_tokens": 3}), ref)
    both = stats.aggregate(RecordingStats(KvportStats(data={"host.hit_tokens": 4}), ref))
    rebuilt = RecordingConnector.build_kv_connector_stats(both.to_dict())
    assert isinstance(rebuilt, KvportStats) and rebuilt.data == {"host.hit_tokens": 7}
    assert RecordingConnector.build_kv_connector_stats({"x": 1}) is None


def test_class_level_hooks_answer_for_the_inner_connector() -> None:
    extra = {"record_trace": "t.jsonl", "connector": {
        "kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]}}}
    assert RecordingConnector.requires_piecewise_for_cudagraph(extra) is False
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_both",
                           kv_connector_module_path="kvport.vllm", kv_connector_extra_config={
                               "connector": offloading()})
    assert RecordingConnector.supports_sleep_mode(ktc) is False  # kvport's answer
    # vLLM 0.34's: kvport's (the base's defaults), and another connector's own
    assert RecordingConnector.kv_cache_access(ktc) == 0
    assert RecordingConnector.supports_lookahead_block_hashes(ktc) is False
    ktc = KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_both",
                           kv_connector_module_path="kvport.vllm", kv_connector_extra_config={
                               "connector": {"kv_connector": "Hooks034Example",
                                             "kv_connector_module_path": "trace_connectors"}})
    assert RecordingConnector.kv_cache_access(ktc) == 1
    assert RecordingConnector.supports_lookahead_block_hashes(ktc) is True


@pytest.mark.parametrize(("extra", "message"), [
    ({"record_trace": "t.jsonl"}, r"no 'connector': pass the kv_transfer_config"),
    ({"connector": "ExampleConnector"}, r"'connector' must be a kv_transfer_config dict"),
    ({"connector": {"kv_connector_extra_config": {}}}, r"'connector' has no kv_connector"),
    ({"connector": {"kv_connector": "NoSuchConnector"}},
     r"kv_connector='NoSuchConnector' from vLLM's connector registry.*ExampleConnector"),
    ({"connector": {"kv_connector": "Nope", "kv_connector_module_path": "kvport.vllm"}},
     r"kv_connector='Nope' from module 'kvport.vllm'"),
    ({"connector": {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}},
     r"'connector' sets kv_role='kv_consumer' but the outer config has kv_role='kv_both'"),
    ({"connector": {"kv_connector": "ExampleConnector"}, "cpu_bytes_to_use": 1},
     r"unknown kv_connector_extra_config key\(s\) \['cpu_bytes_to_use'\]"),
])
def test_bad_configs_name_the_value_and_what_to_pass(extra: dict[str, Any], message: str) -> None:
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="RecordingConnector", kv_role="kv_both",
                           kv_connector_module_path="kvport.vllm",
                           kv_connector_extra_config=extra)
    with pytest.raises(ValueError, match=message):
        RecordingConnector.get_required_kvcache_layout(_config_with(ktc))


def _config_with(ktc: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(kv_transfer_config=ktc)


def test_offloading_connector_points_record_trace_at_the_recorder() -> None:
    from harness import kv_cache_config, offload_extra, vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvport.vllm.connector import OffloadingConnector

    config = vllm_config({**offload_extra(), "record_trace": "t.jsonl"})
    with pytest.raises(ValueError, match=r"remove it, and record with kvport.vllm's "
                                         r"RecordingConnector.*\"RecordingConnector\""):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(16))


def harness_with(tmp_path: Path, record: bool) -> Any:
    """vLLM's real Scheduler and a worker-side connector (tests/vllm/harness.py), both
    RecordingConnectors around kvport's OffloadingConnector."""
    import torch
    from harness import (
        BLOCK_SIZE,
        HEAD,
        HEADS,
        LAYERS,
        NUM_LAYERS,
        Harness,
        kv_cache_config,
        offload_extra,
        vllm_config,
    )
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    extra: dict[str, Any] = {"connector": {
        "kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
        "kv_connector_extra_config": offload_extra()}}
    if record:
        extra["record_trace"] = str(tmp_path / "trace.jsonl")
    config = vllm_config({})
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="RecordingConnector", kv_connector_module_path="kvport.vllm",
        kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    # vLLM settled its hybrid allocator for the config's first connector (SupportsHMA): the
    # recorder is not, as vLLM would have decided for it from the start
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    num_blocks = 64
    kcc = kv_cache_config(num_blocks)
    config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kcc, log_stats=True,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK_SIZE)
    worker = RecordingConnector(config, KVConnectorRole.WORKER, kcc)
    storage = torch.zeros((NUM_LAYERS, num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD))
    worker.register_kv_caches({name: storage[i] for i, name in enumerate(LAYERS)})
    return Harness(config, scheduler, worker, storage)  # type: ignore[arg-type]


def drive(h: Any) -> list[Any]:
    """Two requests sharing a prefix, the prefix cache dropped, the same two again."""
    outs = []
    prompt = [(7 * i) % 90 + 3 for i in range(40)]
    for rnd in range(2):
        h.add(f"a{rnd}", prompt + [91, 92])
        h.add(f"b{rnd}", prompt + [93])
        for _ in range(50):
            if not h.scheduler.has_requests():
                break
            outs.append(h.step())
        assert h.scheduler.reset_prefix_cache()
    return outs


def test_recording_on_real_scheduler_wraps_metadata_and_checks_clean(tmp_path: Path) -> None:
    from kvport.vllm.recording_steps import RecordingMetadata

    h = harness_with(tmp_path, record=True)
    outs = drive(h)
    assert all(isinstance(o.kv_connector_metadata, RecordingMetadata) for o in outs)
    assert [o.kv_connector_metadata.step for o in outs] == list(range(len(outs)))
    inner = h.scheduler.connector.inner
    assert inner.scheduler_half.stats.num_host_hit_tokens > 0  # round 2 loaded from the host
    assert h.scheduler.connector.may_load_async(h.add("c", [5] * 20)) is False  # kvport's
    h.worker.shutdown()
    h.scheduler.connector.shutdown()
    trace = read_events(str(tmp_path / "trace.jsonl"))
    assert check_trace(trace) == []
    methods = Counter(e.method for e in trace)
    assert methods["may_load_async"] == 1  # vLLM 0.34's hook, forwarded and recorded
    assert methods["build_connector_meta"] == methods["handle_preemptions"] == len(outs)
    loads = [e for e in trace if e.method == "start_load_kv"]
    assert {tuple(e.ints) for e in loads} == {(0,), (1,)}  # host hits load synchronously


def test_recording_off_only_forwards(tmp_path: Path) -> None:
    from kvport.vllm.metadata import VllmMetadata

    h = harness_with(tmp_path, record=False)
    outs = drive(h)
    assert all(isinstance(o.kv_connector_metadata, VllmMetadata) for o in outs)
    w = h.worker
    assert not w.recording and not list(tmp_path.iterdir())
    # The per-layer hooks are the inner connector's own bound methods: no call in between.
    assert w.wait_for_layer_load == w.inner.wait_for_layer_load
    assert w.save_kv_layer == w.inner.save_kv_layer
    assert h.scheduler.connector.scheduler_half.stats.num_host_hit_tokens > 0  # __getattr__


def test_overhead_bench_recorder_mode_compares_the_wrapped_example_connector() -> None:
    from kvport.bench.common.machine import machine_info
    from kvport.bench.overhead.config import (
        EXAMPLE,
        WRAPPED,
        OverheadConfig,
        OverheadResult,
        OverheadSystem,
    )
    from kvport.bench.overhead.report import format_overhead
    from kvport.bench.overhead.vllm import engine_kwargs

    cfg = OverheadConfig.for_engine("vllm", "m", recorder=True)
    kwargs = engine_kwargs(cfg, "/model", "/tmp/store")
    assert list(kwargs) == [EXAMPLE, WRAPPED]
    wrapped = kwargs[WRAPPED]["kv_transfer_config"]
    assert wrapped["kv_connector"] == "RecordingConnector"
    assert "record_trace" not in wrapped["kv_connector_extra_config"]  # recording off
    inner = wrapped["kv_connector_extra_config"]["connector"]
    assert inner["kv_connector"] == kwargs[EXAMPLE]["kv_transfer_config"]["kv_connector"]
    assert inner["kv_connector_extra_config"] != \
        kwargs[EXAMPLE]["kv_transfer_config"]["kv_connector_extra_config"]  # own directories
    systems = tuple(OverheadSystem(n, r, r / 100, [r], EXAMPLE, r / 100, 0)
                    for n, r in ((EXAMPLE, 100.0), (WRAPPED, 99.0)))
    text = format_overhead(OverheadResult(cfg, machine_info(), systems,
                                          vllm_info={"vllm_version": "0.32.0"}))
    assert f"target {WRAPPED} decode tokens/s vs {EXAMPLE} (paired): 0.990x >= 0.980x: met" in text


def test_the_events_overhead_run_differs_only_by_events_and_stats() -> None:
    """connector-overhead --engine vllm --events: the same storing engine twice, the second with
    vLLM's KV events published (to a loopback endpoint) and stats logged."""
    from kvport.bench.overhead.config import EVENTS, STORING, OverheadConfig
    from kvport.bench.overhead.vllm import engine_kwargs

    cfg = OverheadConfig.for_engine("vllm", "m", events=True)
    kwargs = engine_kwargs(cfg, "/model")
    assert list(kwargs) == [STORING, EVENTS] and cfg.target == (EVENTS, STORING, 0.98)
    on = dict(kwargs[EVENTS])
    events = on.pop("kv_events_config")
    assert events["enable_kv_cache_events"] and events["endpoint"].startswith("tcp://127.0.0.1:")
    assert on.pop("disable_log_stats") is False
    assert on == kwargs[STORING]
    with pytest.raises(ValueError, match="pick one"):
        OverheadConfig.for_engine("vllm", "m", events=True, recorder=True)


def test_the_vllm_only_overhead_comparisons_refuse_kvports_engine(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvport.cli import main

    for flag in ("--events", "--recorder", "--recording"):
        assert main(["bench", "connector-overhead", flag]) == 2
        assert "add --engine vllm" in capsys.readouterr().err
