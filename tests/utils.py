"""Shared factories and oracles for the test suite."""

from __future__ import annotations

from collections.abc import Callable

from kvport.config import EngineConfig
from kvport.engine.block_pool import BlockPool
from kvport.engine.hashing import namespace_hash
from kvport.engine.kv_cache_manager import KVCacheManager
from kvport.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvport.engine.request import Request
from kvport.engine.scheduler import Scheduler
from kvport.sampling_params import SamplingParams

TEST_ROOT = namespace_hash("test-model", "float32", 4, "test-layout")
EOS = 0


def make_request(
    rid: str, prompt: list[int], max_tokens: int = 4, block_size: int = 4, **params: object
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(rid, prompt, sp, frozenset({EOS}), block_size,
                   namespace_hash("test-model", "float32", block_size, "test-layout"))


def make_scheduler(
    num_blocks: int, block_size: int = 4, max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16, max_model_len: int = 64, enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    config = EngineConfig(
        block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill)
    pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
    return Scheduler(config, KVCacheManager(pool, block_size))


def fake_runner_output(
    scheduler: Scheduler, sched_out: SchedulerOutput,
    next_token: Callable[[Request], int] = lambda req: 1 + req.num_tokens % 97,
) -> ModelRunnerOutput:
    """What a model runner would return: a token for each request that reached its end."""
    out = ModelRunnerOutput()
    for rid in sched_out.num_scheduled_tokens:
        req = scheduler.requests[rid]
        if req.num_computed_tokens == req.num_tokens:
            out.sampled_token_ids[rid] = [next_token(req)]
    return out


def run_step(scheduler: Scheduler, **kw: object) -> tuple[SchedulerOutput, list[Request]]:
    sched_out = scheduler.schedule()
    finished = scheduler.update_from_output(sched_out, fake_runner_output(scheduler, sched_out, **kw))
    return sched_out, finished


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """Nothing leaked: no requests, no block tables, every block free and the pool consistent."""
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.kv.num_requests == 0, f"block tables left: {list(scheduler.kv.req_to_blocks)}"
    scheduler.kv.pool.assert_all_free()
