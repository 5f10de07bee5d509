"""`kvport bench transfer`: the host rows, then the disk rows in a directory of the run's own
(removed at the end), then the Redis rows, with the load other processes added over the run."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from kvport.bench.common.machine import OtherLoadMeter, machine_info
from kvport.bench.transfer.config import TransferBenchConfig
from kvport.bench.transfer.rows import TransferResult
from kvport.bench.transfer.targets import evaluate_targets


def run_transfer(cfg: TransferBenchConfig) -> TransferResult:
    from kvport.bench.transfer.host import bench_host

    load = OtherLoadMeter()
    load.start()
    machine = machine_info()
    host = tuple(bench_host(cfg))
    disk = None
    if cfg.disk:
        from kvport.bench.transfer.disk import bench_disk

        root = Path(tempfile.mkdtemp(prefix="kvport-bench-", dir=cfg.disk_dir))
        try:
            disk = tuple(bench_disk(cfg, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    redis = None
    if cfg.redis_url is not None:
        from kvport.bench.transfer.redis import bench_redis

        redis = bench_redis(cfg)
    other = load.stop()
    return TransferResult(cfg, machine, host, disk, redis, other, load.steal_cores,
                          tuple(evaluate_targets(host, disk)))
