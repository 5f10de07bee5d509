"""MultiConnector without an engine: fan-out rules over recording fake children."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from connector_fakes import (
    FakeConnector, FakeMetadata, FakeWorkerMeta, TracingFakeConnector, assert_identical_trees,
    fake_child, make_kv_cache, new_req, sched_out, worker_step,
)
from utils import make_request

from kvport.config import KVTransferConfig
from kvport.connectors.base import (
    ForwardContext, KVCacheEvent, KVCacheSpec, KVConnectorBase, KVConnectorMetadata,
    KVConnectorOutput, KVConnectorRole,
)
from kvport.connectors.example import ExampleConnectorMetadata
from kvport.connectors.factory import create_connector
from kvport.connectors.multi import (
    MultiConnector, MultiConnectorMetadata, MultiConnectorWorkerMetadata,
)

SCHED, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER
PROMPT = list(range(100, 111))


def make_multi(role: KVConnectorRole, *children: dict[str, Any]) -> MultiConnector:
    config = KVTransferConfig("MultiConnector",
                              kv_connector_extra_config={"connectors": list(children)})
    conn = create_connector(config, role)
    assert isinstance(conn, MultiConnector)
    return conn


def fakes(multi: MultiConnector) -> list[FakeConnector]:
    children = list(multi.connectors)
    assert all(isinstance(c, FakeConnector) for c in children)
    return children  # type: ignore[return-value]


def calls(child: FakeConnector, method: str) -> list[tuple[Any, ...]]:
    return [c[1:] for c in child.calls if c[0] == method]


def jobs(*job_ids: int) -> FakeWorkerMeta:
    return FakeWorkerMeta(frozenset(job_ids))


def meta_of(multi: MultiConnector, step: int = 0, **kw: Any) -> MultiConnectorMetadata:
    meta = multi.build_connector_meta(sched_out(step, **kw))
    assert isinstance(meta, MultiConnectorMetadata)
    return meta


def test_overrides_every_public_base_method() -> None:
    public = [name for name, member in inspect.getmembers(KVConnectorBase, inspect.isfunction)
              if not name.startswith("_")]
    assert len(public) > 20
    # Not a hook: bind/clear set the MultiConnector's own metadata together with its children's,
    # so the inherited answer is already "every child is bound".
    own_state = {"has_connector_metadata"}
    missing = [name for name in public if name not in MultiConnector.__dict__ | dict.fromkeys(own_state)]
    assert missing == [], f"MultiConnector inherits {missing}: a child hook would be skipped"


@pytest.mark.parametrize(("children", "match"), [
    ([], "at least one"),
    ([None], r"connectors\[0\]"),
    ([fake_child("a"), {"kv_connector": "FakeConnector", "bogus": 1}], r"connectors\[1\].*bogus"),
    ([{"kv_connector": "NoSuchConnector"}], "unknown KV connector 'NoSuchConnector'"),
    ([fake_child("a", colour="red")], "colour"),
])
def test_bad_child_configs_are_rejected(children: list[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_multi(SCHED, *children)


def test_first_child_with_tokens_owns_the_load_and_every_child_gets_the_blocks() -> None:
    multi = make_multi(SCHED, fake_child("a", matched_tokens=0), fake_child("b", matched_tokens=8),
                       fake_child("c", matched_tokens=4))
    a, b, c = fakes(multi)
    req = make_request("r", PROMPT)
    assert multi.get_num_new_matched_tokens(req, 0) == (8, False)
    assert [calls(x, "get_num_new_matched_tokens") for x in (a, b, c)] == [[("r", 0)]] * 3
    multi.update_state_after_alloc(req, [5, 6, 7], 8)
    assert [calls(x, "update_state_after_alloc") for x in (a, b, c)] == [
        [("r", [5, 6, 7], 0)], [("r", [5, 6, 7], 8)], [("r", [5, 6, 7], 0)]]
    # The owner is consumed: a later allocation of the same request (0 external) gives 0 to all.
    multi.update_state_after_alloc(req, [5, 6, 7, 8], 0)
    assert [calls(x, "update_state_after_alloc")[-1][2] for x in (a, b, c)] == [0, 0, 0]


def test_any_child_that_cannot_answer_yet_defers_the_request() -> None:
    multi = make_multi(SCHED, fake_child("a", matched_tokens=8),
                       fake_child("b", matched_tokens=None))
    a, b = fakes(multi)
    req = make_request("r", PROMPT)
    assert multi.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(calls(b, "get_num_new_matched_tokens")) == 1  # every child was asked
    b.matched_tokens = 0
    assert multi.get_num_new_matched_tokens(req, 0) == (8, False)
    a.matched_tokens = 0
    assert multi.get_num_new_matched_tokens(req, 0) == (0, False)  # the earlier owner is forgotten
    multi.update_state_after_alloc(req, [1], 0)
    with pytest.raises(RuntimeError, match="no child matched"):
        multi.update_state_after_alloc(make_request("s", PROMPT), [2], 4)


def test_metadata_keeps_child_order_and_reaches_each_child() -> None:
    sched = make_multi(SCHED, fake_child("a"), fake_child("b"))
    worker = make_multi(WORKER, fake_child("a"), fake_child("b"))
    meta = meta_of(sched, step=3)
    assert meta.per_connector == (FakeMetadata("a", 3), FakeMetadata("b", 3))
    worker_step(worker, meta, make_kv_cache())
    for name, child in zip("ab", fakes(worker), strict=True):
        expected = FakeMetadata(name, 3)
        assert calls(child, "handle_preemptions") == [(expected,)]
        assert calls(child, "bind_connector_metadata") == [(expected,)]
        assert child.names()[:4] == ["handle_preemptions", "bind_connector_metadata",
                                     "start_load_kv", "wait_for_layer_load"]
        assert child.names()[-1] == "clear_connector_metadata"
        assert calls(child, "save_kv_layer") == [("layers.0",), ("layers.1",)]
    assert not worker.has_connector_metadata()
    with pytest.raises(TypeError, match="MultiConnectorMetadata"):
        worker.bind_connector_metadata(KVConnectorMetadata())


def test_send_is_reported_once_after_the_last_saver() -> None:
    children = [fake_child("a", keep_blocks=True), fake_child("b"),
                fake_child("c", keep_blocks=True)]
    sched, worker = make_multi(SCHED, *children), make_multi(WORKER, *children)
    a, b, c = fakes(worker)
    req = make_request("r", PROMPT)
    assert sched.request_finished(req, [4, 5]) == (True, None)
    assert [calls(x, "request_finished") for x in fakes(sched)] == [[("r", [4, 5])]] * 3
    # The next step names r in finished_req_ids and carries its savers.
    meta = meta_of(sched, step=1, finished=["r"])
    assert meta.savers == {"r": (0, 2)}
    a.report_sending = {"r"}
    b.report_sending = {"r"}  # not a saver: dropped
    assert worker_step(worker, meta, make_kv_cache(), finished={"r"}, forward=False)[0] is None
    c.report_sending = {"r"}
    a.report_sending = {"r"}  # a duplicate: dropped
    assert worker_step(worker, meta_of(sched, step=2), make_kv_cache())[0] == {"r"}
    c.report_sending = {"r"}  # late: dropped
    assert worker_step(worker, meta_of(sched, step=3), make_kv_cache())[0] is None
    assert worker.get_kv_connector_stats() == {}  # the driver already collected them per step


def test_dropped_reports_are_counted_in_stats() -> None:
    worker = make_multi(WORKER, fake_child("a"), fake_child("b"))
    a, b = fakes(worker)
    b.report_recving, a.report_sending = {"x"}, {"y"}
    a.stats = {"num_jobs": 2}
    sched = make_multi(SCHED, fake_child("a"), fake_child("b"))
    worker.bind_connector_metadata(meta_of(sched))
    assert worker.get_finished(set()) == (None, None)
    assert worker.get_kv_connector_stats() == {
        "0.FakeConnector": {"num_jobs": 2},
        "MultiConnector": {"num_dropped_finished_recving": 1, "num_dropped_finished_sending": 1}}
    assert worker.get_kv_connector_stats() == {"0.FakeConnector": {"num_jobs": 2}}


def test_no_saver_means_blocks_are_freed_and_params_are_merged() -> None:
    sched = make_multi(SCHED, fake_child("a"), fake_child("b"), fake_child("c"))
    a, b, c = fakes(sched)
    a.params, c.params = {"remote_host": "h"}, {"remote_port": 7}
    assert sched.request_finished(make_request("r", PROMPT), [1]) == (
        False, {"remote_host": "h", "remote_port": 7})
    assert meta_of(sched).savers == {}
    b.params = {"remote_port": 8}
    with pytest.raises(ValueError, match="'remote_port'.*1.FakeConnector and 2.FakeConnector"):
        sched.request_finished(make_request("s", PROMPT), [1])


def test_a_failing_child_never_frees_blocks_another_child_reads() -> None:
    sched = make_multi(SCHED, fake_child("a"), fake_child("b", keep_blocks=True))
    a, b = fakes(sched)
    a.fail = {"request_finished"}
    assert sched.request_finished(make_request("r", PROMPT), [1]) == (True, None)
    assert meta_of(sched).savers == {"r": (1,)}
    b.keep_blocks = False
    with pytest.raises(RuntimeError, match="a.request_finished failed"):
        sched.request_finished(make_request("s", PROMPT), [1])


def test_async_load_is_reported_once_and_only_by_its_owner() -> None:
    children = [fake_child("a", matched_tokens=0, load_async=True),
                fake_child("b", matched_tokens=8, load_async=True)]
    sched, worker = make_multi(SCHED, *children), make_multi(WORKER, *children)
    a, b = fakes(worker)
    req = make_request("r", PROMPT)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, True)
    sched.update_state_after_alloc(req, [1, 2, 3], 8)
    meta = meta_of(sched)
    assert meta.async_load_owners == {"r": 1}
    a.report_recving = {"r"}  # a did not load r (the duplicate of vLLM #51864): dropped
    assert worker_step(worker, meta, make_kv_cache(), forward=False)[1] is None
    b.report_recving = {"r"}
    assert worker_step(worker, meta_of(sched, step=1), make_kv_cache(), forward=False)[1] == {"r"}
    b.report_recving = {"r"}  # a second report: dropped
    assert worker_step(worker, meta_of(sched, step=2), make_kv_cache(), forward=False)[1] is None


def test_sync_load_owner_is_not_tracked_by_the_worker() -> None:
    sched = make_multi(SCHED, fake_child("a", matched_tokens=8))
    req = make_request("r", PROMPT)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [1, 2, 3], 8)
    assert meta_of(sched).async_load_owners == {}


def test_each_child_is_told_only_of_its_own_completions() -> None:
    """A child hears of the async load it owns and of the saves it kept, nothing else: a child
    told of another's load (or save) would see a completion it never started (S7, S6 in its own
    trace)."""
    sched = make_multi(SCHED, fake_child("a"), fake_child("b", matched_tokens=8, load_async=True),
                       fake_child("c", keep_blocks=True))
    a, b, c = fakes(sched)
    loading, kept = make_request("load", PROMPT), make_request("kept", PROMPT)
    assert sched.get_num_new_matched_tokens(loading, 0) == (8, True)  # b owns the load
    sched.update_state_after_alloc(loading, [1, 2, 3], 8)
    assert sched.request_finished(kept, [4, 5]) == (True, None)  # only c keeps the blocks
    meta_of(sched)
    sched.update_connector_output(KVConnectorOutput(finished_sending={"kept"},
                                                    finished_recving={"load"}))
    seen = [x.outputs_seen[-1] for x in (a, b, c)]
    assert [s.finished_recving for s in seen] == [set(), {"load"}, set()]
    assert [s.finished_sending for s in seen] == [set(), set(), {"kept"}]
    # Reported once: a repeat (which the worker half never sends) reaches no child.
    sched.update_connector_output(KVConnectorOutput(finished_sending={"kept"},
                                                    finished_recving={"load"}))
    assert all(not x.outputs_seen[-1].finished_recving and not x.outputs_seen[-1].finished_sending
               for x in (a, b, c))


def test_worker_metadata_is_per_child_and_aggregates_elementwise() -> None:
    worker = make_multi(WORKER, fake_child("a"), fake_child("b"), fake_child("c"))
    a, b, c = fakes(worker)
    assert worker.build_connector_worker_meta() is None  # no child has any
    a.worker_meta, c.worker_meta = FakeWorkerMeta(frozenset({1})), FakeWorkerMeta(frozenset({2}))
    m1 = worker.build_connector_worker_meta()
    assert m1 == MultiConnectorWorkerMetadata((FakeWorkerMeta(frozenset({1})), None,
                                               FakeWorkerMeta(frozenset({2}))))
    m2 = MultiConnectorWorkerMetadata((jobs(3), jobs(4), None))
    assert m1.aggregate(m2) == MultiConnectorWorkerMetadata((
        jobs(1, 3), jobs(4), jobs(2)))
    assert m1.aggregate(m2) == m2.aggregate(m1)
    with pytest.raises(ValueError, match="cannot aggregate"):
        m1.aggregate(MultiConnectorWorkerMetadata((None,)))
    # The scheduler half hands each child its own element and its own stats.
    sched = make_multi(SCHED, fake_child("a"), fake_child("b"), fake_child("c"))
    out = KVConnectorOutput(finished_sending={"r"}, worker_meta=m1,
                            stats={"0.FakeConnector": {"n": 1}, "MultiConnector": {"x": 1}})
    sched.update_connector_output(out)
    seen = [x.outputs_seen[0] for x in fakes(sched)]
    assert [s.worker_meta for s in seen] == list(m1.per_connector)
    assert [s.stats for s in seen] == [{"n": 1}, {}, {}]
    assert all(s.finished_sending == set() for s in seen)  # no child kept "r"
    assert out.worker_meta is m1 and out.finished_sending == {"r"}  # left as it was
    with pytest.raises(TypeError, match="MultiConnectorWorkerMetadata"):
        sched.update_connector_output(KVConnectorOutput(worker_meta=FakeWorkerMeta(frozenset())))


def test_load_errors_events_pending_work_and_reset_are_combined() -> None:
    worker = make_multi(WORKER, fake_child("a"), fake_child("b"))
    wa, wb = fakes(worker)
    wa.load_errors, wb.load_errors = {1, 2}, {2, 9}
    assert worker.get_block_ids_with_load_errors() == {1, 2, 9}
    sched = make_multi(SCHED, fake_child("a"), fake_child("b"))
    a, b = fakes(sched)
    e1, e2, e3 = (KVCacheEvent((bytes([i]),), "disk", False) for i in range(3))
    a.events, b.events = [e1, e2], [e3]
    assert sched.take_events() == [e1, e2, e3]
    assert sched.has_pending_work() is False
    a.pending_work = True
    assert sched.has_pending_work() is True
    assert len(calls(b, "has_pending_work")) == 2  # every child is asked, every time
    assert sched.reset_cache() is None  # no child supports it
    a.reset_result = True
    assert sched.reset_cache() is True
    b.reset_result = False
    assert sched.reset_cache() is False
    assert len(calls(b, "reset_cache")) == 3


def test_shutdown_reaches_every_child_even_if_one_raises() -> None:
    multi = make_multi(WORKER, fake_child("a"), fake_child("b"), fake_child("c"))
    a, b, c = fakes(multi)
    a.fail = {"shutdown"}
    c.fail = {"shutdown"}
    with pytest.raises(RuntimeError, match="a.shutdown failed"):
        multi.shutdown()
    assert [len(calls(x, "shutdown")) for x in (a, b, c)] == [1, 1, 1]


def test_a_raising_child_neither_stops_the_others_nor_loses_completions() -> None:
    children = [fake_child("a", keep_blocks=True), fake_child("b", keep_blocks=True)]
    sched, worker = make_multi(SCHED, *children), make_multi(WORKER, *children)
    a, b = fakes(worker)
    sched.request_finished(make_request("r", PROMPT), [1])
    worker.bind_connector_metadata(meta_of(sched, finished=["r"]))
    a.fail = {"start_load_kv", "get_finished", "build_connector_worker_meta"}
    with pytest.raises(RuntimeError, match="a.start_load_kv failed"):
        worker.start_load_kv(ForwardContext(make_kv_cache(), {}, 0))
    assert len(calls(b, "start_load_kv")) == 1
    # b's report and worker metadata arrive in a call that raises: they come with the next one.
    b.report_sending, b.worker_meta = {"r"}, FakeWorkerMeta(frozenset({5}))
    with pytest.raises(RuntimeError, match="a.get_finished failed"):
        worker.get_finished({"r"})
    with pytest.raises(RuntimeError, match="a.build_connector_worker_meta failed"):
        worker.build_connector_worker_meta()
    a.fail, a.report_sending, b.worker_meta = set(), {"r"}, None
    assert worker.get_finished(set()) == ({"r"}, None)
    assert worker.build_connector_worker_meta() == MultiConnectorWorkerMetadata(
        (None, FakeWorkerMeta(frozenset({5}))))
    assert worker.build_connector_worker_meta() is None


def test_trace_step_reaches_every_child() -> None:
    tracing = {**fake_child("t"), "kv_connector": "TracingFakeConnector"}
    multi = make_multi(SCHED, fake_child("a"), tracing)
    plain, traced = multi.connectors
    assert isinstance(traced, TracingFakeConnector) and not isinstance(plain, TracingFakeConnector)
    multi.trace_step(7)  # the plain child takes the base class's no-op
    assert calls(traced, "trace_step") == [(7,)]


def test_other_hooks_fan_out_in_child_order() -> None:
    sched = make_multi(SCHED, fake_child("a"), fake_child("b"))
    req = make_request("r", PROMPT)
    sched.on_new_request(req)
    assert [calls(x, "on_new_request") for x in fakes(sched)] == [[("r",)]] * 2
    worker = make_multi(WORKER, fake_child("a"), fake_child("b"))
    kv = make_kv_cache()
    worker.register_kv_caches(kv, KVCacheSpec(16, 4, 2, 2, 3, "float32", "test"))
    assert [calls(x, "register_kv_caches") for x in fakes(worker)] == [[(2,)]] * 2


def test_two_example_children_write_identical_trees(tmp_path: Path) -> None:
    children = [{"kv_connector": "ExampleConnector",
                 "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / name)}}
                for name in ("s1", "s2")]
    sched, worker = make_multi(SCHED, *children), make_multi(WORKER, *children)
    req = make_request("r", PROMPT)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [3, 4, 5], 0)
    meta = meta_of(sched, new=[new_req(req, [3, 4, 5])], scheduled={"r": 11})
    worker_step(worker, meta, make_kv_cache(seed=9))
    assert_identical_trees(tmp_path / "s1", tmp_path / "s2")
    # Both have it now; the first child owns the load.
    again = make_request("again", PROMPT)
    assert sched.get_num_new_matched_tokens(again, 0) == (8, False)
    sched.update_state_after_alloc(again, [6, 7, 8], 8)
    parts = meta_of(sched, new=[new_req(again, [6, 7, 8], 8)], scheduled={"again": 3}).per_connector
    assert all(isinstance(m, ExampleConnectorMetadata) for m in parts)
    assert [[x.block_ids for x in m.loads] for m in parts] == [[(6, 7)], []]  # type: ignore[attr-defined]



@settings(max_examples=60, deadline=None)
@given(keeps=st.lists(st.booleans(), min_size=1, max_size=4),
       reports=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), max_size=24))
def test_send_accounting_under_any_report_order(
    keeps: list[bool], reports: list[tuple[int, int]],
) -> None:
    """Whatever the children report, in whatever order and how often (child, request), each
    request comes out once, exactly when its last saver has reported it, and never otherwise."""
    children = [fake_child(f"c{i}", keep_blocks=k) for i, k in enumerate(keeps)]
    sched, worker = make_multi(SCHED, *children), make_multi(WORKER, *children)
    rids = ["r0", "r1", "r2"]
    for rid in rids:
        sched.request_finished(make_request(rid, PROMPT), [1])
    worker.bind_connector_metadata(meta_of(sched, finished=rids))
    savers = {i for i, k in enumerate(keeps) if k}
    reported: dict[str, set[int]] = {rid: set() for rid in rids}
    emitted: list[str] = []
    for child_idx, r in reports:
        if child_idx >= len(keeps):
            continue
        rid = rids[r]
        fakes(worker)[child_idx].report_sending = {rid}
        sending, _ = worker.get_finished(set())
        before = savers <= reported[rid]
        reported[rid].add(child_idx)
        if savers and not before and savers <= reported[rid]:
            assert sending == {rid}
            emitted.append(rid)
        else:
            assert sending is None
    assert len(emitted) == len(set(emitted))
