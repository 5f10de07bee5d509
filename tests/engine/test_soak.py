"""A long-running engine keeps counts, not histories: after warm-up, the engine's own structures
(everything reachable from the LLM object but tensors and code) stay flat over thousands more
requests with prefix hits, pool evictions and offloading to host and disk."""

from __future__ import annotations

import gc
import sys
import types
from pathlib import Path

import torch

from kvport import LLM, SamplingParams

NUM_WARMUP = 2_000
NUM_MEASURED = 8_000
BATCH = 250
MAX_GROWTH_BYTES = 64 << 10  # one leaked hash per request would be ~0.5 MiB
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.MethodType, types.CodeType, torch.Tensor, torch.nn.Module)


def prompts(start: int, n: int) -> list[list[int]]:
    """Prompts of 9-12 tokens; a prefix shared by every 8th one, so hits and misses mix."""
    return [[3 + (i // 8) % 200, 7, 11, *[(i * 31 + j) % 250 + 3 for j in range(6 + i % 4)]]
            for i in range(start, start + n)]


def reachable_bytes(root: object) -> tuple[int, int]:
    """(objects, bytes) reachable from `root`, not counting code, modules, classes and tensors
    (their sizes do not depend on how many requests ran)."""
    seen: set[int] = set()
    todo = [root]
    total = 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _NOT_STATE):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return len(seen), total


def test_engine_structures_stay_flat_over_10000_requests(tmp_path: Path) -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, num_kv_blocks=64, max_model_len=32,
              max_num_seqs=64, kv_transfer_config={
                  "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
                      "cpu_bytes_to_use": 4 << 20, "block_size": 4,
                      "secondary_tiers": [{"type": "disk", "root_dir": str(tmp_path),
                                           "max_bytes": 8 << 20}]}})
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def run(start: int, n: int) -> None:
        for first in range(start, start + n, BATCH):
            outs = llm.generate(prompts(first, BATCH), params, use_tqdm=False)
            assert all(o.error is None for o in outs)
            llm.take_kv_events()  # a reader drains events, as a router would

    run(0, NUM_WARMUP)
    gc.collect()
    objects_before, bytes_before = reachable_bytes(llm)
    run(NUM_WARMUP, NUM_MEASURED)
    while llm.engine.has_pending_work():  # write-throughs still in flight
        llm.engine.step()
    gc.collect()
    objects_after, bytes_after = reachable_bytes(llm)
    assert bytes_after - bytes_before < MAX_GROWTH_BYTES, (
        f"engine structures grew from {objects_before} objects / {bytes_before} bytes to "
        f"{objects_after} / {bytes_after} over {NUM_MEASURED} requests")
    metrics = llm.get_metrics()
    assert metrics["prefix_cache"]["num_hit_tokens"] > 0  # hits and evictions really happened
    assert metrics["connector"]["host"]["evictions"] > 0
    llm.engine.check_no_leaks()
    llm.shutdown()
