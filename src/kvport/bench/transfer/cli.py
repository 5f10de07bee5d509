"""`kvport bench transfer`: its flags, and the run they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from kvport.bench.common.command import int_list, name_list, run_bench_command


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "transfer", help="offload tier bandwidth (host, disk, Redis) vs plain copies of the "
                         "same bytes",
        description="Host tier store/load GiB/s of jobs of engine blocks (a large job and small "
                    "ones; consecutive and scattered slots) next to a torch copy of the same "
                    "bytes, for every pool the project runs (geometry x layout); disk tier "
                    "load GiB/s of one-engine-block entries next to reading one file, warm and "
                    "cold page cache, and store GiB/s next to writing it; with --redis-url, "
                    "Redis tier store/load GiB/s next to redis-py's own pipelined SET/GET of "
                    "the same payloads; see kvport.bench.transfer for the method.")
    p.add_argument("--geometry", default=None, choices=("tiny-llama", "smollm2-135m"),
                   help="engine block geometry, float32 (default: both)")
    p.add_argument("--layout", default=None, choices=("kvport", "vllm-cpu"),
                   help="the engine pool: kvport's block-major pool of 16-token blocks, or "
                        "vLLM's CPU pool (layer-major, 128-token blocks) (default: both)")
    p.add_argument("--block-sizes", type=int_list, default=(), metavar="BYTES,BYTES",
                   help="offload block sizes in bytes, whole engine blocks (default: one "
                        "engine block of each pool)")
    p.add_argument("--total-mib", type=int, default=64,
                   help="MiB of the large job (host and disk loads)")
    p.add_argument("--small-job-blocks", type=int, default=8,
                   help="offload blocks of the small jobs")
    p.add_argument("--strategies", type=name_list, default=("native",), metavar="NAME,NAME",
                   help="host copy strategies: the tier's (native, numpy, torch) and the "
                        "bench's own (runs, gather, index, cat)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; median reported")
    p.add_argument("--no-disk", dest="disk", action="store_false", help="skip the disk tier")
    p.add_argument("--disk-mib", type=int, default=128, help="MiB of disk entries per size")
    p.add_argument("--disk-dir", default=None, help="where to write (default: $TMPDIR)")
    p.add_argument("--disk-threads", type=int, default=1,
                   help="disk transfer threads (1: the connector's)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="also measure the Redis tier on this server (e.g. "
                        "redis://127.0.0.1:6379/0); writes keys under a random namespace of its "
                        "own and deletes exactly those (needs pip install 'kvport[redis]')")
    p.add_argument("--redis-mib", type=int, default=64,
                   help="MiB of Redis values per size (the server needs room for twice this)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from kvport.bench.common.redis import check_redis
    from kvport.bench.transfer.config import TransferBenchConfig
    from kvport.bench.transfer.report import format_transfer
    from kvport.bench.transfer.run import run_transfer

    def config() -> TransferBenchConfig:
        cfg = TransferBenchConfig(
            geometry=args.geometry, layout=args.layout, block_sizes=args.block_sizes,
            total_mib=args.total_mib, small_job_blocks=args.small_job_blocks,
            strategies=args.strategies, repeats=args.repeats, disk=args.disk,
            disk_mib=args.disk_mib, disk_dir=args.disk_dir, disk_threads=args.disk_threads,
            redis_url=args.redis_url, redis_mib=args.redis_mib)
        if cfg.redis_url is not None:
            check_redis(cfg.redis_url)  # before the host and disk rows, not after them
        return cfg

    return run_bench_command("transfer", args.json, config, run_transfer, format_transfer)
