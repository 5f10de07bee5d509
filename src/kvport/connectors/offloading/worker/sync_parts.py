"""A synchronous load's copy (host hits copied before the step's forward) in parts, and how long
it may take: a copy that is late is stopped between parts, and exactly the blocks not copied
are recomputed."""

from __future__ import annotations

from kvport.connectors.offloading.geometry import blocks_of
from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.metadata import LoadJob

# A part is a few milliseconds of copying: small enough that a late load stops soon after its
# deadline, large enough that the parts' own cost stays small (docs/offloading.md, "Tuning
# constants").
SYNC_PART_BYTES = 64 << 20
# A synchronous load may take SYNC_SLACK_S plus its bytes at SYNC_MIN_GIB_S (well below any host
# copy's rate); then the parts not started are cancelled, and the one running gets SYNC_GRACE_S
# to end.
SYNC_MIN_GIB_S = 1.0
SYNC_SLACK_S = 0.05
SYNC_GRACE_S = 0.05


def sync_timeout(num_bytes: int) -> float:
    """Seconds a synchronous load of `num_bytes` may take before its parts not started are
    cancelled."""
    return SYNC_SLACK_S + num_bytes / (SYNC_MIN_GIB_S * 2**30)


def split_parts(job: LoadJob, block_factor: int,
                slot_bytes: int) -> list[tuple[HostBlocks, EngineBlocks]]:
    """A load's copy in parts of about SYNC_PART_BYTES (at least one slot each), in token
    order; the first part keeps the job's skip of its first engine block."""
    skip, slots = job.dst.skip, job.src.slot_ids
    step = max(1, SYNC_PART_BYTES // slot_bytes)
    return [(HostBlocks(slots[a:a + step]),
             EngineBlocks(blocks_of(job.dst.block_ids, a, block_factor, skip, step),
                          skip if a == 0 else 0))
            for a in range(0, len(slots), step)]
