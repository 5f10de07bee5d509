"""A fault injector for kvport's worker half inside vLLM (the harness, harness.py, or a real
engine, run_load_failures.py): the host -> engine copies of the loads of chosen requests report
random engine blocks failed, and those blocks are spoiled (overwritten), so a block vLLM does
not recompute shows (the harness's block check; a real model's output).

Which request a copy is for is read from the load jobs of the step's metadata (start_load_kv),
before the copies are submitted. `hold`: the failing copies wait for an event, so that a test
can act (abort) while they run.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvport.connectors.offloading.mediums import ENGINE, HOST
from kvport.connectors.offloading.tiers import TransferOutcome


@dataclass
class FaultyLoads:
    worker: Any  # kvport's OffloadingConnectorWorker (the worker half)
    faulty: set[str]  # names of the requests whose loads fail
    rng: random.Random
    spoil: Callable[[int], None]  # overwrites one engine block
    hold: threading.Event | None = None
    report: bool = True  # False: the spoiled blocks are reported loaded (silent corruption)
    failed_requests: set[str] = field(default_factory=set)  # whose loads did fail
    num_failed_blocks: int = 0
    _failing: set[int] = field(default_factory=set)  # engine blocks to fail, not copied yet

    def install(self, patch: Callable[[Any, str, Any], None] = setattr) -> FaultyLoads:
        """Patch the worker half (`patch` is setattr, or pytest's monkeypatch.setattr)."""
        transfers = self.worker.transfers
        assert transfers is not None, "register_kv_caches was not called"
        handler = transfers._handlers[(HOST, ENGINE)]
        real_start, real_transfer = self.worker.start_load_kv, handler._transfer

        def start_load_kv(meta: Any) -> None:
            for job in meta.loads:
                name = self._faulty_name(job.req_id)
                if name is not None and job.dst.block_ids:
                    self._choose(name, list(job.dst.block_ids))
            real_start(meta)

        def transfer(src: Any, dst: Any) -> TransferOutcome:
            out = real_transfer(src, dst)
            positions = [i for i, b in enumerate(dst.block_ids) if b in self._failing]
            if positions and self.hold is not None:
                assert self.hold.wait(timeout=60), "the held copy was never released"
            for p in positions:  # what a torn or corrupt copy leaves behind
                self._failing.discard(dst.block_ids[p])
                self.spoil(dst.block_ids[p])
            failed = set(out.failed_indices) | (set(positions) if self.report else set())
            return TransferOutcome(out.num_bytes, sorted(failed))

        patch(self.worker, "start_load_kv", start_load_kv)
        patch(handler, "_transfer", transfer)
        return self

    def _faulty_name(self, req_id: str) -> str | None:
        """The faulty request's name: the id, or (a real engine) the id vLLM's engine made
        of it (`<name>-<suffix>`)."""
        return next((f for f in self.faulty if req_id == f or req_id.startswith(f + "-")), None)

    def _choose(self, req_id: str, block_ids: list[int]) -> None:
        k = self.rng.randint(1, len(block_ids))
        self._failing.update(self.rng.sample(block_ids, k))
        self.failed_requests.add(req_id)
        self.num_failed_blocks += k
