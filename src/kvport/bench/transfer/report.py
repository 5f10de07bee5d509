"""Text tables of a `kvport bench transfer` result: GiB/s, with the ratio to the baseline of the
same rounds in ( ) (median of the per-round ratios; [min-max] where rounds disagree)."""

from __future__ import annotations

from kvport.bench.transfer.config import MIB
from kvport.bench.transfer.rows import DiskRow, HostRow, RedisRows, TransferResult
from kvport.bench.transfer.targets import format_targets
from kvport.bench.transfer.timing import RatioStats

_EXTRA_READS = {"checked_file": "one file read and hashed per entry",
                "main_thread_file": "one file read on the main thread"}


def _ratio(r: RatioStats) -> str:
    return f"{r.ratio:.2f} [{r.ratio_min:.2f}-{r.ratio_max:.2f}]"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.1f} MiB" if num_bytes >= MIB else f"{num_bytes >> 10} KiB"


def format_transfer(result: TransferResult) -> str:
    lines = [(f"host tier, GiB/s (ratio to a torch copy of the same bytes per job); float32, "
              f"{result.machine.torch_threads} torch threads, median of "
              f"{result.config.repeats} rounds")]
    lines += [_host_line(r) for r in result.host]
    if result.disk:
        lines.append("disk tier, GiB/s (ratio to one file of the same bytes, read or written on "
                     "a helper thread as the tier's jobs run): loads warm and cold (page cache "
                     "dropped), stores (first row of each size)")
    for d in result.disk or ():
        lines += _disk_lines(d)
    if result.redis is not None:
        lines += _redis_lines(result.redis, result.config.job_blocks, result.config.repeats)
    lines += format_targets(result.targets)
    if result.other_load_cores is not None:  # noisy numbers are marked as such
        lines.append(f"other load during the run {result.other_load_cores:.2f} cores, of "
                     f"which hypervisor steal {result.steal_cores or 0.0:.2f}")
    return "\n".join(lines)


def _host_line(r: HostRow) -> str:
    cells = [f"{s} store {sides.store_gib_s:.2f} ({_ratio(sides.store)}) load "
             f"{sides.load_gib_s:.2f} ({_ratio(sides.load)})"
             for s, sides in r.strategies.items()]
    copy = f"{r.torch_copy_gib_s:.2f}" if r.torch_copy_gib_s is not None else "-"
    return (f"  {r.case.name:<22} block {_size(r.offload_block_bytes):>9}  job "
            f"{r.job_blocks:>4} x {r.num_jobs:<4} {r.slots:<11} copy {copy}  " + " | ".join(cells))


def _disk_lines(d: DiskRow) -> list[str]:
    cells = [f"{t} tier {s.tier_gib_s:.2f} vs one file {s.one_file_gib_s:.2f} ({_ratio(s.ratio)})"
             for t, s in (("warm", d.warm.sides), ("cold", d.cold.sides))]
    lines = [f"disk {d.offload_block_bytes:>8} B x {d.num_entries}, jobs of {d.job_blocks}: "
             + "  ".join(cells)]
    what = {**_EXTRA_READS, "split_file": f"one file read in {d.warm.read_threads} parts at once"}
    for name, extra in d.warm.extras.items():
        lines.append(f"  warm {what[name]} {extra.gib_s:.2f}: tier / that {extra.tier_ratio:.2f}")
    for side, reads in d.cold.device_requests.items():
        lines.append(f"  cold {side}: {reads.requests:.0f} device reads of "
                     f"{reads.mean_kib:.0f} KiB on average")
    if d.store is not None:
        lines.append(f"  store tier {d.store.tier_gib_s:.2f} vs one file "
                     f"{d.store.one_file_gib_s:.2f} ({_ratio(d.store.ratio)})")
    return lines


def _redis_lines(redis: RedisRows, job_blocks: int, repeats: int) -> list[str]:
    srv = redis.server
    lines = [(f"redis tier, GiB/s, tier vs redis-py's own pipelined SET/GET of the same "
              f"payloads (ratio tier/redis-py); Redis {srv.redis_version} at {srv.url}, "
              f"redis-py {srv.redis_py_version} "
              f"({'hiredis' if srv.hiredis else 'no hiredis'}), jobs of {job_blocks} values, "
              f"median of {repeats}")]
    for r in redis.rows:
        cells = [f"{name} tier {d.tier_gib_s:.2f} vs redis-py {d.redis_py_gib_s:.2f} "
                 f"({d.ratio:.2f})" for name, d in (("store", r.store), ("load", r.load))]
        lines.append(f"redis {r.offload_block_bytes:>8} B x {r.num_values}: " + "  ".join(cells))
    return lines
