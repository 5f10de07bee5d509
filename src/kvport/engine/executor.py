"""Where the model runner (and the worker half of the connector) runs.

- InProcExecutor: in this process; inline, or on one background thread so that the core can
  schedule step N+1 while step N runs (async scheduling).
- ProcessExecutor: in a child process (spawned, so no torch state is forked). Scheduler output,
  connector metadata and connector output cross the pipe as pickled plain data, in order.

Either way steps execute one at a time, in the order they were submitted.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import traceback
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorRole
from kvport.connectors.driver import KVConnectorDriver
from kvport.connectors.factory import config_supports_hma
from kvport.engine.connector_setup import create_engine_connector
from kvport.engine.device import resolve_device
from kvport.engine.hashing import engine_hash_root
from kvport.engine.runner import ModelRunner
from kvport.engine.step import ModelRunnerOutput, SchedulerOutput
from kvport.model.config import ModelConfig
from kvport.model.kv_groups import KVCacheGroup, kv_cache_groups
from kvport.model.loader import LoadedModel, load_model, resolve_dtype

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


class Executor(ABC):
    """Runs the engine core's steps on the runner, wherever the runner lives."""

    @abstractmethod
    def submit(self, sched_out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Called by the engine core once per step it schedules (up to two in flight under
        async scheduling): queues the step. Steps run one at a time in submission order; the
        future holds the runner's output, or the error that kept the runner from answering
        (a dead worker process)."""

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(sched_out).result()

    @abstractmethod
    def num_runner_requests(self) -> int:
        """Called by the engine core's leak check (check_no_leaks) with no step in flight: how
        many requests the runner still holds state for (0 when nothing leaked)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Called by the engine core's shutdown, after every step it submitted finished: shuts
        the runner down (and with it the connector's worker half), then ends the runner's
        thread or process. Nothing may be submitted afterwards."""


def build_runner(
    config: EngineConfig, num_kv_blocks: int, loaded: LoadedModel | None = None,
    driver_cls: type[KVConnectorDriver] = KVConnectorDriver,
) -> ModelRunner:
    """The runner and, with a KV transfer config, the worker half of the connector beside it.
    `loaded` without weights (a process that only schedules) is loaded again, with them, onto
    `config.device` (checked here too: a worker process checks its own machine)."""
    dtype = resolve_dtype(config.dtype)
    device = resolve_device(config.device)
    if loaded is None or loaded.model is None:
        loaded = load_model(config.model, dtype, device=device)
    assert loaded.model is not None
    connector = create_engine_connector(config, KVConnectorRole.WORKER)
    return ModelRunner(loaded.model, loaded.config, num_kv_blocks, config.block_size, dtype,
                       connector, engine_hash_root(config, loaded.identity),
                       call_order=config.kv_connector_call_order, driver_cls=driver_cls,
                       groups=engine_kv_groups(config, loaded.config), device=device)


def engine_kv_groups(config: EngineConfig, model_config: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups the engine keeps. With a KV connector that is not SupportsHMA, one
    group of every layer (it reads one block table; vLLM turns its hybrid allocator off the same
    way): sliding layers still attend within their window, but keep every block. Otherwise the
    model's groups (kvport.model.kv_groups), so sliding layers free what left their window.
    Asked of the config (the connector is built later): a MultiConnector is SupportsHMA only
    when every child is."""
    ktc = config.kv_transfer_config
    if ktc is not None and not config_supports_hma(ktc):
        return (KVCacheGroup(tuple(range(model_config.num_hidden_layers)), None),)
    return kv_cache_groups(model_config)


class InProcExecutor(Executor):
    def __init__(self, runner: ModelRunner, background: bool) -> None:
        self.runner = runner
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvport-runner") if background else None

    def submit(self, sched_out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        if self._pool is not None:
            return self._pool.submit(self.runner.execute, sched_out)
        fut: Future[ModelRunnerOutput] = Future()
        try:
            fut.set_result(self.runner.execute(sched_out))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def num_runner_requests(self) -> int:
        return len(self.runner.requests)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.runner.shutdown()


class ProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, num_kv_blocks: int,
                 driver_cls: type[KVConnectorDriver] = KVConnectorDriver) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        # driver_cls crosses by reference: the child imports the module that defines it.
        self._proc = ctx.Process(target=_worker_main,
                                 args=(child_conn, config, num_kv_blocks, driver_cls),
                                 name="kvport-worker", daemon=True)
        self._proc.start()
        child_conn.close()
        # Replies come in send order: one reader thread resolves the oldest pending future with
        # each reply, so step N+1 can be sent while the reply to step N is awaited.
        self._lock = threading.Lock()  # guards _pending, _closed and the sending end
        self._pending: deque[Future[Any]] = deque()
        self._closed = False
        self._dead: str | None = None  # why the worker can no longer answer
        self._reader = threading.Thread(target=self._read_replies, name="kvport-worker-reader",
                                        daemon=True)
        self._reader.start()
        self._call_sync("ping")  # surfaces a failed start (bad model, bad connector) right here

    def submit(self, sched_out: SchedulerOutput) -> Future[ModelRunnerOutput]:
        return self._send("execute", sched_out)

    def num_runner_requests(self) -> int:
        return int(self._call_sync("num_requests"))

    def _send(self, kind: str, payload: Any = None) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker process is shut down")
            if self._dead is not None:
                raise RuntimeError(self._dead)
            try:
                self._conn.send((kind, payload))
            except OSError as exc:  # the reader may not have seen the EOF yet
                self._dead = f"worker process died: {exc!r}"
                raise RuntimeError(self._dead) from exc
            self._pending.append(fut)
        return fut

    def _read_replies(self) -> None:
        while True:
            try:
                status, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                with self._lock:
                    self._dead = f"worker process died: {exc!r}"
                    pending, self._pending = list(self._pending), deque()
                for fut in pending:
                    fut.set_exception(RuntimeError(self._dead))
                return
            with self._lock:
                fut = self._pending.popleft()
            if status == "ok":
                fut.set_result(value)
            else:
                fut.set_exception(RuntimeError(f"worker process failed:\n{value}"))

    def _call_sync(self, kind: str) -> Any:
        return self._send(kind).result()

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self._send("shutdown").result(timeout=SHUTDOWN_TIMEOUT_S)
        except Exception:
            logger.exception("worker process did not shut down cleanly")
        finally:
            with self._lock:
                self._closed = True
            self._proc.join(timeout=SHUTDOWN_TIMEOUT_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=SHUTDOWN_TIMEOUT_S)
            self._conn.close()  # the reader sees EOF or OSError and ends
            self._reader.join(timeout=SHUTDOWN_TIMEOUT_S)


def _worker_main(conn: Connection, config: EngineConfig, num_kv_blocks: int,
                 driver_cls: type[KVConnectorDriver]) -> None:
    runner: ModelRunner | None = None
    while True:
        kind, payload = conn.recv()
        try:
            if runner is None and kind != "shutdown":
                runner = build_runner(config, num_kv_blocks, driver_cls=driver_cls)
            if kind == "execute":
                assert runner is not None
                result: Any = runner.execute(payload)
            elif kind == "num_requests":
                result = len(runner.requests) if runner is not None else 0
            elif kind == "ping":
                result = None
            elif kind == "shutdown":
                if runner is not None:
                    runner.shutdown()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown worker command {kind!r}")
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
