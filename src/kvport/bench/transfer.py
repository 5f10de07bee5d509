"""`kvport bench transfer`: host, disk and Redis tier bandwidth next to plain copies of the same
bytes, at the connector's granularity (offload block = one engine block, jobs of many blocks).

    transfer_common  the config, the pool cases (geometry x layout), paired timing rounds
    transfer_host    host tier store/load jobs vs a torch copy (method in its docstring)
    transfer_disk    disk tier loads (warm, cold) and stores vs one sequential file
    transfer_redis   Redis tier vs redis-py's own pipelined SET/GET (with a Redis URL)
    transfer_format  the text tables
    transfer_targets issue 13's targets, met or not

Absolute numbers on a shared machine mean little: every ratio compares sides measured back to
back in the same round, and the JSON records the machine's load average.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvport.bench.transfer_common import TransferBenchConfig
from kvport.bench.transfer_format import format_transfer
from kvport.bench.transfer_redis import _redis_client, check_redis
from kvport.bench.transfer_targets import evaluate_targets

__all__ = ["TransferBenchConfig", "_redis_client", "check_redis", "format_transfer",
           "run_transfer"]


def run_transfer(cfg: TransferBenchConfig) -> dict[str, Any]:
    from kvport.bench import OtherLoadMeter, machine_info
    from kvport.bench.transfer_host import bench_host

    load = OtherLoadMeter()
    load.start()
    result: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info(),
                              "cases": [{"case": c.name, "engine_block_bytes":
                                         c.engine_block_bytes} for c in cfg.cases()]}
    result["host"] = bench_host(cfg)
    if cfg.disk:
        from kvport.bench.transfer_disk import bench_disk

        root = Path(tempfile.mkdtemp(prefix="kvport-bench-", dir=cfg.disk_dir))
        try:
            result["disk"] = bench_disk(cfg, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if cfg.redis_url is not None:
        from kvport.bench.transfer_redis import bench_redis

        result["redis"] = bench_redis(cfg)
    result["other_load_cores"] = load.stop()
    result["steal_cores"] = load.steal_cores  # of other load, what the hypervisor took
    result["targets"] = evaluate_targets(result)
    return result
