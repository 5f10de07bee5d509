"""RecordingConnector: transparent forwarding, the records it writes, and their check."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from utils import make_request

import kvport
from kvport.config import KVTransferConfig
from kvport.connectors.base import (
    ForwardContext,
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    layer_name,
)
from kvport.connectors.driver import StepContext
from kvport.connectors.factory import create_connector
from kvport.connectors.recording import RecordingConnector
from kvport.engine.step import SchedulerOutput
from kvport.trace.checker import check_file
from kvport.trace.events import HEADER, LEGACY, VLLM_0_32, TraceEvent, TraceHeader, read_events

SCHED, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER
NUM_LAYERS = 2

# legacy and vllm-0.32; vllm-mrv2 (vllm-0.32 plus finish_forward) is run in test_call_orders.py
# and tests/trace/test_profile_mrv2.py, not here: each engine run costs CI time
TWO_ORDERS = (LEGACY, VLLM_0_32)


class FakeConnector(KVConnectorBase):
    """Answers from tables; raises from `fail`; remembers the calls it got."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.matched: dict[str, tuple[int | None, bool]] = {}  # req_id -> answer, default (0, F)
        self.keeps_blocks: set[str] = set()  # request_finished answers True for these
        self.finished: dict[int, tuple[set[str] | None, set[str] | None]] = {}  # step -> answer
        self.fail: set[str] = set()  # methods that raise
        self.calls: list[str] = []
        self.steps: list[int] = []
        self.custom_attribute = "not on the base"
        self._step = -1

    def _seen(self, method: str) -> None:
        self.calls.append(method)
        if method in self.fail:
            raise RuntimeError(f"{method} failed on purpose")

    def trace_step(self, step: int) -> None:
        self.steps.append(step)
        self._step = step

    def start_load_kv(self, ctx: ForwardContext) -> None:
        self._seen("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._seen("wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        self._seen("save_kv_layer")

    def wait_for_save(self) -> None:
        self._seen("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._seen("get_finished")
        return self.finished.get(self._step, (None, None))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        self._seen("get_num_new_matched_tokens")
        return self.matched.get(request.request_id, (0, False))

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self._seen("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._seen("build_connector_meta")
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._seen("request_finished")
        return request.request_id in self.keeps_blocks, None


def make_pair(path: str, extra: dict[str, Any] | None = None, header: TraceHeader | None = None
              ) -> tuple[RecordingConnector, RecordingConnector]:
    config = KVTransferConfig("FakeConnector", kv_connector_extra_config=extra or {})
    return (RecordingConnector(FakeConnector(config, SCHED), path, header),
            RecordingConnector(FakeConnector(config, WORKER), path, header))


def fake(conn: RecordingConnector) -> FakeConnector:
    assert isinstance(conn.inner, FakeConnector)
    return conn.inner


def sched_out(step: int, scheduled: dict[str, int], finished: set[str] | None = None
              ) -> SchedulerOutput:
    return SchedulerOutput([], [], dict(scheduled), sum(scheduled.values()), set(),
                           set(finished or ()), step=step)


def worker_step(conn: RecordingConnector, out: SchedulerOutput) -> KVConnectorOutput:
    """The worker half of one step, in the contract's order (as the engine's driver runs it)."""
    conn.trace_step(out.step)
    meta = out.kv_connector_metadata
    ctx = ForwardContext(torch.zeros(1), out.num_scheduled_tokens, out.step)
    conn.handle_preemptions(meta)
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(ctx)
    if out.total_num_scheduled_tokens:
        for i in range(NUM_LAYERS):
            conn.wait_for_layer_load(layer_name(i))
            conn.save_kv_layer(layer_name(i), torch.zeros(1), ctx)
        conn.wait_for_save()
    sending, recving = conn.get_finished(set(out.finished_req_ids))
    invalid = conn.get_block_ids_with_load_errors()
    conn.build_connector_worker_meta()
    conn.get_kv_connector_stats()
    conn.clear_connector_metadata()
    return KVConnectorOutput(set(sending or ()), set(recving or ()), set(invalid))


def run_scenario(sched: RecordingConnector, worker: RecordingConnector) -> None:
    """"a" computes everything and its finish holds the blocks until sent; "b" loads async."""
    a, b = make_request("a", list(range(1, 10))), make_request("b", list(range(1, 12)))
    fake(sched).matched.setdefault("b", (8, True))
    fake(sched).keeps_blocks.add("a")
    fake(worker).finished = fake(worker).finished or {0: (None, {"b"}), 2: ({"a"}, None)}
    for req in (a, b):
        sched.on_new_request(req)

    def step(n: int, scheduled: dict[str, int], finished: set[str], admit: Any = (),
             finish: Any = ()) -> None:
        sched.trace_step(n)
        for req, local, blocks in admit:
            num_external, _ = sched.get_num_new_matched_tokens(req, local)
            sched.update_state_after_alloc(req, blocks, num_external or 0)
        out = sched_out(n, scheduled, finished)
        out.kv_connector_metadata = sched.build_connector_meta(out)
        kv_out = worker_step(worker, out)
        sched.trace_step(n)
        for req in finish:
            sched.request_finished(req, [1, 2, 3])
        sched.update_connector_output(kv_out)

    step(0, {"a": 9}, set(), admit=[(a, 0, [1, 2, 3]), (b, 0, [4, 5])])
    sched.trace_step(1)
    sched.update_state_after_alloc(b, [4, 5, 6], 0)  # resumed after its load, nothing external
    step(1, {"a": 1, "b": 3}, set(), finish=[a])
    step(2, {"b": 1}, {"a"}, finish=[b])
    step(3, {}, {"b"})
    sched.shutdown()
    worker.shutdown()


def test_scenario_records_every_call_and_checks_clean(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    sched, worker = make_pair(path)
    run_scenario(sched, worker)
    assert check_file(path) == []
    events = read_events(path)
    assert {e.pid for e in events} == {os.getpid()}
    by_method = {(e.role, e.method, tuple(e.req_ids)): e for e in events}
    match_b = by_method[("scheduler", "get_num_new_matched_tokens", ("b",))]
    assert (match_b.step, match_b.ints, match_b.result) == (0, [0], [8, True])
    alloc_a = by_method[("scheduler", "update_state_after_alloc", ("a",))]
    assert (alloc_a.ints, alloc_a.num_blocks) == ([0], 3)
    assert by_method[("scheduler", "request_finished", ("a",))].result is True
    assert by_method[("scheduler", "request_finished", ("b",))].result is False
    update = by_method[("scheduler", "update_connector_output", ("b",))]
    assert (update.step, update.finished_recving, update.finished_sending) == (0, ["b"], [])
    finished = by_method[("worker", "get_finished", ("a",))]
    assert (finished.step, finished.result) == (2, [["a"], []])
    layers = [(e.method, e.layer) for e in events if e.step == 0 and e.layer]
    assert layers == [("wait_for_layer_load", "layers.0"), ("save_kv_layer", "layers.0"),
                      ("wait_for_layer_load", "layers.1"), ("save_kv_layer", "layers.1")]
    # seq numbers the lines of this process; markers are recorded per trace_step call
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert fake(sched).steps == [0, 0, 1, 1, 1, 2, 2, 3, 3] and fake(worker).steps == [0, 1, 2, 3]


def test_broken_connector_answer_is_caught(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    sched, worker = make_pair(path)
    fake(sched).matched["a"] = (0, True)  # contract: is_async must be False for 0 tokens
    fake(worker).finished = {0: (None, {"b"}), 2: ({"a", "a2"}, None)}
    run_scenario(sched, worker)
    found = [(v.rule, v.step, v.req_id) for v in check_file(path)]
    assert found == [("S3", 0, "a"), ("S6", 2, "a2")]


def test_worker_order_break_is_caught(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    _, worker = make_pair(path)
    worker.trace_step(0)
    worker.bind_connector_metadata(KVConnectorMetadata())  # handle_preemptions forgotten
    worker_step(worker, sched_out(1, {"a": 4}))
    assert [(v.rule, v.step) for v in check_file(path)] == [("W1", 0), ("W3", 0), ("W6", 0),
                                                             ("W7", 0), ("W8", 0), ("W9", 0)]


def test_results_and_exceptions_pass_through_unchanged(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    sched, worker = make_pair(path)
    answer = ({"x"}, {"y"})
    fake(worker).finished = {-1: answer}
    assert worker.get_finished({"x"}) is answer
    out = sched_out(0, {})
    meta = sched.build_connector_meta(out)
    assert isinstance(meta, KVConnectorMetadata)
    fake(worker).fail.add("start_load_kv")
    with pytest.raises(RuntimeError, match="start_load_kv failed on purpose"):
        worker.start_load_kv(ForwardContext(torch.zeros(1), {}, 0))
    fake(sched).matched["odd"] = 7  # type: ignore[assignment]  # not a tuple: still returned
    assert sched.get_num_new_matched_tokens(make_request("odd", [1, 2]), 0) == 7
    records = {e.method: e for e in read_events(path)}
    assert records["get_finished"].result == [["x"], ["y"]]
    assert records["start_load_kv"].error == "RuntimeError: start_load_kv failed on purpose"
    assert records["get_num_new_matched_tokens"].result == "7"


def test_other_attributes_and_metadata_come_from_the_inner_connector(tmp_path: Path) -> None:
    _, worker = make_pair(str(tmp_path / "t.jsonl"))
    assert worker.custom_attribute == "not on the base"
    assert worker.role is WORKER
    meta = KVConnectorMetadata()
    worker.bind_connector_metadata(meta)
    assert worker.has_connector_metadata() and fake(worker).has_connector_metadata()
    assert worker._get_connector_metadata() is meta
    assert worker._connector_metadata is meta  # the wrapper keeps no metadata of its own
    with pytest.raises(AttributeError):
        _ = worker.no_such_attribute


def test_recorder_overrides_every_public_base_method() -> None:
    # a base method the recorder does not define would run the base default, not the inner one
    public = {name for name, _ in inspect.getmembers(KVConnectorBase) if not name.startswith("_")}
    missing = sorted(public - set(vars(RecordingConnector)))
    assert missing == [], f"RecordingConnector does not forward {missing}"


def test_line_schema(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    sched, worker = make_pair(str(path))
    worker.trace_step(5)
    worker.wait_for_layer_load("layers.3")
    worker.register_kv_caches(torch.zeros(1), KVCacheSpec(10, 16, 2, 1, 4, "float32", "x"))
    sched.update_connector_output(KVConnectorOutput({"s"}, {"r"}, {3, 1}))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    head = {"pid": os.getpid(), "connector": "FakeConnector"}
    assert lines[0] == {**head, "seq": lines[0]["seq"], "role": "worker", "step": 5,
                        "method": "trace_step"}
    assert lines[1] == {**head, "seq": lines[0]["seq"] + 1, "role": "worker", "step": 5,
                        "method": "wait_for_layer_load", "layer": "layers.3"}
    assert lines[2]["ints"] == [10, 16, 2]
    assert lines[3] == {**head, "seq": lines[0]["seq"] + 3, "role": "scheduler", "step": None,
                        "method": "update_connector_output", "req_ids": ["r", "s"],
                        "finished_sending": ["s"], "finished_recving": ["r"],
                        "invalid_block_ids": [1, 3]}


def test_labels_tell_instances_apart_and_honour_a_name(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    first, second = make_pair(path)[0], make_pair(path)[0]
    named = make_pair(path, {"name": "storage1"})[0]
    for conn in (first, second, named):
        conn.take_events()
    assert [e.connector for e in read_events(path)] == ["FakeConnector", "FakeConnector#2",
                                                        "storage1"]


def test_nested_recorders_forward_steps(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    _, inner = make_pair(path)
    outer = RecordingConnector(inner, path)
    outer.trace_step(4)
    outer.wait_for_save()
    assert fake(inner).steps == [4]
    assert [(e.connector, e.method, e.step) for e in read_events(path)] == [
        ("RecordingConnector", "trace_step", 4), ("FakeConnector", "trace_step", 4),
        ("FakeConnector", "wait_for_save", 4), ("RecordingConnector", "wait_for_save", 4)]


def test_shutdown_closes_the_file_and_later_calls_still_forward(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    _, worker = make_pair(path)
    fd = worker._writer.fileno()
    worker.shutdown()
    with pytest.raises(OSError):
        os.fstat(fd)
    worker.wait_for_save()
    assert fake(worker).calls == ["wait_for_save"]
    assert [e.method for e in read_events(path)] == ["shutdown"]


def test_factory_wraps_on_record_trace(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    config = KVTransferConfig("FakeConnector", kv_connector_module_path="test_recording",
                              kv_connector_extra_config={"record_trace": path})
    conn = create_connector(config, SCHED)
    assert isinstance(conn, RecordingConnector) and type(conn.inner).__name__ == "FakeConnector"
    conn.has_pending_work()
    assert [e.method for e in read_events(path)] == ["has_pending_work"]


def test_factory_hands_the_header_to_recorders_and_a_multi_connectors_children(
        tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    child = {"kv_connector": "FakeConnector", "kv_connector_module_path": "test_recording",
             "kv_connector_extra_config": {"record_trace": path}}
    config = KVTransferConfig("MultiConnector", kv_connector_extra_config={
        "record_trace": path, "connectors": [child, child]})
    header = TraceHeader("kvport", "9.9", "legacy")
    conn = create_connector(config, SCHED, header)
    conn.has_pending_work()
    got = groups(read_events(path))
    assert sorted(connector for _, _, connector in got) == [
        "FakeConnector", "FakeConnector#2", "MultiConnector"]
    for records in got.values():
        assert TraceHeader.from_event(records[0]) == header
        assert [e.method for e in records[1:]] == ["has_pending_work"]


def test_two_processes_append_whole_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    _, worker = make_pair(path)
    pid = os.fork()
    if pid == 0:  # child: the same recorder object, its own pid and seq
        try:
            for _ in range(200):
                worker.wait_for_layer_load("layers.0")
        finally:
            os._exit(0)
    for _ in range(200):
        worker.save_kv_layer("layers.0", torch.zeros(1), ForwardContext(torch.zeros(1), {}, 0))
    os.waitpid(pid, 0)
    events = read_events(path)
    by_pid = {p: [e for e in events if e.pid == p] for p in {e.pid for e in events}}
    assert sorted(len(v) for v in by_pid.values()) == [200, 200]
    assert by_pid[pid][0].method == "wait_for_layer_load"
    for records in by_pid.values():
        assert [e.seq for e in records] == list(range(records[0].seq, records[0].seq + 200))


def groups(events: list[TraceEvent]) -> dict[tuple[int, str, str], list[TraceEvent]]:
    """Records per (pid, role, connector), in file order: what the checker checks apart."""
    out: dict[tuple[int, str, str], list[TraceEvent]] = {}
    for e in events:
        out.setdefault((e.pid, e.role, e.connector), []).append(e)
    return out


def test_a_recorder_given_the_engine_header_writes_it_first(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    header = TraceHeader("kvport", "9.9", "vllm-0.32")
    sched, worker = make_pair(path, header=header)
    outside, _ = make_pair(path, {"name": "outside"})  # no engine said who it is
    worker.trace_step(0)
    worker.wait_for_save()
    sched.take_events()
    worker.wait_for_save()
    outside.take_events()
    got = groups(read_events(path))
    for role in ("worker", "scheduler"):
        first, *rest = got[(os.getpid(), role, "FakeConnector")]
        assert (first.method, first.step, first.result) == (HEADER, None, header.to_result())
        assert TraceHeader.from_event(first) == header
        assert all(e.method != HEADER for e in rest)  # once per group
        assert [e.seq for e in [first, *rest]] == sorted(e.seq for e in [first, *rest])
    assert [e.method for e in got[(os.getpid(), "scheduler", "outside")]] == ["take_events"]


def test_a_forked_child_starts_its_own_group_with_the_header(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    _, worker = make_pair(path, header=TraceHeader("kvport", "9.9", "legacy"))
    worker.wait_for_save()
    pid = os.fork()
    if pid == 0:
        try:
            worker.wait_for_save()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    got = groups(read_events(path))
    assert [e.method for e in got[(os.getpid(), "worker", "FakeConnector")]] == [
        HEADER, "wait_for_save"]
    assert [e.method for e in got[(pid, "worker", "FakeConnector")]] == [HEADER, "wait_for_save"]


def test_start_load_kv_records_whether_the_step_has_sync_loads(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    _, worker = make_pair(path)
    kv = torch.zeros(1)
    worker.start_load_kv(StepContext(kv, {"a": 4}, 0, has_sync_kv_loads=True))
    worker.start_load_kv(StepContext(kv, {"a": 4}, 1, has_sync_kv_loads=False))
    worker.start_load_kv(ForwardContext(kv, {"a": 4}, 2))  # not from the driver: none known
    assert [e.ints for e in read_events(path)] == [[1], [0], [0]]


@pytest.mark.parametrize("call_order", TWO_ORDERS)
@pytest.mark.parametrize("worker", ["inproc", "process"])
def test_engine_run_with_example_connector_checks_clean(tmp_path: Path, worker: str,
                                                        call_order: str) -> None:
    from kvport import LLM, SamplingParams

    trace = str(tmp_path / "t.jsonl")
    llm = LLM("builtin:tiny-llama", block_size=4, max_model_len=64, worker=worker,
              kv_connector_call_order=call_order,
              kv_transfer_config={"kv_connector": "ExampleConnector", "kv_connector_extra_config": {
                  "shared_storage_path": str(tmp_path / "s"), "record_trace": trace}})
    prompts = [list(range(1, 22)), list(range(1, 22)) + [5, 6], list(range(3, 20))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()  # the second run's hits come from the connector's storage
    second = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_no_leaks()
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(o.num_cached_tokens > 0 for o in second)
    assert check_file(trace) == []
    events = read_events(trace)
    assert {e.role for e in events} == {"scheduler", "worker"}
    # ExampleConnector is SupportsHMA: it finishes through request_finished_all_groups
    assert sum(e.method == "request_finished_all_groups" for e in events) == 2 * len(prompts)
    assert events[-1].method == "shutdown"
    # Each half (the worker in its own process or not) starts with the engine's header.
    by_group = groups(events)
    assert len({pid for pid, _, _ in by_group}) == (2 if worker == "process" else 1)
    for records in by_group.values():
        assert TraceHeader.from_event(records[0]) == TraceHeader(  # its store is shared
            "kvport", kvport.__version__, call_order, sees_all_stores=False)
    # The sync loads of the second run are flagged in their start_load_kv records.
    flags = [e.ints for e in events if e.method == "start_load_kv"]
    assert [1] in flags and [0] in flags and set(map(len, flags)) == {1}
