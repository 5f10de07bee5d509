"""What the RecordingConnector needs for rule C3 (kvport.trace.loaded): which blocks a step
completes and which a connector loads (scheduler side), and their fingerprints (worker side).

Scheduler side, LoadPlanner: vLLM tells a connector a request's block ids (the scheduler output's
new and cached requests), its local hit (get_num_new_matched_tokens) and its external tokens
(update_state_after_alloc). At each build it makes a KvPlan: the blocks that are full after this
step's forward, and the loads allocated since the last build, each block named by its engine
hash. The plan travels to the worker inside the step's RecordingMetadata.

Worker side, KvProbe: at the end of each step (get_finished) it fingerprints the step's completed
blocks (kept by engine hash, the first fingerprint of a hash wins) and the blocks of every load
that has finished (a sync load in its own step, an async one when get_finished reports its
request), and measures each loaded block against the fingerprint of the same hash. A
fingerprint is SAMPLES evenly spaced elements of the block in the first layer's KV tensor: the
first layer's KV of a token depends only on the token and its position, so recomputing it gives
the same values up to rounding, whatever was batched with it. The distances are written at the
end of the step (clear_connector_metadata); a block the connector reported as a failed load has
none (vLLM recomputes it).

Only a model with one KV cache group is probed: with several, vLLM's block ids index several
tensors that one first layer does not describe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvport.trace.identity import MAX_BLOCKS_PER_RECORD, short_hash

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

SAMPLES = 256
# At most 64 MiB of fingerprints (1 KiB each); the oldest are forgotten first (a later load of
# one of them is then not judged).
MAX_FINGERPRINTS = 1 << 16


@dataclass(frozen=True)
class LoadedBlocks:
    """One request's load: blocks [first, first + len(block_ids)) of the request."""

    req_id: str
    first: int
    block_ids: tuple[int, ...]
    keys: tuple[str, ...]  # each block's engine hash (identity.short_hash)
    is_async: bool


@dataclass(frozen=True)
class KvPlan:
    """Scheduler -> worker, per step: what to fingerprint at the end of it."""

    computed: tuple[tuple[int, str], ...]  # (block id, engine hash): full after the forward
    loads: tuple[LoadedBlocks, ...]  # allocated since the previous step's plan


class LoadPlanner:
    """The scheduler half: the requests' block tables, as vLLM's scheduler output tells them."""

    def __init__(self, block_size: int) -> None:
        assert block_size > 0, f"block size {block_size}"
        self._block_size = block_size
        self._tables: dict[str, list[int]] = {}
        self._asked: dict[str, tuple[int, bool]] = {}  # local tokens, async answer
        self._loads: list[LoadedBlocks] = []

    def asked(self, req_id: str, num_computed_tokens: int, answer: Any) -> None:
        """get_num_new_matched_tokens: the local hit and whether a load would be async."""
        is_async = isinstance(answer, tuple) and len(answer) == 2 and answer[1] is True
        self._asked[req_id] = (num_computed_tokens, is_async)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int,
                  hashes: Sequence[Any]) -> None:
        """update_state_after_alloc: a load of the external tokens after the local ones."""
        if num_external_tokens <= 0:
            return
        local, is_async = self._asked.get(req_id, (0, False))
        bs = self._block_size
        first = -(-local // bs)
        end = min((local + num_external_tokens) // bs, len(block_ids), len(hashes))
        if end > first:
            self._loads.append(LoadedBlocks(
                req_id, first, tuple(int(b) for b in block_ids[first:end]),
                tuple(short_hash(h) for h in hashes[first:end]), is_async))

    def plan(self, scheduler_output: SchedulerOutput, computed_before: dict[str, int],
             hashes_of: Callable[[str], Sequence[Any]]) -> KvPlan:
        """The step's plan; `computed_before` as recording_steps.computed_before."""
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in cached.resumed_req_ids:
                self._tables[rid] = []  # a resumed request's ids are given whole
            if ids is not None:
                self._tables.setdefault(rid, []).extend(ids[0])
        bs = self._block_size
        computed: list[tuple[int, str]] = []
        for rid, num_scheduled in sorted(scheduler_output.num_scheduled_tokens.items()):
            before = computed_before.get(rid, 0)
            table, hashes = self._tables.get(rid, []), hashes_of(rid)
            end = min((before + num_scheduled) // bs, len(table), len(hashes))
            # max: a connector's negative match (rule S3) leaves vLLM a negative count
            start = max(before, 0) // bs
            computed += [(table[j], short_hash(hashes[j])) for j in range(start, end)]
        loads, self._loads = tuple(self._loads), []
        return KvPlan(tuple(computed), loads)

    def forget(self, req_id: str) -> None:
        self._tables.pop(req_id, None)
        self._asked.pop(req_id, None)


class KvProbe:
    """The worker half: fingerprints of the blocks of one KV tensor (a first layer's)."""

    def __init__(self, layer: torch.Tensor, num_blocks: int) -> None:
        dims = [d for d in (0, 1) if layer.dim() > d and layer.shape[d] == num_blocks]
        if not dims:
            raise ValueError(f"no dimension of {num_blocks} blocks in the first KV tensor "
                             f"(shape {tuple(layer.shape)}): its loads cannot be probed")
        self._layer = layer
        self._block_dim = dims[0]
        size = layer.select(self._block_dim, 0).numel()
        self._index = torch.linspace(0, size - 1, min(SAMPLES, size),
                                     device=layer.device).round().long()
        self._seen: dict[str, torch.Tensor] = {}
        self._pending: dict[str, list[LoadedBlocks]] = {}  # async loads not reported yet
        self._verdicts: list[tuple[LoadedBlocks, list[float | None]]] = []
        self._failed: set[int] = set()

    def fingerprint(self, block_id: int) -> torch.Tensor:
        block = self._layer.select(self._block_dim, block_id).reshape(-1)
        return block.index_select(0, self._index).float().cpu()

    def end_of_forward(self, plan: KvPlan | None, finished_recving: Iterable[str]) -> None:
        """get_finished: measure the loads that are done, then keep the step's new blocks."""
        if plan is not None:
            for load in plan.loads:
                if load.is_async:
                    self._pending.setdefault(load.req_id, []).append(load)
                else:
                    self._measure(load)
        for rid in finished_recving:
            for load in self._pending.pop(rid, []):
                self._measure(load)
        if plan is not None:
            for block_id, key in plan.computed:
                if key not in self._seen:
                    if len(self._seen) >= MAX_FINGERPRINTS:
                        del self._seen[next(iter(self._seen))]
                    self._seen[key] = self.fingerprint(block_id)

    def load_errors(self, block_ids: Sequence[int]) -> None:
        """get_block_ids_with_load_errors: those blocks are recomputed, not judged."""
        self._failed.update(int(b) for b in block_ids)

    def _measure(self, load: LoadedBlocks) -> None:
        distances: list[float | None] = []
        for block_id, key in zip(load.block_ids, load.keys):
            ref = self._seen.get(key)
            if ref is None:
                distances.append(None)
                continue
            now = self.fingerprint(block_id)
            scale = max(float(ref.norm()), float(now.norm()))
            distances.append(0.0 if scale == 0.0 else round(float((now - ref).norm()) / scale, 4))
        self._verdicts.append((load, distances))

    def end_of_step(self) -> Iterator[dict[str, Any]]:
        """The step's `trace_loaded` records (kvport.trace.loaded); a block whose load failed
        has no distance."""
        verdicts, failed = self._verdicts, self._failed
        self._verdicts, self._failed = [], set()
        for load, distances in verdicts:
            judged = [None if b in failed else d for b, d in zip(load.block_ids, distances)]
            for start in range(0, len(judged), MAX_BLOCKS_PER_RECORD):
                end = start + MAX_BLOCKS_PER_RECORD
                yield {"req_ids": [load.req_id], "ints": [load.first + start],
                       "result": {"block_ids": list(load.block_ids[start:end]),
                                  "distances": judged[start:end]}}


class LoadChecks:
    """A RecordingConnector's C3 half (its planner or its probe, by role). Nothing here may stop
    the engine: an exception turns the checks off for the rest of the run, with one warning."""

    def __init__(self, enabled: bool, block_size: int, num_blocks: int,
                 hashes_of: Callable[[str], Sequence[Any]]) -> None:
        self._on = enabled
        self._num_blocks = num_blocks
        self._hashes_of = hashes_of
        self._planner = LoadPlanner(block_size) if enabled else None
        self._probe: KvProbe | None = None

    def _off(self, what: str) -> None:
        logger.warning("kvport RecordingConnector: load checks (C3) off after %s failed",
                       what, exc_info=True)  # noqa: LOG014  # called from handlers
        self._on, self._planner, self._probe = False, None, None

    # ---- scheduler ----------------------------------------------------------------------------

    def asked(self, req_id: str, num_computed_tokens: int, answer: Any) -> None:
        if self._planner is not None:
            self._planner.asked(req_id, num_computed_tokens, answer)

    def allocated(self, req_id: str, blocks: Any, num_external_tokens: int) -> None:
        if self._planner is None or num_external_tokens <= 0:
            return
        try:
            self._planner.allocated(req_id, blocks.get_block_ids()[0], num_external_tokens,
                                    self._hashes_of(req_id))
        except Exception:  # noqa: BLE001  # a checker's failure is never the engine's
            self._off("update_state_after_alloc")

    def plan(self, scheduler_output: SchedulerOutput,
             computed_before: dict[str, int]) -> KvPlan | None:
        if self._planner is None:
            return None
        try:
            return self._planner.plan(scheduler_output, computed_before, self._hashes_of)
        except Exception:  # noqa: BLE001
            self._off("build_connector_meta")
            return None

    def forget(self, req_id: str) -> None:
        if self._planner is not None:
            self._planner.forget(req_id)

    # ---- worker -------------------------------------------------------------------------------

    def registered(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self._on or not kv_caches:
            return
        try:
            self._probe = KvProbe(next(iter(kv_caches.values())), self._num_blocks)
        except ValueError as exc:
            logger.warning("kvport RecordingConnector: %s; C3 is not judged", exc)
            self._on = False

    def finished(self, meta: Any, finished_recving: Iterable[str] | None) -> None:
        if self._probe is None:
            return
        try:
            self._probe.end_of_forward(getattr(meta, "kv_plan", None), finished_recving or ())
        except Exception:  # noqa: BLE001
            self._off("get_finished")

    def load_errors(self, block_ids: Iterable[int]) -> None:
        if self._probe is not None:
            self._probe.load_errors([int(b) for b in block_ids])

    def records(self) -> list[dict[str, Any]]:
        """The step's `trace_loaded` records (clear_connector_metadata)."""
        if self._probe is None:
            return []
        try:
            return list(self._probe.end_of_step())
        except Exception:  # noqa: BLE001
            self._off("clear_connector_metadata")
            return []
