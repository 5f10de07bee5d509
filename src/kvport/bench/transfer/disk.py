"""Disk tier rows of `kvport bench transfer`: entries of one offload block (one engine block by
default) stored from and loaded into host slots, next to one sequential file of the same bytes.

For each entry size S, `disk_mib` MiB of host slots are written as entries through a transfer
worker (`disk_threads` threads, HOST->DISK jobs of `total_mib` MiB), each round into a fresh
directory, next to writing one file of the same bytes (no fsync on either side; dirty pages are
synced, untimed, before every side): `store_rounds`. The last round's entries are then loaded
back into the slots (DISK->HOST jobs of consecutive slots: one large job of `total_mib` MiB per
worker thread at a time, or small jobs of `small_job_blocks` entries), warm (the page cache
holds the files: `load_rounds`) and cold (every file fsynced and dropped with
POSIX_FADV_DONTNEED before each side: `cold_rounds`), next to `readinto` of the one file. The
one file is written and read on a helper thread (timing.HelperThread), as the worker's thread
runs the tier's jobs: the same read runs slower there than on the main thread on some machines,
and both sides pay it. Warm rounds also read the one file on the main thread, checked and split
(one_file). Sides alternate within each round (paired_rounds); ratios are per round. Cold rounds
also record the block device's read requests and their mean size. The loaded slots must equal
the stored ones, else the row fails.

The tier is measured through its public API only: a DiskTier with the thread count and read
piece it is given, a transfer worker (worker.wiring) moving HOST<->DISK jobs.
"""

from __future__ import annotations

import dataclasses

import hashlib
import itertools
import os
import shutil
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvport.bench.transfer import one_file
from kvport.bench.transfer.config import MIB, TransferBenchConfig
from kvport.bench.transfer.rows import (
    ColdLoad,
    DeviceReads,
    DiskRow,
    DiskSides,
    ExtraRead,
    WarmLoad,
)
from kvport.bench.transfer.timing import HelperThread, gib_s, paired_rounds, ratio_stats
from kvport.connectors.offloading.mediums import DISK, DiskBlocks, HostBlocks
from kvport.connectors.offloading.tiers.disk.tier import DiskTier
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.worker.transfers import TransferRouter
from kvport.connectors.offloading.worker.wiring import build_tier_worker

Job = tuple[HostBlocks | DiskBlocks, HostBlocks | DiskBlocks]  # (source, destination)
EXTRA_READS = ("checked_file", "main_thread_file", "split_file")


def bench_disk(cfg: TransferBenchConfig, root: Path) -> list[DiskRow]:
    rows: list[DiskRow] = []
    helper = HelperThread()
    try:
        for size in cfg.sizes():
            bench = DiskBench(cfg, size, root / f"s{size}", helper)
            try:
                rows += bench.rows()
            finally:
                bench.close()
    finally:
        helper.close()
    return rows


def side_stats(num_bytes: int, times: dict[str, list[float]]) -> DiskSides:
    return DiskSides(gib_s(num_bytes, statistics.median(times["tier"])),
                     gib_s(num_bytes, statistics.median(times["one_file"])),
                     ratio_stats(times["tier"], times["one_file"]))


class DiskBench:
    """One entry size: `disk_mib` MiB of host slots of seeded random bytes, a key per slot (like
    the connector's chained block hashes: uniform bytes, so a job's entries spread over the
    <key hex[:2]> directories as real ones do), and the rounds over them."""

    def __init__(self, cfg: TransferBenchConfig, size: int, root: Path,
                 helper: HelperThread) -> None:
        root.mkdir()
        self.cfg, self.size, self.root, self.helper = cfg, size, root, helper
        self.n = max(1, cfg.disk_mib * MIB // size)
        self.num_bytes = self.n * size
        self.threads = torch.get_num_threads()  # the tier's read threads: torch's, as its default
        self.host = HostTier(self.n, size)
        gen = torch.Generator().manual_seed(cfg.seed + size)
        self.host.buffer.copy_(torch.randint(0, 256, self.host.buffer.shape, dtype=torch.uint8,
                                             generator=gen))
        self.expected = self.host.buffer.clone()
        self.keys = [hashlib.sha256(b"%d/%d" % (size, i)).digest() for i in range(self.n)]
        self.big = max(1, min(self.n, cfg.total_mib * MIB // size))
        self._stored: list[tuple[DiskTier, TransferRouter]] = []  # one per store round
        self._files: list[Path] = []  # the one file of each store round
        self._names = itertools.count()  # a fresh directory and file name every round
        self._splitters: ThreadPoolExecutor | None = None

    def rows(self) -> list[DiskRow]:
        """The store rounds, then a row per job size (the large job's row holds the stores)."""
        store = self.store_rounds()
        self._splitters = ThreadPoolExecutor(max(1, self.threads - 1), "kvport-bench-split")
        return [DiskRow(self.size, self.n, job, self.num_bytes,
                        store if job == self.big else None, self.load_rounds(job),
                        self.cold_rounds(job), self.check_loaded(job))
                for job in dict.fromkeys((self.big, min(self.n, self.cfg.small_job_blocks)))]

    def close(self) -> None:
        for _, worker in self._stored:
            worker.shutdown()
        if self._splitters is not None:
            self._splitters.shutdown()

    @property
    def disk(self) -> DiskTier:
        return self._stored[-1][0]

    def jobs(self, job: int, to_disk: bool) -> list[Job]:
        out: list[Job] = []
        for i in range(0, self.n, job):
            slots = HostBlocks(list(range(i, min(self.n, i + job))))
            keys = DiskBlocks(self.keys[i:i + job])
            out.append((slots, keys) if to_disk else (keys, slots))
        return out

    def run(self, worker: TransferRouter, todo: list[Job]) -> None:
        for j, (src, dst) in enumerate(todo):
            worker.submit(j, src, dst)
        assert worker.wait(range(len(todo)), timeout=600)
        failed = [r for r in worker.get_finished() if not r.success]
        if failed:
            raise RuntimeError(f"disk bench, {self.size} B entries: {len(failed)} job(s) failed")

    # --- stores: a fresh tier directory per round, next to writing one file -------------------

    def store_rounds(self) -> DiskSides:
        times = paired_rounds({"tier": self._store_tier,
                               "one_file": self.helper.wrap(self._store_file)},
                              self.cfg.repeats, before=lambda _: self._keep_last(), warm_up=False)
        self._keep_last()
        return side_stats(self.num_bytes, times)

    def _store_tier(self) -> None:
        disk = DiskTier(self.root, 2 * self.num_bytes + self.n * 4096,
                        b"bench-%d-%d" % (self.size, next(self._names)), num_threads=self.threads)
        worker = build_tier_worker(self.host, {DISK: disk}, lower_threads=self.cfg.disk_threads)
        self._stored.append((disk, worker))
        self.run(worker, self.jobs(self.big, to_disk=True))

    def _store_file(self) -> None:
        self._files.append(self.root / f"one-file-{next(self._names)}.bin")
        with open(self._files[-1], "wb") as fh:
            fh.write(self.host.buffer.numpy().data)

    def _keep_last(self) -> None:
        """Untimed: only the last round's entries and file stay."""
        while len(self._stored) > 1:
            old_disk, old_worker = self._stored.pop(0)
            old_worker.shutdown()
            shutil.rmtree(old_disk.dir, ignore_errors=True)
        while len(self._files) > 1:
            self._files.pop(0).unlink()
        os.sync()

    # --- loads: warm, then cold, of the last round's entries -----------------------------------

    def _sides(self, job: int) -> dict[str, Callable[[], object]]:
        """The tier's load jobs, and `readinto` of the one file on the helper thread."""
        todo, worker, one = self.jobs(job, to_disk=False), self._stored[-1][1], self._files[-1]

        def read_file() -> None:
            with open(one, "rb", buffering=0) as fh:
                fh.readinto(self.host.buffer.numpy().data)

        return {"tier": lambda: self.run(worker, todo), "one_file": self.helper.wrap(read_file),
                "main_thread_file": read_file}

    def load_rounds(self, job: int) -> WarmLoad:
        sides = self._sides(job)
        one, out = self._files[-1], self.host.buffer.numpy().reshape(-1).data
        assert self._splitters is not None, "rows() made the split readers"
        splitters = self._splitters
        extra = {
            "checked_file": self.helper.wrap(lambda: one_file.read_checked(
                one, out, self.size, self.disk.piece_bytes)),
            "main_thread_file": sides["main_thread_file"],
            "split_file": self.helper.wrap(lambda: one_file.read_split(
                one, out, self.size, splitters, self.threads))}
        warm = paired_rounds({"tier": sides["tier"], "one_file": sides["one_file"],
                              "checked_file": extra["checked_file"],
                              "main_thread_file": extra["main_thread_file"],
                              "split_file": extra["split_file"]}, self.cfg.repeats)
        return WarmLoad(side_stats(self.num_bytes, warm), self.threads, {
            name: ExtraRead(gib_s(self.num_bytes, statistics.median(warm[name])),
                            ratio_stats(warm["tier"], warm[name]).ratio)
            for name in EXTRA_READS})

    def cold_rounds(self, job: int) -> ColdLoad:
        sides = self._sides(job)
        drops = {"tier": [self.disk.path(k) for k in self.keys], "one_file": [self._files[-1]]}
        device = one_file.block_device_stat(self.root)
        requests: dict[str, list[tuple[int, int]]] = {"tier": [], "one_file": []}
        counted = {name: one_file.count_requests(device, sides[name], requests[name])
                   for name in ("tier", "one_file")}
        times = paired_rounds(counted, self.cfg.repeats,
                              before=lambda name: one_file.drop_cache(drops[name]),
                              warm_up=False)
        return ColdLoad(side_stats(self.num_bytes, times), {
            name: DeviceReads(statistics.median(r for r, _ in reqs),
                              statistics.median(kib for _, kib in reqs))
            for name, reqs in requests.items() if reqs})

    def check_loaded(self, job: int) -> dict[str, object]:
        """The slots loaded once more must equal the stored ones; the tier's counters."""
        self.host.buffer.zero_()
        self._sides(job)["tier"]()
        if not torch.equal(self.host.buffer, self.expected):
            raise RuntimeError(f"disk bench, {self.size} B entries: loaded slots differ from "
                               f"the stored ones")
        return dataclasses.asdict(self.disk.stats.snapshot())
