"""A configurable mock KV connector that drives the scheduler through every connector branch.

Use it through the registry: {"kv_connector": "MockConnector", "kv_connector_module_path":
"connector_mock", "kv_connector_extra_config": {...}}. It moves no bytes: loads "complete" after
a configured number of steps (or fail for chosen blocks), sends complete after a delay. Pair it
with a model whose output does not depend on KV contents (tests/utils.py's fake runner).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvport.config import KVTransferConfig
from kvport.connectors.base import (
    ForwardContext, KVConnectorMetadata, KVConnectorRequestError, KVConnectorRole,
)
from kvport.connectors.noop import NoOpConnector
from kvport.engine.request import Request
from kvport.engine.step import SchedulerOutput


@dataclass(frozen=True)
class MockConfig:
    hit_blocks: int = 0  # blocks offered beyond the local hit (capped to leave a token)
    is_async: bool = False
    num_defers: int = 0  # answer None this many times per request first
    fail_first_load_block: int = -1  # >= 0: that block (index within the load) fails to load
    recv_delay_steps: int = 0  # async loads finish this many steps after they start
    send_delay_steps: int = -1  # >= 0: request_finished returns True, send done after N steps
    block_size: int = 4
    leave_one_token: bool = True  # False: also offer the block holding the last prompt token


@dataclass
class LoadJob:
    req_id: str
    block_ids: list[int]  # blocks the load fills
    is_async: bool


@dataclass
class MockMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    sends: list[str] = field(default_factory=list)  # requests whose async save starts now


class MockConnector(NoOpConnector):
    config_class = MockConfig

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        # scheduler half
        self._defers: dict[str, int] = {}  # req_id -> None answers given
        self._local: dict[str, int] = {}  # req_id -> local hit tokens at the last match
        self._pending_loads: list[LoadJob] = []
        self._pending_sends: list[str] = []
        self.num_loads = 0
        self.num_sends = 0
        # worker half
        self._recv_due: dict[str, int] = {}  # req_id -> get_finished calls left
        self._send_due: dict[str, int] = {}
        self._invalid: set[int] = set()
        self.finished_seen: set[str] = set()

    # ---- scheduler half ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if self._defers.get(rid, 0) < self.cfg.num_defers:
            self._defers[rid] = self._defers.get(rid, 0) + 1
            return None, False
        self._local[rid] = num_computed_tokens
        bs = self.cfg.block_size
        # A well-behaved connector leaves at least one token to compute.
        max_blocks = (request.num_tokens - int(self.cfg.leave_one_token)) // bs
        local_blocks = num_computed_tokens // bs
        n = min(self.cfg.hit_blocks, max_blocks - local_blocks)
        if n <= 0:
            return 0, False
        return n * bs, self.cfg.is_async

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        bs = self.cfg.block_size
        first = self._local[request.request_id] // bs  # the load fills the blocks after the hit
        self._pending_loads.append(LoadJob(
            request.request_id, block_ids[first:first + num_external_tokens // bs], self.cfg.is_async))
        self.num_loads += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MockMetadata:
        meta = MockMetadata(self._pending_loads, self._pending_sends)
        self._pending_loads, self._pending_sends = [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._defers.pop(request.request_id, None)
        self._local.pop(request.request_id, None)
        if self.cfg.send_delay_steps >= 0 and block_ids:
            self._pending_sends.append(request.request_id)
            self.num_sends += 1
            return True, None
        return False, None

    # ---- worker half ---------------------------------------------------------------------------

    def start_load_kv(self, ctx: ForwardContext) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MockMetadata)
        for job in meta.loads:
            if 0 <= self.cfg.fail_first_load_block < len(job.block_ids):
                self._invalid.update(job.block_ids[self.cfg.fail_first_load_block:])
            if job.is_async:
                self._recv_due[job.req_id] = self.cfg.recv_delay_steps
        for rid in meta.sends:
            self._send_due[rid] = self.cfg.send_delay_steps

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.finished_seen |= finished_req_ids
        recving = self._due(self._recv_due, lambda rid: True)
        # A send is reported only once the scheduler has finished the request.
        sending = self._due(self._send_due, lambda rid: rid in self.finished_seen)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def has_pending_work(self) -> bool:
        return bool(self._pending_sends)

    @staticmethod
    def _due(pending: dict[str, int], allowed: Any) -> set[str]:
        done = set()
        for rid in list(pending):
            if pending[rid] <= 0 and allowed(rid):
                done.add(rid)
                del pending[rid]
            else:
                pending[rid] -= 1
        return done


class FenceConnector(MockConnector):
    """Checks the worker order a flushing connector relies on: handle_preemptions runs before the
    step's metadata is bound (and before any load or forward), every step."""

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        assert not self.has_connector_metadata(), "handle_preemptions ran after bind"
        self.num_handle_preemptions = getattr(self, "num_handle_preemptions", 0) + 1

    def start_load_kv(self, ctx: ForwardContext) -> None:
        assert self.has_connector_metadata(), "start_load_kv ran before bind"
        super().start_load_kv(ctx)


@dataclass
class SaveMetadata(KVConnectorMetadata):
    saves: list[str] = field(default_factory=list)  # requests whose blocks to save


class DeferredSaveConnector(NoOpConnector):
    """Saves each finished request's blocks asynchronously (request_finished -> True). The worker
    queues the save job in get_finished, which runs every step (the design in DESIGN.md)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self._pending: list[str] = []
        self._queued: list[str] = []  # worker: save jobs queued, done at the next get_finished

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.append(request.request_id)
        return True, None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SaveMetadata:
        meta, self._pending = SaveMetadata(self._pending), []
        return meta

    def queue_saves(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SaveMetadata)
        self._queued.extend(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = set(self._queued)  # jobs queued by earlier steps finish now
        self._queued = []
        self.queue_saves()
        return done, None

    def has_pending_work(self) -> bool:
        return bool(self._pending)


class SaveInWaitForSaveConnector(DeferredSaveConnector):
    """The known defect: queues save jobs in wait_for_save, which steps without scheduled tokens
    skip, so a save planned for such a step is never queued and its request's blocks leak."""

    def wait_for_save(self) -> None:
        self.queue_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = set(self._queued)
        self._queued = []
        return done, None


@dataclass(frozen=True)
class JitterConfig:
    seed: int = 0
    max_us: int = 2000  # longest busy-wait per hook call


class JitterConnector(NoOpConnector):
    """Moves nothing; busy-waits a random time in worker hooks, so the runner thread and the
    scheduler interleave differently from run to run (async scheduling tests)."""

    config_class = JitterConfig

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self._rng = random.Random(self.cfg.seed)

    def _spin(self) -> None:
        end = time.perf_counter() + self._rng.randrange(self.cfg.max_us + 1) / 1e6
        while time.perf_counter() < end:
            pass

    def start_load_kv(self, ctx: ForwardContext) -> None:
        self._spin()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        self._spin()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._spin()
        return None, None


@dataclass(frozen=True)
class RaisingConfig:
    hook: str = "save_kv_layer"  # worker hook that raises
    request_id: str = "bad"  # ... while this request is scheduled in the step
    targeted: bool = True  # raise KVConnectorRequestError naming it, or a plain OSError


class RaisingConnector(NoOpConnector):
    """Worker hooks raise while a given request is in the step (configurable, so it also works in
    a worker process, where tests cannot patch the connector)."""

    config_class = RaisingConfig

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self._in_step = False

    def _maybe_raise(self, hook: str) -> None:
        if hook == self.cfg.hook and self._in_step:
            if self.cfg.targeted:
                raise KVConnectorRequestError(f"{hook}: disk on fire", {self.cfg.request_id})
            raise OSError(f"{hook}: disk on fire")

    def start_load_kv(self, ctx: ForwardContext) -> None:
        self._in_step = self.cfg.request_id in ctx.num_scheduled_tokens
        self._maybe_raise("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._maybe_raise("wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        self._maybe_raise("save_kv_layer")

    def wait_for_save(self) -> None:
        self._maybe_raise("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._maybe_raise("get_finished")
        return None, None
