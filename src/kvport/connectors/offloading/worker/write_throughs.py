"""Stores' write-throughs in flight: a store's host slots written to each lower tier (disk,
Redis), reported to the scheduler half as one WRITE stage once every tier's write ended.

The slots stay pinned until then (the scheduler half unpins them on that report), so no tier
ever reads a slot another store has reused. Worker thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvport.connectors.offloading.mediums import HostBlocks, KeyedBlocks
from kvport.connectors.offloading.metadata import JobResult, Stage, StoreJob, TierChange


@dataclass
class _WriteThrough:
    left: int  # tiers whose write has not ended
    keys: dict[str, list[bytes]]  # medium -> the keys sent to it
    failed: set[int] = field(default_factory=set)  # not written: positions among the sent slots


class WriteThroughs:
    def __init__(self) -> None:
        self._writes: dict[int, _WriteThrough] = {}  # store job id -> its writes in flight

    def start(self, job: StoreJob, failed: set[int]) -> list[tuple[HostBlocks, KeyedBlocks]]:
        """The writes of a store whose copy ended (`failed`: positions it did not copy): one
        (host slots, tier keys) per lower tier, of the slots it filled. None to write (every
        position failed) is an empty list, and nothing is kept."""
        good = [i for i in range(len(job.dst.slot_ids)) if i not in failed]
        if not good or not job.writes:
            return []
        assert job.job_id not in self._writes, f"store {job.job_id} is written through already"
        src = HostBlocks([job.dst.slot_ids[i] for i in good])
        writes = [(src, type(write)([write.keys[i] for i in good])) for write in job.writes]
        self._writes[job.job_id] = _WriteThrough(len(job.writes),
                                                 {dst.medium(): dst.keys for _, dst in writes})
        return writes

    def ended(self, job_id: int, medium: str, failed_indices: list[int],
              ) -> tuple[JobResult | None, TierChange]:
        """One tier's write of the store ended (written, skipped or failed: the tier counts
        which): the keys that tier now holds, and the last tier's WRITE result (else None)."""
        write = self._writes[job_id]
        write.left -= 1
        write.failed.update(failed_indices)
        failed = set(failed_indices)
        held = TierChange(medium, tuple(k for i, k in enumerate(write.keys[medium])
                                        if i not in failed), removed=False)
        if write.left > 0:
            return None, held  # another tier still reads the slots: they stay pinned
        del self._writes[job_id]
        return JobResult(job_id, not write.failed, sorted(write.failed), stage=Stage.WRITE), held

    def __len__(self) -> int:
        return len(self._writes)
