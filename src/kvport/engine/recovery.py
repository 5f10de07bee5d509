"""What a failed step or a failed load undoes, for the scheduler to apply: which requests failed,
which blocks leave the prefix cache, which requests go back to their last valid block."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvport.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvport.engine.kv_cache_manager import KVCacheManager
    from kvport.engine.kv_transfer import KVTransferTracker
    from kvport.engine.step import ModelRunnerOutput, SchedulerOutput


def step_failures(sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> dict[str, str]:
    """req_id -> error for the requests the runner or a worker-side connector hook failed."""
    failed = dict(runner_out.failed_req_ids)
    kv_out = runner_out.kv_connector_output
    if kv_out is not None and kv_out.errors:
        message = "KV connector failed: " + "; ".join(f"{k}: {v}" for k, v in kv_out.errors.items())
        targets = kv_out.error_req_ids
        failed.update({rid: message for rid in (
            sched_out.num_scheduled_tokens if targets is None else targets)})
    return failed


def distrust_step_blocks(kv: KVCacheManager, req: Request, out: SchedulerOutput) -> None:
    """A step failed: withdraw from the prefix cache every block it computed or loaded."""
    first_token = req.num_computed_tokens - out.num_scheduled_tokens.get(req.request_id, 0)
    if any(n.req_id == req.request_id for n in out.scheduled_new_reqs):
        first_token -= req.num_external_computed_tokens
    kv.uncache_blocks_from(req, max(0, first_token) // kv.block_size)


def rewind_to_valid_blocks(kv: KVCacheManager, xfer: KVTransferTracker, running: list[Request],
                           loading: list[Request], invalid: set[int],
                           step_id: int) -> tuple[set[str], set[str]]:
    """Truncate every request whose block table holds a block that a load failed to fill to the
    last good block before it, and withdraw that block and all after it from the prefix cache.
    Returns (the requests rewound, those of them to send to the runner in full again): running
    ones recompute, and their tokens of this step are discarded; loading ones resume with what
    their load delivered before the bad block."""
    if not invalid:
        return set(), set()
    xfer.count_invalid_blocks(len(invalid))
    bs = kv.block_size
    rewound: set[str] = set()
    resend: set[str] = set()
    for req in running + loading:
        # A bad block in any group rewinds every group to before it (each group's KV of the
        # tokens after it is recomputed with the rest).
        tables = kv.get_block_ids(req.request_id)
        first = min((i for table in tables for i, b in enumerate(table) if b in invalid),
                    default=None)
        if first is None:
            continue
        kv.uncache_blocks_from(req, first)
        good = _rewind_block(kv, tables, first, invalid)
        kv.cut_window_holes(req, good * bs)
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            xfer.limit_async_load(req.request_id, good * bs)
        else:
            req.rewind(good * bs, step_id)
            resend.add(req.request_id)
        rewound.add(req.request_id)
    kv.uncache_block_ids(invalid)
    return rewound, resend


def _rewind_block(kv: KVCacheManager, tables: tuple[list[int], ...], first: int,
                  invalid: set[int]) -> int:
    """The block to compute again from when block `first` of some group is bad: the last one
    at or before it where every sliding group still holds good blocks over its window (a hit
    loads a sliding group's window only: before it, the table holds the null block, so the
    first bad block of a loaded window sends the request back to its local hit, or to 0)."""
    null = kv.pool.null_block
    skip = {null.block_id} if null is not None else set()

    def window_held(p: int) -> bool:
        return all(b not in invalid and b not in skip
                   for g, table in enumerate(tables) if kv.group_windows[g] is not None
                   for b in table[kv.first_needed_block(g, p * kv.block_size):p])

    return next(p for p in range(first, -1, -1) if window_held(p))
