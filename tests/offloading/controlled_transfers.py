"""A transfer tier the tests control, to drive the races that real memory copies never lose.

    GatedHandler         a TransferHandler without threads: a job of a held direction stays in
                         flight until the test releases it; other jobs run when submitted
    ControlledTransfers  the router (a real TransferRouter) with a GatedHandler per direction
    ControlledOffloadingConnector   an OffloadingConnector whose worker half uses it
                         (in-process engines only: `kv_connector_module_path` =
                         "controlled_transfers"); `SyncStoresControlledConnector` with
                         sync_stores, and `SyncStoresOffloadingConnector` with sync_stores on
                         the real transfer threads

A job runs on the thread that releases it, so a scenario is deterministic: nothing moves unless
the engine step or the test moves it. A wait without a timeout (the worker's block-reuse fence)
on a held job runs it there, as a real wait would block until the copy is done, and records it
in `fenced`: a test that expects the fence to hold a job back can check it did. So does a wait of
a second or more (shutdown's drain); a shorter one (the idle wait of a step without a forward)
runs nothing.

Every job snapshots its source when it is submitted and compares at run time: a source that
changed in between (engine blocks overwritten by a forward, host slots reused by another store)
is recorded in `torn`. That is exactly what the fence and the pins exist to prevent, so every
scenario ends with `torn == []`.

`fail_next` makes the next jobs of a direction fail as a whole, after they scribbled over their
destination (0xFF bytes: NaN in float KV), as a failed read may leave it half-written: whatever
a failed job's destination holds must never be used.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass

import torch

from kvport.connectors.base import KVCacheSpec
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.connector import OffloadingConnector
from kvport.connectors.offloading.mediums import (
    EngineBlocks,
    HostBlocks,
    LoadStoreSpec,
)
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.worker.wiring import LowerTier, tier_routes
from kvport.connectors.offloading.worker.transfers import (
    TransferRouter,
    TransferFn,
    TransferHandler,
    TransferResult,
    failed_result,
)
from kvport.connectors.offloading.worker.half import OffloadingConnectorWorker

Direction = tuple[str, str]
# A wait at least this long (shutdown's drain) lets held jobs finish, as a real copy would in
# that time; a shorter one (a step's 2 ms idle wait) only looks.
LONG_WAIT_S = 1.0


@dataclass
class Job:
    id: Hashable  # the worker half's TransferKey
    src: LoadStoreSpec
    dst: LoadStoreSpec
    source: torch.Tensor | None  # the source bytes when submitted (None: not checked)
    result: TransferResult | None = None  # set when the job ran

    @property
    def kind(self) -> Direction:
        return (self.src.medium(), self.dst.medium())


class GatedHandler(TransferHandler):
    def __init__(self, transfer: TransferFn, read_source: Callable[[LoadStoreSpec], torch.Tensor
                 | None], scribble: Callable[[LoadStoreSpec], None], fenced: list[Job],
                 torn: list[Job]) -> None:
        self._transfer = transfer
        self._read_source = read_source
        self._scribble = scribble
        self.held = False  # jobs submitted while True wait for release()
        self.fail_next = 0  # the next n jobs that run fail as a whole (the transfer raised)
        self._jobs: deque[Job] = deque()  # submission order, until reported
        self._fenced, self._torn = fenced, torn

    def submit(self, job_id: Hashable, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        job = Job(job_id, src, dst, self._read_source(src))
        self._jobs.append(job)
        if not self.held:
            self._run(job)

    def in_flight(self) -> list[Job]:
        return [j for j in self._jobs if j.result is None]

    def release(self, job: Job) -> None:
        assert job.result is None, f"job {job.id} already ran"
        self._run(job)

    def _run(self, job: Job) -> None:
        now = self._read_source(job.src)
        # Compared as bytes: a source holding NaN (a failed job's scribble) that did not change
        # is not torn.
        if job.source is not None and not torch.equal(_as_bytes(now), _as_bytes(job.source)):
            self._torn.append(job)
        if self.fail_next:
            self.fail_next -= 1
            self._scribble(job.dst)
            job.result = failed_result(job.id, job.kind, len(job.dst))
            return
        out = self._transfer(job.src, job.dst)
        job.result = TransferResult(job.id, not out.failed_indices, out.num_bytes, 0.0, job.kind,
                                    list(out.failed_indices))

    def get_finished(self) -> list[TransferResult]:
        done = []
        while self._jobs and self._jobs[0].result is not None:  # in submission order
            done.append(self._jobs.popleft().result)
        return done  # type: ignore[return-value]

    def wait(self, job_ids: Iterable[Hashable], timeout: float | None = None) -> bool:
        wanted = set(job_ids)
        jobs = [j for j in self._jobs if j.id in wanted and j.result is None]
        if timeout is not None and timeout < LONG_WAIT_S:
            return not jobs
        for job in jobs:  # an unbounded wait: the copy finishes while the worker waits
            self._fenced.append(job)
            self._run(job)
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        for job in self.in_flight():  # never ran: reported failed, like a cancelled job
            job.result = failed_result(job.id, job.kind, len(job.dst))


def _as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().view(torch.uint8)


class ControlledTransfers(TransferRouter):
    """The standard routes (ENGINE<->HOST, and HOST<->each lower tier) on GatedHandlers."""

    def __init__(self, host: HostTier, lower: Mapping[str, LowerTier]) -> None:
        super().__init__()
        self.host = host
        self.pool: torch.Tensor | None = None  # the engine pool, set by the connector
        self.fenced: list[Job] = []  # held jobs an unbounded wait (the fence) ran
        self.torn: list[Job] = []  # jobs whose source changed between submit and run
        self.gates: dict[Direction, GatedHandler] = {}
        for kind, fn in self.routes(host, lower).items():
            self.gates[kind] = self.make_gate(kind, fn)
            self.register_handler(*kind, self.gates[kind])

    def routes(self, host: HostTier, lower: Mapping[str, LowerTier]) -> dict[Direction, TransferFn]:
        """The function each direction runs (a seam: the simulation's clock, tests/sim)."""
        return tier_routes(host, lower)

    def make_gate(self, kind: Direction, transfer: TransferFn) -> GatedHandler:
        """The handler of one direction (a seam: the simulation's fault points, tests/sim)."""
        return GatedHandler(transfer, self._source, self._scribble, self.fenced, self.torn)

    def hold(self, *kinds: Direction, held: bool = True) -> None:
        """Jobs of these directions submitted from now on stay in flight until released."""
        for kind in kinds:
            self.gates[kind].held = held

    def in_flight(self, kind: Direction) -> list[Job]:
        return self.gates[kind].in_flight()

    def release(self, job: Job) -> None:
        self.gates[job.kind].release(job)

    def release_all(self) -> None:
        """Stop holding and run every job in flight (each direction in submission order)."""
        for gate in self.gates.values():
            gate.held = False
            for job in gate.in_flight():
                gate.release(job)

    def _source(self, spec: LoadStoreSpec) -> torch.Tensor | None:
        if isinstance(spec, EngineBlocks):
            assert self.pool is not None, "ControlledTransfers: the engine pool was not set"
            return self.pool[spec.block_ids].clone()
        if isinstance(spec, HostBlocks):
            return torch.stack([self.host.slot(s).clone() for s in spec.slot_ids]) \
                if spec.slot_ids else torch.empty(0)
        return None  # disk entries are replaced atomically, never rewritten in place

    def _scribble(self, spec: LoadStoreSpec) -> None:
        if isinstance(spec, EngineBlocks):
            assert self.pool is not None, "ControlledTransfers: the engine pool was not set"
            self.pool.view(torch.uint8).view(self.pool.shape[0], -1)[spec.block_ids] = 0xFF
        elif isinstance(spec, HostBlocks):
            for s in spec.slot_ids:
                self.host.slot(s).fill_(0xFF)


class ControlledOffloadingConnector(OffloadingConnector):
    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        return OffloadingConnectorWorker(config, make_transfers=ControlledTransfers)

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        super().register_kv_caches(kv_cache, spec)
        transfers = self.worker_half.transfers
        assert isinstance(transfers, ControlledTransfers), transfers
        transfers.pool = kv_cache


class SyncStoresControlledConnector(ControlledOffloadingConnector):
    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        return OffloadingConnectorWorker(config, make_transfers=ControlledTransfers,
                                         sync_stores=True)


class SyncStoresOffloadingConnector(OffloadingConnector):
    """Real transfers; every step's stores report in that step (as inside vLLM)."""

    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        return OffloadingConnectorWorker(config, sync_stores=True)


class WaitSyncLoadsControlledConnector(ControlledOffloadingConnector):
    """Synchronous loads waited for without a bound, as inside vLLM."""

    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        return OffloadingConnectorWorker(config, make_transfers=ControlledTransfers,
                                         wait_sync_loads=True)
