"""Connectors for tests, loaded through `kv_connector_module_path="connector_fakes"`.

- `FakeConnector`: records every call in `calls` and answers what the test sets on it.
- `TracingFakeConnector`: the same, and it records the `trace_step` calls too.
- `LoggingExampleConnector`: a real ExampleConnector that appends one line per
  `update_state_after_alloc` / load / store to a log file, so engine tests can see which child
  of a MultiConnector did what (the connector objects live inside the engine).
- `make_kv_cache`, `new_req`, `sched_out`, `worker_step`: drive connector halves without an engine;
  `assert_identical_trees` compares two storage directories.
"""

from __future__ import annotations

import dataclasses
import filecmp
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvport.config import KVTransferConfig
from kvport.connectors.base import (
    ForwardContext, KVCacheEvent, KVCacheSpec, KVConnectorBase, KVConnectorMetadata,
    KVConnectorOutput, KVConnectorRole, KVConnectorWorkerMetadata, layer_name,
)
from kvport.connectors.example import ExampleConnector
from kvport.connectors.factory import parse_extra_config
from kvport.connectors.hma import group_tables
from kvport.connectors.views import (
    CachedRequestRecord, NewRequestRecord, SchedulerOutputRecord, SchedulerOutputView,
)
from kvport.engine.request import Request


@dataclass(frozen=True)
class FakeConfig:
    name: str = "fake"
    matched_tokens: int | None = 0  # answer of get_num_new_matched_tokens (None: ask again)
    load_async: bool = False
    keep_blocks: bool = False  # answer of request_finished


@dataclass
class FakeMetadata(KVConnectorMetadata):
    name: str = ""
    step: int = -1


@dataclass(frozen=True)
class FakeWorkerMeta(KVConnectorWorkerMetadata):
    job_ids: frozenset[int]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> FakeWorkerMeta:
        assert isinstance(other, FakeWorkerMeta)
        return FakeWorkerMeta(self.job_ids | other.job_ids)


class FakeConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.cfg = parse_extra_config(FakeConfig, config)
        self.calls: list[tuple[Any, ...]] = []  # (method, interesting args...)
        # What the next calls answer; the test sets these.
        self.matched_tokens: int | None = self.cfg.matched_tokens
        self.keep_blocks = self.cfg.keep_blocks
        self.params: dict[str, Any] | None = None
        self.report_sending: set[str] = set()  # reported (once) by the next get_finished
        self.report_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.worker_meta: KVConnectorWorkerMetadata | None = None
        self.stats: dict[str, Any] = {}
        self.events: list[KVCacheEvent] = []
        self.reset_result: bool | None = None
        self.pending_work = False
        self.fail: set[str] = set()  # names of methods that raise
        self.outputs_seen: list[KVConnectorOutput] = []

    def _record(self, method: str, *args: Any) -> None:
        self.calls.append((method, *args))
        if method in self.fail:
            raise RuntimeError(f"{self.cfg.name}.{method} failed on purpose")

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    # worker side
    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self._record("register_kv_caches", spec.num_layers)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        self._record("handle_preemptions", metadata)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._record("bind_connector_metadata", metadata)
        super().bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self._record("clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, ctx: ForwardContext) -> None:
        self._record("start_load_kv", ctx.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        self._record("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        self._record("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._record("get_finished", set(finished_req_ids))
        sending, recving = self.report_sending, self.report_recving
        self.report_sending, self.report_recving = set(), set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._record("get_block_ids_with_load_errors")
        errors, self.load_errors = self.load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self._record("build_connector_worker_meta")
        return self.worker_meta

    def get_kv_connector_stats(self) -> dict[str, Any]:
        self._record("get_kv_connector_stats")
        return dict(self.stats)

    # scheduler side
    def on_new_request(self, request: Request) -> None:
        self._record("on_new_request", request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._record("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        n = self.matched_tokens
        return n, bool(n) and self.cfg.load_async

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._record("update_state_after_alloc", request.request_id, list(block_ids),
                     num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> FakeMetadata:
        self._record("build_connector_meta", scheduler_output.step)
        return FakeMetadata(self.cfg.name, scheduler_output.step)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._record("update_connector_output")
        self.outputs_seen.append(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._record("request_finished", request.request_id, list(block_ids))
        return self.keep_blocks, self.params

    def take_events(self) -> list[KVCacheEvent]:
        self._record("take_events")
        events, self.events = self.events, []
        return events

    def has_pending_work(self) -> bool:
        self._record("has_pending_work")
        return self.pending_work

    def reset_cache(self) -> bool | None:
        self._record("reset_cache")
        return self.reset_result

    def shutdown(self) -> None:
        self._record("shutdown")


class TracingFakeConnector(FakeConnector):
    def trace_step(self, step: int) -> None:
        self.calls.append(("trace_step", step))


class LoggingExampleConnector(ExampleConnector):
    """ExampleConnector plus a log: extra-config key `log_dir` (the rest is ExampleConnector's).

    Lines go to `<log_dir>/<scheduler|worker>.log`:
        alloc <req_id> <num_blocks> <num_external_tokens>    (scheduler)
        load <req_id> <num_tokens> / store <req_id> <num_tokens>   (worker, as bound per step)
    """

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        extra = dict(config.kv_connector_extra_config)
        log_dir = str(extra.pop("log_dir"))
        super().__init__(dataclasses.replace(config, kv_connector_extra_config=extra), role)
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{role.value}.log")

    def _log(self, line: str) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...],
        num_external_tokens: int,
    ) -> None:
        # ExampleConnector is SupportsHMA: a table per KV cache group (one on tiny-llama)
        num_blocks = len(group_tables(block_ids)[0])
        self._log(f"alloc {request.request_id} {num_blocks} {num_external_tokens}")
        super().update_state_after_alloc(request, block_ids, num_external_tokens)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        meta = self._meta()
        for load in meta.loads:
            self._log(f"load {load.req_id} {load.num_tokens - load.start_token}")
        for store in meta.stores:
            self._log(f"store {store.req_id} {store.num_tokens}")


def read_log(log_dir: str, role: str) -> list[str]:
    """The lines logged so far by role "scheduler" or "worker" (none yet: [])."""
    path = os.path.join(log_dir, f"{role}.log")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def fake_child(name: str, **extra: Any) -> dict[str, Any]:
    """A MultiConnector child config for a FakeConnector."""
    return {"kv_connector": "FakeConnector", "kv_connector_module_path": "connector_fakes",
            "kv_connector_extra_config": {"name": name, **extra}}


# ---- driving connector halves without an engine ---------------------------------------------

BLOCK_SIZE = 4
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 3


def make_kv_cache(num_blocks: int = 16, seed: int | None = 0) -> torch.Tensor:
    """A pool in the engine's layout: (num_blocks, num_layers, 2, block_size, kv_heads, head_dim);
    random values (seed) or zeros (seed=None)."""
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def new_req(req: Request, block_ids: Sequence[int],
            num_computed_tokens: int = 0) -> NewRequestRecord:
    return NewRequestRecord(req.request_id, list(block_ids), num_computed_tokens)


def sched_out(
    step: int = 0,
    new: Sequence[NewRequestRecord] = (),
    cached: Sequence[CachedRequestRecord] = (),
    scheduled: dict[str, int] | None = None,
    preempted: Sequence[str] = (),
    finished: Sequence[str] = (),
) -> SchedulerOutputRecord:
    """A step as a connector sees it (the engine hands its connector such a view)."""
    scheduled = scheduled or {}
    return SchedulerOutputRecord(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        preempted_req_ids=set(preempted), finished_req_ids=set(finished), step=step)


def worker_step(
    worker: KVConnectorBase, meta: KVConnectorMetadata, kv_cache: torch.Tensor,
    finished: set[str] | None = None, step: int = 0, forward: bool = True,
) -> tuple[set[str] | None, set[str] | None, set[int]]:
    """One worker step in the driver's order. Returns (sending, recving, load errors)."""
    ctx = ForwardContext(kv_cache, {}, step)
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(ctx)
    if forward:
        with torch.inference_mode():  # as in the model runner
            for i in range(kv_cache.shape[1]):
                worker.wait_for_layer_load(layer_name(i))
                worker.save_kv_layer(layer_name(i), kv_cache[:, i], ctx)
        worker.wait_for_save()
    sending, recving = worker.get_finished(finished or set())
    errors = worker.get_block_ids_with_load_errors()
    worker.build_connector_worker_meta()
    worker.get_kv_connector_stats()
    worker.clear_connector_metadata()
    return sending, recving, errors


def assert_identical_trees(left: Path, right: Path) -> None:
    """Same entry directories, same files, byte for byte (and not empty)."""
    assert sorted(os.listdir(left)) == sorted(os.listdir(right)) != []
    for sub in os.listdir(left):
        names = sorted(os.listdir(left / sub))
        assert names == sorted(os.listdir(right / sub))
        _, mismatch, errors = filecmp.cmpfiles(left / sub, right / sub, names, shallow=False)
        assert mismatch == [] and errors == []
