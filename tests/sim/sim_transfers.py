"""The simulation's transfer tier: controlled transfers (tests/offloading/controlled_transfers)
whose every job gets a fate from the seed, and a clock the simulation moves.

    SimClock        simulated seconds; the worker half's deadlines, the scheduler half's waits
                    for a write in flight and the synchronous loads' deadlines read it
    Fate            what happens to one job: held for some steps (or until the run drains: a
                    stuck I/O), failed as a whole, or a fault inside the tier (a torn disk write,
                    a corrupt disk entry read)
    World           one simulation's clock, seeded fault stream and held jobs; the connector
                    reads the active one (`activate`), as the engine builds it by name
    SimHandler      a GatedHandler: each job submitted gets a fate; completions are reported in
                    the order they ended (a held job holds back no other, as with real threads)
    SimConnector    the OffloadingConnector whose halves run on all this

Nothing runs on a thread of its own: a job runs when the simulation releases it, or when the
worker waits for it without a bound (the fence) or for a second or more (shutdown's drain). A
bounded wait that times out moves the clock by its timeout, as a real one would take that long.
"""

from __future__ import annotations

import errno
import math
import random
import sys
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TESTS), str(_TESTS / "offloading")]  # polling; the offloading tests' parts

from controlled_transfers import (  # noqa: E402
    ControlledOffloadingConnector, ControlledTransfers, Direction, GatedHandler, Job,
)
from fault_tiers import FaultyDisk  # noqa: E402
from kvport.connectors.offloading.config import OffloadingConfig  # noqa: E402
from kvport.connectors.offloading.geometry import OffloadGeometry  # noqa: E402
from kvport.connectors.base import KVCacheSpec  # noqa: E402
from kvport.connectors.offloading.mediums import (  # noqa: E402
    DISK, ENGINE, HOST, DiskBlocks, EngineBlocks, HostBlocks, LoadStoreSpec,
)
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler  # noqa: E402
from kvport.connectors.offloading.worker.wiring import LowerTier  # noqa: E402
from kvport.connectors.offloading.tiers import TransferOutcome  # noqa: E402
from kvport.connectors.offloading.tiers.disk.tier import DiskTier  # noqa: E402
from kvport.connectors.offloading.tiers.host.tier import HostTier  # noqa: E402
from kvport.connectors.offloading.worker.transfers import TransferFn, TransferResult  # noqa: E402
from kvport.connectors.offloading.worker.half import OffloadingConnectorWorker  # noqa: E402

NEVER = math.inf  # a stuck job's release step: only the final drain releases it


class SimClock:
    """Simulated seconds, moved only by the simulation (and by waits that time out)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        self.now += seconds


@dataclass(frozen=True)
class Fate:
    hold_steps: float = 0  # steps until the simulation releases it (NEVER: stuck)
    fail: bool = False  # the job fails as a whole, its destination scribbled over
    tier_fault: bool = False  # disk write: torn (EIO); disk read: one entry's payload flipped


NORMAL = Fate()


@dataclass(frozen=True)
class FaultRates:
    """Per job of a direction: the chance it is held, stuck (lower tiers only), failed, or hit by
    a fault inside the tier (disk only)."""

    hold: float = 0.0
    stuck: float = 0.0
    fail: float = 0.0
    tier: float = 0.0


@dataclass
class World:
    seed: int
    rates: Mapping[Direction, FaultRates]
    clock: SimClock = field(default_factory=SimClock)
    step: int = 0
    held: list[tuple[float, SimHandler, Job]] = field(default_factory=list)  # (due step, ...)
    counts: dict[str, int] = field(default_factory=dict)  # what was injected, by name
    # Faults of synchronous loads (host hits copied before the forward): off by default, as
    # they hit a known defect (a store planned in the failing step saves KV computed on the
    # missing blocks; see the module docstring of simulation.py).
    sync_load_faults: bool = False
    poisoned: list[Hashable] = field(default_factory=list)  # stores that read a scribble (NaN)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"jobs-{self.seed}")  # its own stream: the driver's is apart

    def count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def fate(self, kind: Direction, sync_load: bool = False) -> Fate:
        if sync_load and not self.sync_load_faults:
            return NORMAL
        rates = self.rates.get(kind, FaultRates())
        r = self.rng.random
        hold: float = 0
        if r() < rates.stuck:
            hold = NEVER
        elif r() < rates.hold:
            hold = self.rng.randint(1, 6)
        fate = Fate(hold, fail=r() < rates.fail, tier_fault=r() < rates.tier)
        for name, on in (("held", 0 < hold < NEVER), ("stuck", hold == NEVER),
                         ("failed", fate.fail), ("tier_faults", fate.tier_fault)):
            if on:
                self.count(f"{name} {kind[0]}->{kind[1]}")
        return fate

    def release_due(self, final: bool = False) -> None:
        """Run the held jobs whose time came (all with `final`), in a seeded order."""
        due = [h for h in self.held if final or h[0] <= self.step]
        self.held = [h for h in self.held if not (final or h[0] <= self.step)]
        self.rng.shuffle(due)
        for _, handler, job in due:
            if job.result is None:  # a wait may have run it already
                handler.release(job)

    def num_stuck(self) -> int:
        return sum(1 for due, _, job in self.held if due == NEVER and job.result is None)


_ACTIVE: list[World] = []


@contextmanager
def activate(world: World) -> Iterator[World]:
    """The world the SimConnectors built meanwhile use."""
    _ACTIVE.append(world)
    try:
        yield world
    finally:
        _ACTIVE.remove(world)


def active() -> World:
    assert _ACTIVE, "no simulation is active (sim_transfers.activate)"
    return _ACTIVE[-1]


class SimHandler(GatedHandler):
    def __init__(self, kind: Direction, world: World, disk: FaultyDisk | None,
                 *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.kind, self.world, self.disk = kind, world, disk
        self.fates: dict[Hashable, Fate] = {}
        self._ended: list[Job] = []  # in the order they ran, until reported

    def submit(self, job_id: Hashable, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        fate = self.world.fate(self.kind, isinstance(dst, EngineBlocks) and
                               dst.deadline is not None)
        self.fates[job_id] = fate
        self.held = fate.hold_steps > 0
        super().submit(job_id, src, dst)
        job = self._jobs[-1]
        if self.kind == (ENGINE, HOST) and job.source is not None and job.source.isnan().any():
            # Real KV is never NaN: this store reads what a failed load scribbled (0xFF).
            self.world.poisoned.append(job_id)
        if self.held:
            self.world.held.append((self.world.step + fate.hold_steps, self, job))

    def _run(self, job: Job) -> None:
        fate = self.fates.pop(job.id, NORMAL)
        if fate.fail:
            self.fail_next += 1
        if fate.tier_fault and self.disk is not None and self.kind == (HOST, DISK):
            self.disk.write_errno = errno.EIO  # a torn write: half a file, then EIO
        elif fate.tier_fault and self.disk is not None and isinstance(job.src, DiskBlocks):
            self._corrupt(job.src)
        try:
            super()._run(job)
        finally:
            if self.disk is not None:
                self.disk.write_errno = None
        self._ended.append(job)

    def _corrupt(self, src: DiskBlocks) -> None:
        key = src.keys[self.world.rng.randrange(len(src.keys))]
        assert self.disk is not None
        try:
            self.disk.corrupt_payload(key)
        except (OSError, ValueError):  # gone meanwhile (evicted): the read misses anyway
            return

    def get_finished(self) -> list[TransferResult]:
        """In the order the jobs ran (GatedHandler reports in submission order)."""
        ended, self._ended = self._ended, []
        if ended:
            self._jobs = type(self._jobs)(j for j in self._jobs if j.result is None)
        return [j.result for j in ended if j.result is not None]


class SimTransfers(ControlledTransfers):
    def __init__(self, host: HostTier, lower: Mapping[str, LowerTier]) -> None:
        self.world = active()
        disk = lower.get(DISK)
        if disk is not None:
            assert type(disk) is DiskTier, disk
            disk.__class__ = FaultyDisk  # adds only its fault points (no state of its own)
        self.disk = disk if isinstance(disk, FaultyDisk) else None
        super().__init__(host, lower)

    def routes(self, host: HostTier, lower: Mapping[str, LowerTier]) -> dict[Direction, TransferFn]:
        routes = super().routes(host, lower)
        clock = self.world.clock

        def load_unless_late(src: HostBlocks, dst: EngineBlocks) -> TransferOutcome:
            # tier_wiring.load_unless_late on the simulated clock
            if dst.deadline is not None and clock() > dst.deadline:
                return TransferOutcome(0, list(range(len(dst))))
            return host.load(src, dst)

        routes[(HOST, ENGINE)] = load_unless_late  # type: ignore[assignment]
        return routes

    def make_gate(self, kind: Direction, transfer: TransferFn) -> GatedHandler:
        return SimHandler(kind, self.world, self.disk, transfer, self._source, self._scribble,
                          self.fenced, self.torn)

    def wait(self, job_ids: Iterable[Hashable], timeout: float | None = None) -> bool:
        done = super().wait(job_ids, timeout)
        if not done and timeout is not None:
            self.world.clock.advance(timeout)  # a real wait would have taken this long
        return done


class SimConnector(ControlledOffloadingConnector):
    """kv_connector "SimConnector", kv_connector_module_path "sim_transfers"."""

    def make_worker(self, config: OffloadingConfig) -> OffloadingConnectorWorker:
        return OffloadingConnectorWorker(config, make_transfers=SimTransfers,
                                         clock=active().clock)

    def make_scheduler(self, config: OffloadingConfig, geometry: OffloadGeometry, load: bool,
                       store: bool, spec: KVCacheSpec) -> OffloadingScheduler:
        return OffloadingScheduler(config, geometry, load=load, store=store, clock=active().clock)
