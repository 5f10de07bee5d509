"""A transfer handler for copies between a device's KV pool and host memory (`StreamHandler`):
each job's copy is enqueued, on the submitting thread, on a stream of the handler's own, and
ends when the device reaches the event recorded after it.

On CUDA:
- a job's stream first waits for everything the compute stream has enqueued so far
  (`wait_stream`): a store reads blocks that this step's forward wrote, a load writes blocks
  the engine just allocated (and maybe zeroed);
- jobs are reported in submission order, each when its event has completed (`query`), so one
  stream's jobs end in the order they ran, and `wait` is the event's `synchronize`;
- a synchronous load (its destination carries a deadline: the step that wants it) runs on an
  expedited stream of its own, ahead of queued asynchronous loads, and the compute stream waits
  for its event: the forward that reads the blocks cannot start before they are in, whatever
  the CPU does;
- an enqueued copy cannot be cancelled: `cancel` only stops jobs not yet submitted, and every
  job here is submitted at once (the deadline of a synchronous load's part is checked when it
  is submitted: tiers' `load_unless_late`).

On a host device (CPU) the same code runs each copy at once and the job ends with it: there
are no streams or events there (torch's CPU backend has none), and nothing is asynchronous.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvport.connectors.offloading.mediums import EngineBlocks, LoadStoreSpec
from kvport.connectors.offloading.tiers import TransferOutcome
from kvport.connectors.offloading.worker.transfers import (
    JobId,
    TransferFn,
    TransferHandler,
    TransferResult,
)

_POLL_S = 50e-6  # how often `wait` with a timeout asks an event (a CUDA event has no timed wait)


class Event(Protocol):
    """What the handler needs of an event: torch.cuda.Event has both."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceQueue(Protocol):
    """Where a job's copy runs: `enqueue(run, sync)` calls `run()` so that its device work is
    ordered after the engine's work so far, and returns the event that completes with it (None:
    it already ended). `sync`: a synchronous load, which the engine's next work waits for."""

    def enqueue(self, run: Callable[[], TransferOutcome],
                sync: bool) -> tuple[TransferOutcome, Event | None]: ...


class HostQueue:
    """A host device: the copy runs now, on the calling thread."""

    def enqueue(self, run: Callable[[], TransferOutcome],
                sync: bool) -> tuple[TransferOutcome, Event | None]:
        return run(), None


class CudaQueue:
    """A CUDA device: a stream per handler, plus an expedited one for synchronous loads (see the
    module doc)."""

    def __init__(self, device: torch.device) -> None:
        # NOTE: made once, not per job: jobs on one stream run in submission order.
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._expedited: torch.cuda.Stream | None = None  # stores never take one

    def enqueue(self, run: Callable[[], TransferOutcome],
                sync: bool) -> tuple[TransferOutcome, Event | None]:
        if sync and self._expedited is None:
            self._expedited = torch.cuda.Stream(self.device, priority=-1)  # -1: the higher
        stream = self._expedited if sync and self._expedited is not None else self._stream
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            outcome = run()
        event = torch.cuda.Event()
        event.record(stream)
        if sync:
            compute.wait_event(event)
        return outcome, event


def queue_for(device: torch.device) -> DeviceQueue:
    return CudaQueue(device) if device.type == "cuda" else HostQueue()


@dataclass
class _Job:
    job_id: JobId
    kind: tuple[str, str]
    outcome: TransferOutcome
    event: Event | None  # None where the copy already ended
    started: float  # time.perf_counter() at submit


class StreamHandler(TransferHandler):
    """Runs `transfer(src, dst)` for each job through a DeviceQueue (see the module doc)."""

    def __init__(self, transfer: TransferFn, queue: DeviceQueue, name: str = "copy") -> None:
        self._transfer = transfer
        self._queue = queue
        self.name = name
        self._pending: list[_Job] = []  # submitted, not reported, in submission order
        self._closed = False

    def submit(self, job_id: JobId, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        if self._closed:
            raise RuntimeError(f"submit of job {job_id} after shutdown")
        if any(j.job_id == job_id for j in self._pending):
            raise ValueError(f"job id {job_id} is already in flight")
        start = time.perf_counter()
        sync = isinstance(dst, EngineBlocks) and dst.deadline is not None
        outcome, event = self._queue.enqueue(lambda: self._transfer(src, dst), sync)
        self._pending.append(_Job(job_id, (src.medium(), dst.medium()), outcome, event, start))

    def get_finished(self) -> list[TransferResult]:
        # NOTE: every job whose event completed, not only those before the first running one:
        # a synchronous load on the expedited stream ends before the jobs queued ahead of it,
        # and its step looks for it right after waiting for it.
        done = [j for j in self._pending if j.event is None or j.event.query()]
        self._pending = [j for j in self._pending if j not in done]
        return [_result(j) for j in done]

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> bool:
        wanted = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in list(self._pending):
            if job.job_id not in wanted or job.event is None:
                continue
            if deadline is None:
                job.event.synchronize()
                continue
            while not job.event.query():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(_POLL_S)
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        """No job can be cancelled once enqueued: wait for them all (at most `timeout`)."""
        self._closed = True
        self.wait([j.job_id for j in self._pending], timeout)


def _result(job: _Job) -> TransferResult:
    return TransferResult(job.job_id, not job.outcome.failed_indices, job.outcome.num_bytes,
                          time.perf_counter() - job.started, job.kind,
                          list(job.outcome.failed_indices))
