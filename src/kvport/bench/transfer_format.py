"""Text tables of a `kvport bench transfer` result: GiB/s, with the ratio to the baseline of the
same rounds in ( ) (median of the per-round ratios; [min-max] where rounds disagree)."""

from __future__ import annotations

from typing import Any

from kvport.bench.transfer_common import MIB
from kvport.bench.transfer_targets import format_targets


def _ratio(d: dict[str, Any], prefix: str = "") -> str:
    r, lo, hi = (d.get(f"{prefix}ratio{s}") for s in ("", "_min", "_max"))
    return f"{r:.2f} [{lo:.2f}-{hi:.2f}]" if lo is not None else f"{r:.2f}"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.1f} MiB" if num_bytes >= MIB else f"{num_bytes >> 10} KiB"


def format_transfer(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [(f"host tier, GiB/s (ratio to a torch copy of the same bytes per job); float32, "
              f"{m['torch_threads']} torch threads, median of {cfg['repeats']} rounds")]
    for r in result["host"]:
        cells = [f"{s} store {r[s]['store_gib_s']:.2f} ({_ratio(r[s], 'store_')}) load "
                 f"{r[s]['load_gib_s']:.2f} ({_ratio(r[s], 'load_')})"
                 for s in cfg["strategies"] if s in r]
        lines.append(f"  {r['case']:<22} block {_size(r['offload_block_bytes']):>9}  job "
                     f"{r['job_blocks']:>4} x {r['num_jobs']:<4} {r['slots']:<11} copy "
                     f"{r['torch_copy_gib_s']:.2f}  " + " | ".join(cells))
    if result.get("disk"):
        lines.append("disk tier, GiB/s (ratio to one file of the same bytes, read or written on "
                     "a helper thread as the tier's jobs run): loads warm and cold (page cache "
                     "dropped), stores (first row of each size)")
    for r in result.get("disk", []):
        cells = [f"{t} tier {r[t]['tier_gib_s']:.2f} vs one file {r[t]['one_file_gib_s']:.2f} "
                 f"({_ratio(r[t])})" for t in ("warm", "cold")]
        lines.append(f"disk {r['offload_block_bytes']:>8} B x {r['num_entries']}, jobs of "
                     f"{r['job_blocks']}: " + "  ".join(cells))
        threads = r["warm"].get("read_threads", 1)
        for extra, what in (("checked_file", "one file read and hashed per entry"),
                            ("main_thread_file", "one file read on the main thread"),
                            ("split_file", f"one file read in {threads} parts at once")):
            if f"{extra}_gib_s" in r["warm"]:
                lines.append(f"  warm {what} {r['warm'][f'{extra}_gib_s']:.2f}: tier / that "
                             f"{r['warm'][f'ratio_to_{extra}']:.2f}")
        for side, d in r["cold"].get("device_requests", {}).items():
            lines.append(f"  cold {side}: {d['requests']:.0f} device reads of "
                         f"{d['mean_kib']:.0f} KiB on average")
        if r.get("store"):
            s = r["store"]
            lines.append(f"  store tier {s['tier_gib_s']:.2f} vs one file "
                         f"{s['one_file_gib_s']:.2f} ({_ratio(s)})")
    if "redis" in result:
        srv = result["redis"]["server"]
        lines.append(f"redis tier, GiB/s, tier vs redis-py's own pipelined SET/GET of the same "
                     f"payloads (ratio tier/redis-py); Redis {srv['redis_version']} at "
                     f"{srv['url']}, redis-py {srv.get('redis_py_version')} "
                     f"({'hiredis' if srv.get('hiredis') else 'no hiredis'}), jobs of "
                     f"{cfg['job_blocks']} values, median of {cfg['repeats']}")
        for r in result["redis"]["rows"]:
            cells = [f"{d} tier {r[d]['tier_gib_s']:.2f} vs redis-py {r[d]['redis_py_gib_s']:.2f} "
                     f"({r[d]['ratio']:.2f})" for d in ("store", "load")]
            lines.append(f"redis {r['offload_block_bytes']:>8} B x {r['num_values']}: "
                         + "  ".join(cells))
    lines += format_targets(result.get("targets", []))
    if result.get("other_load_cores") is not None:  # noisy numbers are marked as such
        lines.append(f"other load during the run {result['other_load_cores']:.2f} cores, of "
                     f"which hypervisor steal {result['steal_cores']:.2f}")
    return "\n".join(lines)
