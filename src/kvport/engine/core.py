"""Engine core: builds the pool, scheduler and runner, and runs steps.

One step is three calls: schedule, execute, update. Everything that crosses between them is plain
data (`SchedulerOutput`, `ModelRunnerOutput`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorRole
from kvport.connectors.driver import KVConnectorDriver
from kvport.engine.block_pool import BlockPool
from kvport.engine.connector_setup import create_engine_connector
from kvport.engine.device import resolve_device
from kvport.engine.executor import (
    Executor, InProcExecutor, ProcessExecutor, build_runner, engine_kv_groups,
)
from kvport.engine.hashing import engine_hash_root
from kvport.engine.kv_cache_manager import KVCacheManager
from kvport.engine.request import Request, RequestStatus
from kvport.engine.runner import ModelRunner, kv_cache_spec
from kvport.engine.scheduler import Scheduler
from kvport.engine.step import ModelRunnerOutput, SchedulerOutput
from kvport.model.attention import kv_block_bytes
from kvport.model.kv_groups import KVCacheGroup, slots_per_block
from kvport.model.loader import LoadedModel, load_model, resolve_dtype
from kvport.model.state_cache import check_state_fits
from kvport.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
DEFAULT_KV_CACHE_CAP_BYTES = 1 << 30  # default pool: room for max_num_seqs full requests, <= 1 GiB


def plan_kv_pool(config: EngineConfig, model_max_len: int, block_bytes: int,
                 groups: tuple[KVCacheGroup, ...] = ()) -> tuple[int, int]:
    """(blocks in the KV pool, max_model_len). An explicit max_model_len above the model's limit
    is an error; None means the model's limit, capped (with a warning) by what the pool holds
    when the pool is sized by num_kv_blocks, kv_cache_bytes or the default memory cap.

    With several KV cache groups one request holds a table per group (a sliding group at most
    its window and one step's tokens) and the pool keeps one null block."""
    bs = config.block_size
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={model_max_len}; pass max_model_len <= "
                         f"{model_max_len}, or leave it unset for the model's own limit")
    max_len = config.max_model_len if config.max_model_len is not None else model_max_len
    blocks_per_seq = blocks_per_request(groups, max_len, bs, config.max_num_batched_tokens)
    if config.num_kv_blocks is not None:
        num = config.num_kv_blocks
    elif config.kv_cache_bytes is not None:
        num = config.kv_cache_bytes // block_bytes
    else:
        wanted = config.max_num_seqs * blocks_per_seq
        num = min(wanted, DEFAULT_KV_CACHE_CAP_BYTES // block_bytes)
        if config.max_model_len is not None:
            num = max(num, blocks_per_seq)  # an explicit length is honoured beyond the cap
    if num < blocks_per_seq and config.max_model_len is None and num > 0:
        fits = num * bs // max(1, len(groups))  # every group holding the whole length
        logger.warning("max_model_len=%d: the model allows %d tokens, but the KV pool of %d "
                       "blocks x %d tokens holds %d (pass num_kv_blocks or kv_cache_bytes for "
                       "more)", fits, model_max_len, num, bs, fits)
        return num, fits
    if num < blocks_per_seq:
        raise ValueError(
            f"KV pool of {num} blocks x {bs} tokens cannot hold one request of "
            f"max_model_len={max_len} tokens (needs {blocks_per_seq} blocks, "
            f"{blocks_per_seq * block_bytes} bytes); raise num_kv_blocks/kv_cache_bytes or "
            f"lower max_model_len")
    return num, max_len


def blocks_per_request(groups: tuple[KVCacheGroup, ...], num_tokens: int, block_size: int,
                       max_step_tokens: int) -> int:
    """Pool blocks one request of `num_tokens` tokens may hold at once: a full group all of its
    blocks, a sliding group those of its window and of one step's tokens; plus the null block
    when some group slides."""
    whole = -(-num_tokens // block_size)
    total = 0
    for group in groups or (KVCacheGroup((0,), None),):
        if group.held_window is None:
            total += whole
        else:
            span = group.held_window - 1 + max_step_tokens
            total += min(whole, -(-span // block_size) + 1)
    return total + any(g.held_window is not None for g in groups)


class EngineCore:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None,
        driver_cls: type[KVConnectorDriver] = KVConnectorDriver,
    ) -> None:
        """`loaded`: the model, if the caller loaded it already. `driver_cls`: what drives the
        connector's worker half through each step (see ModelRunner)."""
        self.config = config
        dtype = resolve_dtype(config.dtype)
        # Checked before anything loads: no GPU is one clear error here, not one in a step.
        device = resolve_device(config.device)
        in_process = config.worker == "inproc"
        if loaded is None:  # a child process loads the weights it runs; this one needs none
            loaded = load_model(config.model, dtype, load_weights=in_process, device=device)
        self.loaded = loaded
        mc = self.loaded.config
        self.groups = engine_kv_groups(config, mc)
        check_state_fits(mc, config.block_size)
        block_bytes = kv_block_bytes(mc, config.block_size, dtype, slots_per_block(self.groups))
        self.num_kv_blocks, max_model_len = plan_kv_pool(config, mc.max_position_embeddings,
                                                         block_bytes, self.groups)
        # From here on the config holds a number (the scheduler and the worker read it).
        self.config = config = dataclasses.replace(config, max_model_len=max_model_len)
        self.max_model_len = max_model_len
        windows = tuple(g.held_window for g in self.groups)
        pool = BlockPool(self.num_kv_blocks, enable_caching=config.enable_prefix_caching,
                         reserve_null_block=any(w is not None for w in windows))
        self.kv_cache_manager = KVCacheManager(pool, config.block_size, group_windows=windows)
        # The two halves of the connector: separate objects, separate state (the worker half is
        # built next to the runner, possibly in another process).
        self.hash_root = engine_hash_root(config, self.loaded.identity)
        sched_connector = create_engine_connector(config, KVConnectorRole.SCHEDULER)
        if sched_connector is not None:
            sched_connector.set_kv_cache_spec(kv_cache_spec(
                mc, self.num_kv_blocks, config.block_size, dtype, self.hash_root, self.groups))
        self.scheduler = Scheduler(config, self.kv_cache_manager, sched_connector)
        self.executor: Executor
        if in_process:
            runner = build_runner(config, self.num_kv_blocks, self.loaded, driver_cls)
            self.executor = InProcExecutor(runner, background=config.async_scheduling)
        else:
            self.executor = ProcessExecutor(config, self.num_kv_blocks, driver_cls)
        # (step output, its future): at most two steps in flight under async scheduling
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self.eos_token_ids = frozenset(mc.eos_token_ids)

    @property
    def pool(self) -> BlockPool:
        return self.kv_cache_manager.pool

    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, longer than max_model_len="
                             f"{self.max_model_len}")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        prompt: str | None = None,
    ) -> Request:
        self.validate_prompt(prompt_token_ids)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                      self.config.block_size, self.hash_root, prompt=prompt)
        self.scheduler.add_request(req)
        return req

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def runner(self) -> ModelRunner:
        assert isinstance(self.executor, InProcExecutor), "the runner lives in another process"
        return self.executor.runner

    def has_pending_work(self) -> bool:
        return self.scheduler.has_pending_work() or bool(self._in_flight)

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that finished in it.

        Async scheduling: step N+1 is scheduled and submitted before step N's output is
        processed, so the model never waits for the scheduler (the runner fills in the token
        it sampled at N)."""
        if not self.config.async_scheduling:
            sched_out = self.scheduler.schedule()
            return self.scheduler.update_from_output(sched_out, self.executor.execute(sched_out))
        if self.scheduler.has_pending_work():
            sched_out = self.scheduler.schedule()
            self._in_flight.append((sched_out, self.executor.submit(sched_out)))
            if len(self._in_flight) < 2:
                return []
        if not self._in_flight:  # an idle engine: nothing to do
            return []
        sched_out, future = self._in_flight.popleft()
        return self.scheduler.update_from_output(sched_out, future.result())

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    def check_no_leaks(self) -> None:
        """The "nothing leaked" oracle: no requests, every block free, pool consistent."""
        if self.scheduler.requests:
            raise RuntimeError(f"requests left: {list(self.scheduler.requests)[:10]}")
        held = self.scheduler.xfer.held_request_ids
        if held:
            raise RuntimeError(f"finished requests still hold blocks for the connector: {held[:10]}")
        if self.kv_cache_manager.num_requests:
            raise RuntimeError(f"block tables left: {list(self.kv_cache_manager.req_to_blocks)[:10]}")
        self.pool.assert_all_free()
        if self._in_flight:
            raise RuntimeError(f"{len(self._in_flight)} steps still in flight")
        num_runner = self.executor.num_runner_requests()
        if num_runner or self.scheduler.finished_req_ids:
            raise RuntimeError(f"the runner still holds {num_runner} requests")

    def shutdown(self) -> None:
        while self._in_flight:  # let submitted steps finish before tearing down
            self._in_flight.popleft()[1].exception()
        errors: list[BaseException] = []
        for half in (self.scheduler.connector, self.executor):
            if half is None:
                continue
            try:
                half.shutdown()
            except Exception as exc:  # shut the other half down too, then report
                logger.exception("shutdown failed")
                errors.append(exc)
        if errors:
            raise errors[-1]
