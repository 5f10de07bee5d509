"""The GPU check's engine part: kvport's engine on the device with the OffloadingConnector.

The model has SmolLM2-135M's shape (30 layers, 9 query and 3 KV heads of 64, 576 wide) with
random weights: the real checkpoint (98 MB as GGUF) cannot travel to a machine that reaches no
network, and what is checked (the KV pool and the copies) depends on the shape only.

- outputs: per dtype, greedy outputs of prompts that share a prefix, with and without the
  connector. The first pass computes everything in both engines (must be equal); after
  `reset_prefix_cache` the connector's engine loads the prefix from host memory while the plain
  engine computes it again (compared, with the first position where they part, if they do: the
  suffix-only prefill rounds differently from the full one in bfloat16), and its requests must
  report the hit in `num_cached_tokens`;
- disk: a fresh engine on the same disk directory hits what the first one stored, same output;
- ttft: one long prompt's time to first token, computed against loaded from host memory.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvport import LLM, SamplingParams
from kvport.model.builtin import TINY_DIMS, write_tiny_llama

SMOLLM2_DIMS = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192,
}
BLOCK = 16


def model_dir(root: Path, tiny: bool = False) -> Path:
    """SmolLM2's shape, or with `tiny` tiny-llama's (a quick try of this script on CPU)."""
    out = root / ("tiny" if tiny else "smollm2-shaped")
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(out, dims=TINY_DIMS if tiny else SMOLLM2_DIMS)
    return out


def _prompts(n: int, prefix: int, suffix: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (prefix,), generator=gen).tolist()
    return [shared + torch.randint(0, 256, (suffix + i,), generator=gen).tolist()
            for i in range(n)]


def _connector(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, **extra}}


def _llm(model: Path, dtype: str, device: str, connector: dict[str, Any] | None) -> LLM:
    return LLM(model=str(model), dtype=dtype, device=device, block_size=BLOCK,
               num_kv_blocks=2048, max_num_batched_tokens=4096, kv_transfer_config=connector)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> tuple[list[list[int]],
                                                                             list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return ([list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs])


def _parted_at(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None)
            if p != q else None for p, q in zip(a, b)]


def outputs(model: Path, dtype: str, device: str) -> dict[str, Any]:
    prompts = _prompts(4, 512, 40)
    plain = _llm(model, dtype, device, None)
    base_first, _ = _run(plain, prompts)
    plain.reset_prefix_cache()
    base_again, _ = _run(plain, prompts)
    plain.shutdown()
    llm = _llm(model, dtype, device, _connector({}))
    placed = {"kv_cache": str(llm.engine.runner.kv_cache.device),
              "weights": str(next(llm.engine.runner.model.parameters()).device)}
    on_device = all(torch.device(d).type == torch.device(device).type for d in placed.values())
    first, _ = _run(llm, prompts)
    llm.reset_prefix_cache()
    hit, cached = _run(llm, prompts)
    llm.shutdown()
    return {"ok": on_device and first == base_first and hit == base_again and min(cached) >= 512,
            "placed": placed,
            "first_pass_equal": first == base_first, "hit_pass_equal": hit == base_again,
            "hit_parted_at": _parted_at(hit, base_again), "num_cached_tokens": cached}


def disk(model: Path, dtype: str, device: str) -> dict[str, Any]:
    prompts = _prompts(2, 256, 20, seed=1)
    with tempfile.TemporaryDirectory() as root:
        tiers = {"secondary_tiers": [{"type": "disk", "root_dir": root, "max_bytes": 1 << 30}]}
        first = _llm(model, dtype, device, _connector(tiers))
        out1, _ = _run(first, prompts)
        first.shutdown()
        second = _llm(model, dtype, device, _connector(tiers))
        out2, cached = _run(second, prompts)
        second.shutdown()
    return {"ok": out1 == out2 and min(cached) >= 256, "equal": out1 == out2,
            "num_cached_tokens": cached}


def ttft(model: Path, dtype: str, device: str, tokens: int = 2048,
         repeats: int = 5) -> dict[str, Any]:
    """Median seconds to the first token of a `tokens`-token prompt: computed (the prefix cache
    and the connector's tier emptied first) and with the prompt's blocks in host memory."""
    prompt = _prompts(1, tokens, 0, seed=2)
    llm = _llm(model, dtype, device, _connector({}))
    _run(llm, prompt, 1)  # warm up, and store the prompt
    cold, warm = [], []
    for _ in range(repeats):
        llm.reset_prefix_cache(reset_connector=True)
        start = time.perf_counter()
        _run(llm, prompt, 1)
        cold.append(time.perf_counter() - start)
        llm.reset_prefix_cache()  # the engine's own cache only: the blocks stay in host memory
        start = time.perf_counter()
        _, cached = _run(llm, prompt, 1)
        warm.append(time.perf_counter() - start)
    llm.shutdown()
    c, w = statistics.median(cold), statistics.median(warm)
    return {"ok": cached[0] > 0, "tokens": tokens, "computed_s": c, "host_hit_s": w,
            "speedup": c / w, "num_cached_tokens": cached[0]}
