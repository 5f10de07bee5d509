"""Shared factories and oracles for the test suite."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvport.config import EngineConfig, KVTransferConfig
from kvport.connectors.base import ForwardContext, KVCacheSpec, KVConnectorRole
from kvport.connectors.driver import KVConnectorDriver
from kvport.connectors.factory import create_connector
from kvport.engine.block_pool import BlockPool
from kvport.engine.hashing import namespace_hash
from kvport.engine.kv_cache_manager import KVCacheManager
from kvport.engine.request import Request
from kvport.engine.scheduler import Scheduler
from kvport.engine.step import ModelRunnerOutput, SchedulerOutput
from kvport.sampling_params import SamplingParams
from kvport.trace.events import TraceHeader

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
    enable_chunked_prefill: bool = True, kv_transfer_config: KVTransferConfig | None = None,
    header: TraceHeader | None = None, group_windows: tuple[int | None, ...] = (None,),
) -> Scheduler:
    """`group_windows`: the KV cache groups' sliding windows (None: full attention)."""
    config = EngineConfig(
        block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
        kv_transfer_config=kv_transfer_config)
    pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching,
                     reserve_null_block=any(w is not None for w in group_windows))
    connector = None
    if config.kv_transfer_config is not None:
        connector = create_connector(config.kv_transfer_config, KVConnectorRole.SCHEDULER, header)
    return Scheduler(config, KVCacheManager(pool, block_size, group_windows=group_windows),
                     connector)


def mock_connector_config(policy: str = "recompute", **extra: object) -> KVTransferConfig:
    return KVTransferConfig("MockConnector", kv_connector_module_path="connector_mock",
                            kv_connector_extra_config=dict(extra), kv_load_failure_policy=policy)


class FakeWorker:
    """The worker side without a model: the real lifecycle driver over a dummy pool, and the
    fake runner's tokens."""

    def __init__(self, scheduler: Scheduler, num_layers: int = 2,
                 header: TraceHeader | None = None) -> None:
        ktc = scheduler.config.kv_transfer_config
        assert ktc is not None
        bs = scheduler.kv.block_size
        self.kv_cache = torch.zeros(scheduler.kv.pool.num_blocks, num_layers, 2, bs, 1, 1)
        spec = KVCacheSpec(scheduler.kv.pool.num_blocks, bs, num_layers, 1, 1, "float32", "test")
        self.connector = create_connector(ktc, KVConnectorRole.WORKER, header)
        self.driver = KVConnectorDriver(self.connector, self.kv_cache, spec)
        self.num_layers = num_layers

    def execute(self, scheduler: Scheduler, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        ctx = ForwardContext(self.kv_cache, sched_out.num_scheduled_tokens, sched_out.step)
        self.driver.pre_forward(sched_out, ctx)
        did_forward = sched_out.total_num_scheduled_tokens > 0
        if did_forward:
            for layer in range(self.num_layers):
                self.driver.before_attention(layer)
                self.driver.after_attention(layer, self.kv_cache)
        out = fake_runner_output(scheduler, sched_out)
        out.kv_connector_output = self.driver.post_forward(sched_out, did_forward)
        return out

    def step(self, scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
        sched_out = scheduler.schedule()
        return sched_out, scheduler.update_from_output(sched_out, self.execute(scheduler, sched_out))


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
    assert not scheduler.xfer.held_request_ids, f"held: {scheduler.xfer.held_request_ids}"
    scheduler.kv.pool.assert_all_free()
