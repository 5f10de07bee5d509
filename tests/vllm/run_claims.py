"""Run vLLM's CPU build in this process (SmolLM2-135M, float32) with a connector under kvport's
RecordingConnector, over a workload given step by step: before each engine step the requests of
that step are added (token-id prompts, each with its cache_salt or none), then the engine steps
until nothing is left. The trace is checked with kvport's checker; one JSON object says what the
engine raised (a connector's defect may stop it), the violations and the notes.

    cfg = {"connector": {...inner kv_transfer_config...}, "trace": PATH,
           "steps": [[{"id": "a", "prompt": [...], "salt": null}], [], [...]],
           "max_num_batched_tokens": 512, "long_prefill_token_threshold": 128}

A request may give its own "max_tokens" (else cfg's, 4) and a "lora" ("adapter-1", ...: adapters
with random weights, kvport.conformance.lora; LoRA is then enabled); "num_gpu_blocks" sizes vLLM's KV pool.
The result also lists every loaded block's distance from the KV computed for it (rule C3's
`trace_loaded` records: None where not judged).
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_STEPS = 200  # after the last arrival: a bound, not a wait


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kvport.conformance.lora import adapters_for
    from kvport.model.builtin import builtin_model_dir
    from kvport.trace.checker import analyze
    from kvport.trace.events import read_events
    from kvport.trace.loaded import LOADED_MARKER

    ktc = {"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvport.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"record_trace": cfg["trace"], "sees_all_stores": True,
                                         "connector": cfg["connector"]}}
    base = builtin_model_dir("smollm2-135m")
    loras = {r["lora"] for step in cfg["steps"] for r in step if r.get("lora")}
    lora_args, adapters = adapters_for(base, Path(cfg["trace"]).parent, len(loras))
    llm = LLM(model=str(base), dtype="float32", enforce_eager=True, **lora_args,
              max_model_len=1024, max_num_seqs=4, seed=0,
              max_num_batched_tokens=cfg.get("max_num_batched_tokens", 512),
              long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
              num_gpu_blocks_override=cfg.get("num_gpu_blocks"), kv_transfer_config=ktc)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=cfg.get("max_tokens", 4), temperature=0.0,
                            ignore_eos=True)
    result: dict[str, Any] = {}
    try:
        for arrivals in cfg["steps"]:
            for req in arrivals:
                prompt: dict[str, Any] = {"prompt_token_ids": req["prompt"]}
                if req.get("salt"):
                    prompt["cache_salt"] = req["salt"]
                engine.add_request(req["id"], prompt, SamplingParams(
                    max_tokens=req.get("max_tokens", params.max_tokens), temperature=0.0,
                    ignore_eos=True), lora_request=adapters.get(req.get("lora", "")))
            engine.step()
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished_requests():
                break
            engine.step()
    except Exception as exc:  # noqa: BLE001  # a defect under test may stop the engine
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        result["traceback"] = traceback.format_exc()[-3000:]
    check = analyze(read_events(cfg["trace"]))
    result["violations"] = [{"rule": v.rule, "step": v.step, "req_id": v.req_id,
                             "message": v.message, "pos": v.pos} for v in check.violations]
    result["notes"] = check.notes
    events = read_events(cfg["trace"])
    result["num_records"] = len(events)
    result["loaded"] = [d for e in events if e.method == LOADED_MARKER
                        for d in e.result["distances"]]
    if "error" not in result:
        engine.engine_core.shutdown()
    return result
