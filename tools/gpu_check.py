#!/usr/bin/env python3
"""The prepared GPU check: what only a CUDA GPU can show about kvport's GPU path, in one command.

    tools/gpu_check.sh                       # on the GPU machine: PYTHONPATH=src, $OUT
    python tools/gpu_check.py --device cpu   # the same code on CPU, before a GPU is lent

Needs torch only (and numpy, safetensors, tokenizers, xxhash: in every torch image we use); no
network. Sections, each timed and caught on its own so that one failure loses nothing else:

    copy        the torch copy path and its stream handler on the device (tools/gpu/copy_checks):
                round trips in three pool layouts and two dtypes, a store ordered after the
                forward's write, a forward ordered after a synchronous load, completion by events
    bandwidth   store and load jobs of the default job size (64 MiB) against a plain pinned
                copy_ of the same bytes and against the link's peak
    engine      kvport's engine on the device with the OffloadingConnector
                (tools/gpu/engine_checks), float32 and bfloat16: outputs with and without the
                connector, host hits after a reset, a disk round trip, TTFT with and without a
                host hit

It writes `gpu_check.json` (every figure) and `gpu_check.md` (a summary for BENCHMARKS.md) into
`--out`, and exits 0 only if every check passed. Sized to end in under 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch

from tools.gpu import copy_checks, engine_checks

TARGET_VS_COPY = 0.9  # store and load against a plain pinned copy of the same bytes


def _section(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    start = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001  one failing check must not hide the others'
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc(limit=8)}
    out["seconds"] = round(time.perf_counter() - start, 2)
    results[name] = out
    print(f"[gpu_check] {name}: {'ok' if out.get('ok') else 'FAILED'} in {out['seconds']} s",
          flush=True)


def _environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "device": str(device), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                        time.gmtime())}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   memory_gib=round(torch.cuda.get_device_properties(device).total_memory
                                    / 2 ** 30, 1))
    return env


def run(device: torch.device, out: Path, job_mib: int, skip_engine: bool,
        tiny: bool = False, peak_mib: int = 1024) -> dict[str, Any]:
    results: dict[str, Any] = {"environment": _environment(device)}
    for name, check in copy_checks.CHECKS.items():
        _section(results, f"copy.{name}", lambda check=check: check(device))  # type: ignore[misc]

    def bandwidth() -> dict[str, Any]:
        bw = copy_checks.bandwidth(device, job_mib, peak_mib=peak_mib)
        bw["ok"] = device.type != "cuda" or min(bw["store_vs_copy"],
                                                 bw["load_vs_copy"]) >= TARGET_VS_COPY
        return bw
    _section(results, "bandwidth", bandwidth)
    if not skip_engine:
        model = engine_checks.model_dir(Path(tempfile.mkdtemp(prefix="kvport-gpu-")), tiny)
        for dtype in ("float32", "bfloat16"):
            _section(results, f"engine.outputs.{dtype}",
                     lambda d=dtype: engine_checks.outputs(model, d, str(device)))
            _section(results, f"engine.disk.{dtype}",
                     lambda d=dtype: engine_checks.disk(model, d, str(device)))
        _section(results, "engine.ttft.bfloat16",
                 lambda: engine_checks.ttft(model, "bfloat16", str(device)))
    results["ok"] = all(v.get("ok", True) for k, v in results.items()
                        if isinstance(v, dict) and k != "environment")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(summary(results))
    return results


def summary(results: dict[str, Any]) -> str:
    env = results["environment"]
    verdict = "passed" if results["ok"] else "FAILED"
    where = (f"{env.get('gpu', env['device'])}, torch {env['torch']}, CUDA {env.get('cuda')}, "
             f"{env['date']}")
    lines = [f"# kvport GPU check: {verdict}", "", where, "",
             "| check | result | seconds |", "| --- | --- | ---: |"]
    for name, value in results.items():
        if isinstance(value, dict) and "seconds" in value:
            what = "ok" if value.get("ok") else f"**FAILED** {value.get('error', '')}"
            lines.append(f"| {name} | {what} | {value['seconds']} |")
    bw = results.get("bandwidth", {})
    if "gb_s" in bw:
        g = bw["gb_s"]
        head = (f"Copy bandwidth, jobs of {bw['job_bytes'] / 2 ** 20:.0f} MiB ({bw['blocks']} "
                f"blocks of {bw['block_bytes'] // 1024} KiB), GB/s:")
        store = (f"| store (D2H) | {g['store']:.1f} | {g['copy_d2h']:.1f} | {g['peak_d2h']:.1f} "
                 f"| {bw['store_vs_copy']:.2f} | {bw['store_vs_peak']:.2f} |")
        load = (f"| load (H2D) | {g['load']:.1f} | {g['copy_h2d']:.1f} | {g['peak_h2d']:.1f} "
                f"| {bw['load_vs_copy']:.2f} | {bw['load_vs_peak']:.2f} |")
        lines += ["", head, "",
                  ("| direction | kvport job | plain pinned copy_ | link peak | vs copy "
                   "| vs peak |"),
                  "| --- | ---: | ---: | ---: | ---: | ---: |", store, load]
    t = results.get("engine.ttft.bfloat16", {})
    if "computed_s" in t:
        lines += ["", (f"TTFT of a {t['tokens']}-token prompt (bfloat16): computed "
                       f"{t['computed_s'] * 1e3:.1f} ms, host hit {t['host_hit_s'] * 1e3:.1f} ms "
                       f"({t['speedup']:.2f}x)")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    parser.add_argument("--job-mib", type=int, default=64)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny-llama's shape instead of SmolLM2's (a quick try on CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device}, but torch {torch.__version__} sees no CUDA "
              f"device", file=sys.stderr)
        return 2
    results = run(device, Path(args.out), args.job_mib, args.skip_engine, args.tiny)
    print(summary(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
