"""`kvport bench soak`: the subcommand's flags, and the run they ask for (exit code 1 when an
answer differs or a bound breaks)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(commands: Any) -> None:
    p = commands.add_parser(
        "soak", help="a mixed workload with periodic kill -9 and restart; resources over time",
        description="Runs repeated-prefix and unique prompts in kvport's engine with the "
                    "OffloadingConnector (host, a small disk tier at capacity, a Redis that "
                    "evicts) in a child process that is killed with SIGKILL at seeded random "
                    "moments and restarted on the same disk root and Redis. Samples RSS, open "
                    "descriptors, threads, disk use, temp files, Redis memory and evictions, "
                    "step-time p50/p99 and the hit rate; compares every answer with an engine "
                    "without a connector. Exit code 1 when an answer differs or a bound breaks; "
                    "see kvport.bench.soak.run.")
    p.add_argument("--duration", type=float, default=60.0, metavar="S", help="seconds of workload")
    p.add_argument("--kill-every", type=float, default=10.0, metavar="S",
                   help="mean seconds between kills (each uniform in 0.5x-1.5x, seeded)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the kill times")
    p.add_argument("--out", metavar="PATH", help="write the JSON report here")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="use this Redis (keys under a tenant of this run, deleted at the end) "
                        "instead of a redis-server of the soak's own")
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--num-kv-blocks", type=int, default=64, help="the engine's KV pool")
    p.add_argument("--host-mib", type=float, default=1.0, help="host tier size")
    p.add_argument("--disk-mib", type=float, default=3.0, help="the disk tier's max_bytes")
    p.add_argument("--redis-maxmemory-mib", type=float, default=4.0,
                   help="maxmemory of the soak's own redis-server (allkeys-lru)")
    p.add_argument("--sample-every", type=float, default=1.0, metavar="S")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--work-dir", default=None,
                   help="disk root, Redis dir and child logs (default: a temporary directory, "
                        "removed at the end)")
    p.add_argument("--max-rss-growth", type=float, default=None, metavar="MIB",
                   help="bound: max RSS minus RSS at the start")
    p.add_argument("--max-fds", type=int, default=None, help="bound: open descriptors")
    p.add_argument("--max-fd-growth", type=int, default=None,
                   help="bound: max descriptors minus those at the start")
    p.add_argument("--max-threads", type=int, default=None)
    p.add_argument("--max-thread-growth", type=int, default=None)
    p.add_argument("--max-p99-step-ms", type=float, default=None,
                   help="bound: p99 step time of the last samples")
    p.add_argument("--disk-slack", type=int, default=64 << 10, metavar="BYTES",
                   help="disk use allowed beyond the disk tier's max_bytes")
    p.add_argument("--min-kills", type=int, default=1)
    p.set_defaults(func=run_command)


def _mib(name: str, value: float) -> int:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 MiB, got {value}")
    return int(value * (1 << 20))


def run_command(args: argparse.Namespace) -> int:
    from kvport.bench.common.command import run_bench_command
    from kvport.bench.soak import run
    from kvport.bench.soak.report import format_soak
    from kvport.bench.soak.result import SoakBounds, SoakResult

    def config() -> run.SoakConfig:
        bounds = SoakBounds(
            max_rss_growth_mib=args.max_rss_growth, max_fds=args.max_fds,
            max_fd_growth=args.max_fd_growth, max_threads=args.max_threads,
            max_thread_growth=args.max_thread_growth, max_p99_step_ms=args.max_p99_step_ms,
            disk_slack_bytes=args.disk_slack, min_kills=args.min_kills)
        return run.SoakConfig(
            duration_s=args.duration, kill_every_s=args.kill_every, seed=args.seed,
            redis_url=args.redis_url, model=args.model, concurrency=args.concurrency,
            num_kv_blocks=args.num_kv_blocks, host_bytes=_mib("--host-mib", args.host_mib),
            disk_max_bytes=_mib("--disk-mib", args.disk_mib),
            redis_maxmemory_bytes=_mib("--redis-maxmemory-mib", args.redis_maxmemory_mib),
            sample_every_s=args.sample_every, threads=args.threads, work_dir=args.work_dir,
            bounds=bounds)

    def exit_code(result: SoakResult) -> int:
        return 0 if result.ok else 1

    # run.run_soak looked up at the call: a test stands a finished soak in for it
    return run_bench_command("soak", args.out, config, lambda cfg: run.run_soak(cfg),
                             format_soak, exit_code)
