"""A fault injector for the vLLM harness (harness.py): the host -> engine copies of chosen
requests report random positions failed, and those engine blocks are overwritten with garbage,
so a block vLLM does not recompute is caught by the block check (`Harness.check_block`).

Which request a copy is for is read when the worker submits it (the main thread, between
vLLM's schedule() and the next one), from vLLM's block tables: a copy's engine blocks belong to
exactly one request (the test prompts share no block).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from harness import Harness

from kvport.connectors.offloading.mediums import ENGINE, HOST
from kvport.connectors.offloading.tiers import TransferOutcome

GARBAGE = 12345.0


@dataclass
class FaultyLoads:
    h: Harness
    faulty: set[str]  # requests whose loads fail
    rng: random.Random
    failed_requests: set[str] = field(default_factory=set)  # whose loads did fail
    num_failed_blocks: int = 0
    _plan: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FaultyLoads:
        transfers = self.h.worker.worker_half.transfers
        assert transfers is not None
        handler = transfers._handlers[(HOST, ENGINE)]
        real_submit, real_transfer = transfers.submit, handler._transfer

        def submit(job_id: Any, src: Any, dst: Any) -> bool:
            if dst.medium() == ENGINE and src.medium() == HOST:
                self._choose(list(dst.block_ids))
            return real_submit(job_id, src, dst)

        def transfer(src: Any, dst: Any) -> TransferOutcome:
            out = real_transfer(src, dst)
            positions = self._plan.pop(tuple(dst.block_ids), [])
            for p in positions:  # what a torn or corrupt copy leaves behind
                self.h.storage[:, dst.block_ids[p]] = GARBAGE
            return TransferOutcome(out.num_bytes,
                                   sorted(set(out.failed_indices) | set(positions)))

        monkeypatch.setattr(transfers, "submit", submit)
        monkeypatch.setattr(handler, "_transfer", transfer)
        return self

    def _choose(self, block_ids: list[int]) -> None:
        owner = self._owner(block_ids[0])
        if owner not in self.faulty:
            return
        k = self.rng.randint(1, len(block_ids))
        self._plan[tuple(block_ids)] = sorted(self.rng.sample(range(len(block_ids)), k))
        self.failed_requests.add(owner)
        self.num_failed_blocks += k

    def _owner(self, block_id: int) -> str | None:
        s = self.h.scheduler
        owners = [rid for rid in s.requests
                  if block_id in s.kv_cache_manager.get_block_ids(rid)[0]]
        assert len(owners) <= 1, f"block {block_id} is shared by {owners}"
        return owners[0] if owners else None
