"""The worker half's stores: engine blocks copied into host slots, then written through.

A store's COPY (ENGINE -> HOST) is submitted in get_finished, after the forward wrote its blocks
(none of a request whose synchronous load failed in the step: its forward read bad blocks).
Once its copy ended, the store is reported, and the slots it filled are written through to each
lower tier (disk, Redis) under `write_timeout_s`: one WRITE stage, reported once every tier's
write ended (write_throughs.py). A write-through past its deadline is given up: it no longer
keeps the engine stepping, and its slots stay pinned until its thread returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.mediums import ENGINE, HOST
from kvport.connectors.offloading.metadata import JobResult, Stage, StoreJob
from kvport.connectors.offloading.worker.deadlines import Deadlines
from kvport.connectors.offloading.worker.jobs import Submitter, TransferKey
from kvport.connectors.offloading.worker.transfers import TransferResult, failed_result
from kvport.connectors.offloading.worker.write_throughs import WriteThroughs

logger = logging.getLogger(__name__)


class StoreRunner:
    def __init__(self, config: OffloadingConfig, submitter: Submitter,
                 deadlines: Deadlines) -> None:
        self.config = config
        self.submitter = submitter
        self.deadlines = deadlines
        self.copies: dict[int, StoreJob] = {}  # job id -> store whose copy is in flight
        self.writes = WriteThroughs()  # of stores whose copy ended
        self.given_up: set[int] = set()  # late write-throughs, until their threads return

    def submit(self, jobs: Iterable[StoreJob], tainted: set[str]) -> list[TransferResult]:
        """The step's stores (the forward has written their blocks). Those of `tainted` requests
        are not copied: their failed results are returned, to be handled as any other."""
        failed: list[TransferResult] = []
        for job in jobs:
            self.copies[job.job_id] = job
            if job.req_id in tainted:  # computed on KV a failed sync load left
                failed.append(failed_result(TransferKey(job.job_id), (ENGINE, HOST),
                                            len(job.dst)))
                continue
            self.submitter.submit(TransferKey(job.job_id), job.src, job.dst)
        return failed

    def on_finished(self, result: TransferResult) -> None:
        """A transfer of a store ended: its copy, or one tier's write-through."""
        key: TransferKey = result.job_id  # type: ignore[assignment]
        if key.stage is Stage.COPY:
            self._on_copied(self.copies.pop(key.job_id), result)
        else:
            self._on_written(key, result)

    def _on_copied(self, job: StoreJob, result: TransferResult) -> None:
        """The store's copy finished: report it, and write the slots it filled through to each
        lower tier (reported as its WRITE stage once all ended; nothing to write is reported at
        once)."""
        failed = set(result.failed_indices)
        results = self.submitter.results
        results.append(JobResult(job.job_id, result.success, sorted(failed)))
        if not job.writes:
            return
        writes = self.writes.start(job, failed)
        if not writes:
            results.append(JobResult(job.job_id, True, stage=Stage.WRITE))
            return
        self.deadlines.start(job.job_id, self.config.write_timeout_s)
        for src, dst in writes:
            self.submitter.submit(TransferKey(job.job_id, Stage.WRITE, dst.medium()), src, dst)

    def _on_written(self, key: TransferKey, result: TransferResult) -> None:
        done, held = self.writes.ended(key.job_id, key.medium, result.failed_indices)
        if held.keys:
            self.submitter.changes.append(held)
        job_id = key.job_id
        if done is not None:
            self.deadlines.end(job_id)
            self.given_up.discard(job_id)
            self.submitter.results.append(done)

    def give_up(self, job_id: int) -> None:
        """The store's write-through passed its deadline: abandoned (not waited for again)."""
        self.given_up.add(job_id)
        logger.warning("OffloadingConnector: a write-through is late (%.1f s, write_timeout_s): "
                       "given up", self.config.write_timeout_s)
