"""Disk tier rows of `kvport bench transfer`: entries of one offload block (one engine block by
default) stored from and loaded into host slots, next to one sequential file of the same bytes.

For each entry size S, `disk_mib` MiB of host slots are written as entries through a transfer
worker (`disk_threads` threads, HOST->DISK jobs of `total_mib` MiB), each round into a fresh
directory, next to writing one file of the same bytes (no fsync on either side; dirty pages are
synced, untimed, before every side). The last round's entries are then loaded back into the
slots (DISK->HOST jobs of consecutive slots: one large job of `total_mib` MiB per worker thread
at a time, or small jobs of `small_job_blocks` entries), warm (the page cache holds the files)
and cold (every file fsynced and dropped with POSIX_FADV_DONTNEED before each side), next to
`readinto` of the one file. The one file is written and read on a helper thread
(transfer_common.HelperThread), as the worker's thread runs the tier's jobs: the same read runs
slower there than on the main thread on some machines, and both sides pay it. Warm rounds also
read the one file on the main thread, checked (`readinto` in the tier's pieces, each entry's
bytes hashed with xxh3 as they land: what the tier's first read of an entry costs at best), and
split (read in one part per thread the tier reads a large cached extent with, at once: the
best plain read of the file with the tier's threads).
Sides alternate within each round (paired_rounds); ratios are per round. Cold rounds also record
the block device's read requests and their mean size (from /sys/dev/block), which tells whether
the reads of neighbouring entries were merged. The loaded slots must equal the stored ones, else
the row fails.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvport.bench.transfer_common import (
    MIB, HelperThread, TransferBenchConfig, gib_s, paired_rounds, ratio_stats,
)


def bench_disk(cfg: TransferBenchConfig, root: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    helper = HelperThread()
    try:
        for size in cfg.sizes():
            rows += _size_rows(cfg, size, root / f"s{size}", helper)
    finally:
        helper.close()
    return rows


def _size_rows(cfg: TransferBenchConfig, size: int, root: Path,
               helper: HelperThread) -> list[dict[str, Any]]:
    import torch

    from kvport.connectors.offloading.mediums import DISK, DiskBlocks, HostBlocks
    from kvport.connectors.offloading.tiers.disk.tier import DiskTier
    from kvport.connectors.offloading.tiers.host.tier import HostTier
    from kvport.connectors.offloading.worker.wiring import build_tier_worker

    root.mkdir()
    n = max(1, cfg.disk_mib * MIB // size)
    num_bytes = n * size
    host = HostTier(n, size)
    gen = torch.Generator().manual_seed(cfg.seed + size)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8, generator=gen))
    expected = host.buffer.clone()
    # keys like the connector's (chained block hashes): uniform bytes, so the entries of a job
    # spread over the <key hex[:2]> directories as real ones do
    keys = [hashlib.sha256(b"%d/%d" % (size, i)).digest() for i in range(n)]
    big = max(1, min(n, cfg.total_mib * MIB // size))
    job_sizes = list(dict.fromkeys((big, min(n, cfg.small_job_blocks))))

    def jobs(job: int, medium: str) -> list[tuple[Any, Any]]:
        out = []
        for i in range(0, n, job):
            slots, ks = HostBlocks(list(range(i, min(n, i + job)))), DiskBlocks(keys[i:i + job])
            out.append((slots, ks) if medium == "store" else (ks, slots))
        return out

    def run(worker: Any, todo: list[tuple[Any, Any]]) -> None:
        for j, (src, dst) in enumerate(todo):
            worker.submit(j, src, dst)
        assert worker.wait(range(len(todo)), timeout=600)
        failed = [r for r in worker.get_finished() if not r.success]
        if failed:
            raise RuntimeError(f"disk bench, {size} B entries: {len(failed)} job(s) failed")

    # --- stores: a fresh tier directory per round, next to writing one file -------------------
    tiers: list[tuple[Any, Any]] = []
    files: list[Path] = []
    rounds = itertools.count()  # a fresh directory and file name every round

    def store_tier() -> None:
        disk = DiskTier(root, 2 * num_bytes + n * 4096, b"bench-%d-%d" % (size, next(rounds)))
        worker = build_tier_worker(host, {DISK: disk}, lower_threads=cfg.disk_threads)
        tiers.append((disk, worker))
        run(worker, jobs(big, "store"))

    def store_file() -> None:
        files.append(root / f"one-file-{next(rounds)}.bin")
        with open(files[-1], "wb") as fh:
            fh.write(host.buffer.numpy().data)

    def keep_last() -> None:  # untimed: only the last round's entries and file stay
        while len(tiers) > 1:
            old_disk, old_worker = tiers.pop(0)
            old_worker.shutdown()
            shutil.rmtree(old_disk.dir, ignore_errors=True)
        while len(files) > 1:
            files.pop(0).unlink()
        os.sync()

    times = paired_rounds({"tier": store_tier, "one_file": helper.wrap(store_file)},
                          cfg.repeats, before=lambda _: keep_last(), warm_up=False)
    store = _side_stats(num_bytes, times)
    keep_last()
    (disk, worker), one = tiers[0], files[0]
    # the tier reads a large cached extent with its helpers: so does the split baseline
    splitters = ThreadPoolExecutor(max(1, disk.loader.num_helpers), "kvport-bench-split")
    drops = {"tier": [disk.path(k) for k in keys], "one_file": [one]}
    device = _block_device_stat(root)
    rows = []
    try:
        for job in job_sizes:
            load_jobs = jobs(job, "load")

            def load_tier(load_jobs: list[tuple[Any, Any]] = load_jobs) -> None:
                run(worker, load_jobs)

            def read_file() -> None:
                with open(one, "rb", buffering=0) as fh:
                    fh.readinto(host.buffer.numpy().data)

            def read_file_checked() -> None:
                _read_checked(one, host.buffer.numpy().reshape(-1).data, size, disk.piece_bytes)

            def read_file_split() -> None:
                _read_split(one, host.buffer.numpy().reshape(-1).data, size, splitters,
                            disk.loader.num_helpers + 1)

            row: dict[str, Any] = {"offload_block_bytes": size, "num_entries": n,
                                   "job_blocks": job, "bytes_per_transfer": num_bytes,
                                   "store": store if job == big else None}
            sides: dict[str, Callable[[], object]] = {"tier": load_tier,
                                                      "one_file": helper.wrap(read_file)}
            warm = paired_rounds({**sides, "checked_file": helper.wrap(read_file_checked),
                                  "main_thread_file": read_file,
                                  "split_file": helper.wrap(read_file_split)}, cfg.repeats)
            row["warm"] = _side_stats(num_bytes, warm)
            row["warm"]["read_threads"] = disk.loader.num_helpers + 1
            for extra in ("checked_file", "main_thread_file", "split_file"):
                row["warm"][f"{extra}_gib_s"] = gib_s(num_bytes, statistics.median(warm[extra]))
                row["warm"][f"ratio_to_{extra}"] = ratio_stats(warm["tier"], warm[extra])["ratio"]
            requests: dict[str, list[tuple[int, int]]] = {"tier": [], "one_file": []}
            counted = {name: _count_requests(device, fn, requests[name])
                       for name, fn in sides.items()}
            row["cold"] = _side_stats(num_bytes, paired_rounds(
                counted, cfg.repeats, before=lambda name: _drop_cache(drops[name]),
                warm_up=False))
            row["cold"]["device_requests"] = {
                name: {"requests": statistics.median(r for r, _ in reqs),
                       "mean_kib": statistics.median(kib for _, kib in reqs)}
                for name, reqs in requests.items() if reqs}
            host.buffer.zero_()
            load_tier()
            if not torch.equal(host.buffer, expected):
                raise RuntimeError(f"disk bench, {size} B entries: loaded slots differ from "
                                   f"the stored ones")
            row["tier_stats"] = disk.stats.snapshot()
            rows.append(row)
    finally:
        worker.shutdown()
        splitters.shutdown()
    return rows


def _side_stats(num_bytes: int, times: dict[str, list[float]]) -> dict[str, Any]:
    return {"tier_gib_s": gib_s(num_bytes, statistics.median(times["tier"])),
            "one_file_gib_s": gib_s(num_bytes, statistics.median(times["one_file"])),
            **ratio_stats(times["tier"], times["one_file"])}


def _read_checked(path: Path, out: memoryview, entry_bytes: int, piece_bytes: int) -> None:
    """One file into out, a piece at a time (the tier's piece size, whole entries), each entry
    hashed right after its piece landed."""
    from kvport.connectors.offloading.tiers.disk.location import checksum

    piece = max(1, piece_bytes // entry_bytes) * entry_bytes
    with open(path, "rb", buffering=0) as fh:
        for start in range(0, out.nbytes, piece):
            view = out[start:start + piece]
            fh.readinto(view)
            for e in range(0, view.nbytes, entry_bytes):
                checksum(view[e:e + entry_bytes])


def _read_split(path: Path, out: memoryview, entry_bytes: int, pool: ThreadPoolExecutor,
                k: int) -> None:
    """`preadv` of the file into out, cut at whole entries into k parts read at once: k - 1 on
    the pool's threads, one on the caller's (what the tier does with an extent held in the page
    cache: disk_read.SPLIT_BYTES)."""
    entries = len(out) // entry_bytes
    bounds = [entries * g // k * entry_bytes for g in range(k)] + [len(out)]
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = [pool.submit(os.preadv, fd, [out[lo:hi]], lo)
                 for lo, hi in zip(bounds[1:-1], bounds[2:])]
        os.preadv(fd, [out[:bounds[1]]], 0)
        for part in parts:
            part.result()
    finally:
        os.close(fd)


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _block_device_stat(path: Path) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the device holding `path` (None where there is none)."""
    dev = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.exists() else None


def _count_requests(stat: Path | None, fn: Callable[[], object],
                    out: list[tuple[int, int]]) -> Callable[[], None]:
    """fn, recording (read requests, mean KiB per request) of the device while it ran."""
    def counted() -> None:
        before = _read_counters(stat)
        fn()
        after = _read_counters(stat)
        if before and after:
            reqs, sectors = after[0] - before[0], after[2] - before[2]
            out.append((reqs, sectors // 2 // max(reqs, 1)))
    return counted


def _read_counters(stat: Path | None) -> list[int] | None:
    if stat is None:
        return None
    try:
        return [int(x) for x in stat.read_text().split()]
    except (OSError, ValueError):
        return None
