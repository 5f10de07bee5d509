"""The worker half's records of its transfers in flight: the key each transfer is submitted
under, an asynchronous or synchronous load's progress through its stages, and the `Submitter`
its load and store runners share.

Job ids come from the scheduler half. Transfers are submitted under a `TransferKey` (job id,
stage, lower tier): a load with blocks outside host memory runs one PROMOTION per lower tier
(DISK->HOST, REDIS->HOST) first, then its COPY; a store its COPY (ENGINE->HOST), then one WRITE
per lower tier (HOST->DISK, HOST->REDIS), reported together once every one of them ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvport.connectors.offloading.mediums import LoadStoreSpec
from kvport.connectors.offloading.metadata import JobResult, LoadJob, Stage, TierChange
from kvport.connectors.offloading.worker.transfers import TransferResult, TransferRouter


@dataclass(frozen=True)
class TransferKey:
    """The id a transfer is submitted under: the scheduler half's job id, the job's stage, and
    for a promotion or a write-through the lower tier's medium (DISK, REDIS)."""

    job_id: int
    stage: Stage = Stage.COPY
    medium: str = ""
    part: int = 0  # a synchronous load's copy, in parts


@dataclass
class Load:
    job: LoadJob
    engine_failed: list[int]  # engine block ids left without valid KV
    promotions_left: int = 0  # promotions still running
    promote_failed: list[int] = field(default_factory=list)  # positions among promoted slots
    copy_dst: list[int] = field(default_factory=list)  # engine blocks of the HOST->ENGINE copy
    # A synchronous load: its parts in flight (key -> their engine blocks). Parts still running
    # when its step's forward had to start failed their blocks then (`reported`); the job's
    # result waits until they ended, so its host slots stay pinned while they read them.
    parts: dict[TransferKey, list[int]] = field(default_factory=dict)
    reported: bool = False
    late: bool = False  # its promotions passed load_timeout_s: reported failed, no copy follows


class Submitter:
    """The worker half's transfers in flight and its outbox, shared by its load and store runners:
    what was submitted to the router and not reported yet, and the job results for the next
    worker metadata."""

    def __init__(self, router: TransferRouter) -> None:
        self.router = router
        self.in_flight: set[TransferKey] = set()  # submitted to the router, not reported
        self.results: list[JobResult] = []  # for the next worker metadata
        self.changes: list[TierChange] = []  # what lower tiers now hold, for the same

    def submit(self, key: TransferKey, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self.in_flight.add(key)
        self.router.submit(key, src, dst)

    def take_finished(self) -> list[TransferResult]:
        """The transfers that ended since the last call (no longer in flight)."""
        done = self.router.get_finished()
        for result in done:
            self.in_flight.discard(transfer_key(result))
        return done


def transfer_key(result: TransferResult) -> TransferKey:
    key = result.job_id
    assert isinstance(key, TransferKey), f"not a transfer of this worker: {key!r}"
    return key
