"""The scheduler half's answer to "may the engine reuse these blocks?", driven directly with
hand-built scheduler outputs: a finished request is held while its stores are in flight and
named in the next metadata; a preempted request's jobs are flushed; with synchronous stores
(vLLM) nothing is ever held."""

from __future__ import annotations

from kvport import SamplingParams
from kvport.connectors.base import KVCacheSpec, KVConnectorOutput
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.metadata import JobResult, OffloadingWorkerMetadata
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler
from kvport.engine.request import Request
from kvport.connectors.views import NewRequestRecord, SchedulerOutputRecord

BLOCK = 4
SPEC = KVCacheSpec(num_blocks=16, block_size=BLOCK, num_layers=1, num_kv_heads=1, head_dim=8,
                   dtype="float32", layout="blocks-layers-kv-tokens-heads-dim", hash_root=b"r")
PARAMS = SamplingParams(max_tokens=4)
CONFIG = OffloadingConfig(cpu_bytes_to_use=1 << 20, block_size=BLOCK)


def half(sync_stores: bool = False) -> OffloadingScheduler:
    return OffloadingScheduler(CONFIG, OffloadGeometry.build(CONFIG, SPEC),
                               sync_stores=sync_stores)


def request(rid: str, num_tokens: int) -> Request:
    return Request(rid, [7 + i for i in range(num_tokens)], PARAMS, frozenset(), BLOCK, b"r")


def step(sched: OffloadingScheduler, n: int, reqs: list[tuple[Request, list[int]]],
         preempted: frozenset[str] = frozenset()) -> object:
    new = [NewRequestRecord(r.request_id, blocks, 0) for r, blocks in reqs]
    scheduled = {r.request_id: r.num_tokens for r, _ in reqs}
    return sched.build_connector_meta(SchedulerOutputRecord(
        new, [], scheduled, sum(scheduled.values()), set(preempted), set(), n))


def admit(sched: OffloadingScheduler, req: Request, blocks: list[int]) -> None:
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, blocks, 0)


def copied(sched: OffloadingScheduler, job_id: int) -> None:
    sched.update_connector_output(KVConnectorOutput(worker_meta=OffloadingWorkerMetadata(
        [JobResult(job_id, True)])))


def test_a_finished_request_is_held_until_its_stores_copied() -> None:
    sched = half()
    x = request("X", 8)
    admit(sched, x, [0, 1])
    (store,) = step(sched, 0, [(x, [0, 1])]).stores  # type: ignore[attr-defined]
    assert sched.request_finished(x) is True  # its store still reads blocks 0 and 1
    meta = step(sched, 1, [])
    assert meta.held == {"X": [store.job_id]}  # type: ignore[attr-defined]
    assert step(sched, 2, []).held == {}  # type: ignore[attr-defined]  # named once
    copied(sched, store.job_id)
    sched.check_no_leaks()


def test_a_finished_request_whose_stores_reported_is_not_held() -> None:
    sched = half()
    x = request("X", 8)
    admit(sched, x, [0, 1])
    (store,) = step(sched, 0, [(x, [0, 1])]).stores  # type: ignore[attr-defined]
    copied(sched, store.job_id)
    assert sched.request_finished(x) is False
    assert step(sched, 1, []).held == {}  # type: ignore[attr-defined]
    sched.check_no_leaks()


def test_a_preempted_requests_stores_are_flushed() -> None:
    sched = half()
    x = request("X", 8)
    admit(sched, x, [0, 1])
    (store,) = step(sched, 0, [(x, [0, 1])]).stores  # type: ignore[attr-defined]
    meta = step(sched, 1, [], preempted=frozenset({"X"}))
    assert meta.jobs_to_flush == {store.job_id}  # type: ignore[attr-defined]
    copied(sched, store.job_id)
    assert sched.request_finished(x) is False


def test_with_synchronous_stores_nothing_is_held() -> None:
    sched = half(sync_stores=True)
    x = request("X", 8)
    admit(sched, x, [0, 1])
    (store,) = step(sched, 0, [(x, [0, 1])]).stores  # type: ignore[attr-defined]
    assert sched.request_finished(x) is False  # its copy ended within the step (vLLM)
    copied(sched, store.job_id)
    sched.check_no_leaks()
