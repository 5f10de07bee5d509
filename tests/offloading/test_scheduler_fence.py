"""The scheduler half's block-reuse fence, driven directly with hand-built scheduler outputs for
the case the engine tests cannot reach with this connector alone: a running request whose state
is sent to the runner in full again (after another connector's failed load rewound it) and that
gets new blocks in the same step."""

from __future__ import annotations

from kvport import SamplingParams
from kvport.connectors.base import KVCacheSpec
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler
from kvport.engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvport.engine.request import Request

BLOCK = 4
SPEC = KVCacheSpec(num_blocks=16, block_size=BLOCK, num_layers=1, num_kv_heads=1, head_dim=8,
                   dtype="float32", layout="blocks-layers-kv-tokens-heads-dim", hash_root=b"r")
PARAMS = SamplingParams(max_tokens=4)


def request(rid: str, num_tokens: int) -> Request:
    return Request(rid, [7 + i for i in range(num_tokens)] if rid == "X" else
                   [200 - i for i in range(num_tokens)], PARAMS, frozenset(), BLOCK, b"r")


def new_data(req: Request, block_ids: list[int], num_computed: int) -> NewRequestData:
    return NewRequestData(req.request_id, req.prompt_token_ids, [], PARAMS, 0, block_ids,
                          num_computed)


def output(step: int, new: list[NewRequestData], cached: list[CachedRequestData],
           scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), set(), set(), step)


def test_a_resent_requests_new_blocks_are_handed_out_again() -> None:
    half = OffloadingScheduler(OffloadingConfig(cpu_bytes_to_use=1 << 20, block_size=BLOCK),
                               OffloadGeometry.build(OffloadingConfig(cpu_bytes_to_use=1 << 20,
                                                                      block_size=BLOCK), SPEC))
    x, y = request("X", 8), request("Y", 5)
    # Step 0: X (blocks 0, 1) and Y (block 2, 3) are admitted and prefilled; X's two full
    # blocks get a store job.
    for req, blocks in ((x, [0, 1]), (y, [2, 3])):
        half.get_num_new_matched_tokens(req, 0)
        half.update_state_after_alloc(req, blocks, 0)
    meta = half.build_connector_meta(output(0, [new_data(x, [0, 1], 0), new_data(y, [2, 3], 0)],
                                            [], {"X": 8, "Y": 5}))
    (store,) = [job for job in meta.stores if job.src.block_ids == [0, 1]]
    # X finishes: its blocks go back to the pool at once, its store is still in flight.
    half.request_finished(x)
    # Step 1: Y is sent in full again (its runner state was reset) and got X's block 1 as a new
    # block: the store reading it must finish before this step writes it.
    meta = half.build_connector_meta(output(1, [new_data(y, [2, 3, 1], 4)], [], {"Y": 5}))
    assert meta.jobs_to_flush == {store.job_id}
    # Step 2: an ordinary decode step hands out a new block the same way.
    meta = half.build_connector_meta(output(2, [], [CachedRequestData("Y", [0], 9)], {"Y": 1}))
    assert meta.jobs_to_flush == {store.job_id}
