"""The GPU check's copy-path part: the torch copy path and its stream handler on a device pool.

Correctness (each returns a dict with "ok" and what it saw):
- round_trips: stores and loads through HostTier + StreamHandler on a pool in each of vLLM's
  layouts (one layered view, one tensor per layer, block-outermost), bytes equal to a reference
  computed on the host, the host buffer pinned;
- store_waits_for_the_forward: a store submitted right after the compute stream's write into its
  block (queued behind a long kernel) reads what the write left (the handler's wait_stream);
- forward_waits_for_a_sync_load: a kernel enqueued on the compute stream right after a
  synchronous load's submit reads the loaded bytes, with no CPU wait (its wait_event);
- completion_by_events: a large store is not reported before its event completes, and is after.

Bandwidth (`bandwidth`): store and load jobs of `job_mib` against a plain pinned copy_ of the
same bytes from a contiguous device buffer, and against the link's peak (the best plain pinned
copy of 1 GiB by default), both directions; medians of `repeats` runs.

Runs on CPU too (`device="cpu"`): the same code with immediate completion, which is how it is
tried before a GPU is lent.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host.engine_pool import EnginePool
from kvport.connectors.offloading.tiers.host.tier import HostTier
from kvport.connectors.offloading.worker.streams import StreamHandler, queue_for
from kvport.connectors.offloading.worker.wiring import load_unless_late

# SmolLM2-135M's KV geometry: 30 layers, 3 KV heads of 64; pages of 16-token blocks
LAYERS, HEADS, HEAD_DIM = 30, 3, 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pool(layout: str, blocks: int, tokens: int, dtype: torch.dtype,
          device: torch.device) -> tuple[EnginePool, list[torch.Tensor]]:
    """A pool of random KV in one of the layouts, with its per-layer views `[B, H, N, 2D]`."""
    shape = (blocks, HEADS, tokens, 2 * HEAD_DIM)
    if layout == "per-layer":
        layers = [torch.randn(shape, device=device).to(dtype) for _ in range(LAYERS)]
    elif layout == "layer-major":
        storage = torch.randn((LAYERS, *shape), device=device).to(dtype)
        layers = [storage[i] for i in range(LAYERS)]
    elif layout == "block-major":  # BLHNC: each block one run across layers
        storage = torch.randn((blocks, LAYERS, *shape[1:]), device=device).to(dtype)
        layers = [storage[:, i] for i in range(LAYERS)]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return EnginePool.from_pages(layers), layers


def _tier(pool: EnginePool, slots: int) -> tuple[HostTier, StreamHandler, StreamHandler]:
    # the torch path on either device ("auto" is it on a GPU, with a pinned buffer)
    host = HostTier.for_pool(pool, slots, 1, strategy="torch")
    store = StreamHandler(host.store, queue_for(pool.device), "engine-host")
    load = StreamHandler(lambda s, d: load_unless_late(host, s, d), queue_for(pool.device),
                         "host-engine")
    return host, store, load


def round_trips(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    seen: dict[str, Any] = {"ok": True}
    for layout in ("layer-major", "per-layer", "block-major"):
        pool, layers = _pool(layout, 24, 16, dtype, device)
        host, store, load = _tier(pool, 8)
        before = [t.cpu() for t in layers]
        src, slots, dst = [3, 17, 4, 5, 22], [0, 1, 2, 6, 7], [9, 1, 2, 12, 13]
        store.submit("s", EngineBlocks(src), HostBlocks(slots))
        store.wait(["s"])
        stored_ok = all(r.success for r in store.get_finished())
        load.submit("l", HostBlocks(slots), EngineBlocks(dst))
        load.wait(["l"])
        loaded_ok = all(r.success for r in load.get_finished())
        after = [t.cpu() for t in layers]
        moved = all(torch.equal(a[d].view(torch.uint8), b[s].view(torch.uint8))
                    for a, b in zip(after, before) for s, d in zip(src, dst))
        kept = [i for i in range(24) if i not in dst]
        untouched = all(torch.equal(a[kept], b[kept]) for a, b in zip(after, before))
        pinned = device.type != "cuda" or host.buffer.is_pinned()
        ok = stored_ok and loaded_ok and moved and untouched and pinned
        seen[layout] = {"segments": len(pool.segments), "layered": pool.layered is not None,
                        "strategy": host.strategy, "pinned": pinned, "ok": ok}
        seen["ok"] = seen["ok"] and ok
    return seen


def _busy(device: torch.device) -> None:
    """Keep the compute stream busy for a while (milliseconds on a GPU)."""
    if device.type == "cuda":
        a = torch.randn((4096, 4096), device=device)
        for _ in range(20):
            a = a @ a
            a = a / a.norm()


def store_waits_for_the_forward(device: torch.device) -> dict[str, Any]:
    pool, layers = _pool("layer-major", 8, 16, torch.float32, device)
    host, store, _ = _tier(pool, 2)
    _busy(device)  # the "forward" runs long, then writes block 5
    for t in layers:
        t[5].fill_(7.0)
    store.submit("s", EngineBlocks([5]), HostBlocks([1]))  # at once: the CPU does not wait
    store.wait(["s"])
    store.get_finished()
    slot = host.slot(1).view(torch.float32)
    return {"ok": bool((slot == 7.0).all()), "values": sorted(set(slot.unique().tolist()))[:4]}


def forward_waits_for_a_sync_load(device: torch.device) -> dict[str, Any]:
    pool, layers = _pool("layer-major", 8, 16, torch.float32, device)
    host, _, load = _tier(pool, 2)
    host.slot(0).view(torch.float32).fill_(3.0)
    for t in layers:
        t[2].zero_()
    _sync(device)
    load.submit("l", HostBlocks([0]), EngineBlocks([2], deadline=time.monotonic() + 60))
    total = torch.stack([t[2].sum() for t in layers]).sum()  # on the compute stream, no CPU wait
    expected = 3.0 * layers[0][2].numel() * LAYERS
    got = float(total.item())
    load.wait(["l"])
    load.get_finished()
    return {"ok": got == expected, "sum": got, "expected": expected}


def completion_by_events(device: torch.device) -> dict[str, Any]:
    n = 256 if device.type == "cuda" else 16  # 90 MiB: still copying when first asked
    pool, _ = _pool("layer-major", n, 16, torch.float32, device)
    _host, store, _ = _tier(pool, n)
    _busy(device)
    store.submit("big", EngineBlocks(list(range(n))), HostBlocks(list(range(n))))
    early = [r.job_id for r in store.get_finished()]
    store.wait(["big"])
    late = [r.job_id for r in store.get_finished()]
    # on CPU the copy ran in submit: reported at once
    ok = late == ["big"] and early == [] if device.type == "cuda" else early == ["big"]
    return {"ok": ok, "reported_at_once": early, "reported_after_wait": late}


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm: staging buffers, the caching allocator
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(device: torch.device, job_mib: int = 64, repeats: int = 9,
              tokens: int = 16, peak_mib: int = 1024) -> dict[str, Any]:
    """GB/s of store and load jobs of `job_mib` (vLLM-like layer-major bf16 pool), a plain pinned
    copy of the same bytes, and the link's peak (a copy of `peak_mib`), both directions."""
    probe, _ = _pool("layer-major", 1, tokens, torch.bfloat16, device)
    blocks = max(1, (job_mib << 20) // probe.block_bytes)
    pool, _ = _pool("layer-major", 2 * blocks, tokens, torch.bfloat16, device)
    _host, store, load = _tier(pool, blocks)
    ids = torch.randperm(2 * blocks).tolist()[:blocks]  # a fragmented pool's blocks
    slots = list(range(blocks))
    num_bytes = blocks * pool.block_bytes

    def run(handler: StreamHandler, src: Any, dst: Any) -> None:
        handler.submit("j", src, dst)
        handler.wait(["j"])
        handler.get_finished()

    pin = device.type == "cuda"
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    big_dev = torch.empty(peak_mib << 20, dtype=torch.uint8, device=device)
    big_host = torch.empty(peak_mib << 20, dtype=torch.uint8, pin_memory=pin)
    sec = {
        "store": _median_seconds(lambda: run(store, EngineBlocks(ids), HostBlocks(slots)),
                                 device, repeats),
        "load": _median_seconds(lambda: run(load, HostBlocks(slots), EngineBlocks(ids)),
                                device, repeats),
        "copy_d2h": _median_seconds(lambda: pinned.copy_(dev, non_blocking=True), device,
                                    repeats),
        "copy_h2d": _median_seconds(lambda: dev.copy_(pinned, non_blocking=True), device,
                                    repeats),
        "peak_d2h": _median_seconds(lambda: big_host.copy_(big_dev, non_blocking=True), device,
                                    max(3, repeats // 3)),
        "peak_h2d": _median_seconds(lambda: big_dev.copy_(big_host, non_blocking=True), device,
                                    max(3, repeats // 3)),
    }
    gbs = {k: (num_bytes if not k.startswith("peak") else peak_mib << 20) / v / 1e9
           for k, v in sec.items()}
    return {"job_bytes": num_bytes, "blocks": blocks, "block_bytes": pool.block_bytes,
            "peak_bytes": peak_mib << 20,
            "gb_s": gbs,
            "store_vs_copy": gbs["store"] / gbs["copy_d2h"],
            "load_vs_copy": gbs["load"] / gbs["copy_h2d"],
            "store_vs_peak": gbs["store"] / gbs["peak_d2h"],
            "load_vs_peak": gbs["load"] / gbs["peak_h2d"]}


CHECKS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "round_trips_float32": lambda d: round_trips(d, torch.float32),
    "round_trips_bfloat16": lambda d: round_trips(d, torch.bfloat16),
    "store_waits_for_the_forward": store_waits_for_the_forward,
    "forward_waits_for_a_sync_load": forward_waits_for_a_sync_load,
    "completion_by_events": completion_by_events,
}
