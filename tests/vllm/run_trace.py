"""Run vLLM's CPU build in this process on SmolLM2-135M (float32; or another builtin, `model`)
with a given kv_transfer_config (or none), over a workload of token-id prompts for a few rounds
(vLLM's prefix cache dropped between rounds), and print one JSON object: per round the token
ids and logprobs, the preemptions vLLM's scheduler reported, and what the test asks to know of
the engine. The trace tests run it as a subprocess (one vLLM engine per process). Its directory
is on sys.path, so test connectors in trace_connectors.py load with kv_connector_module_path
"trace_connectors".

    python run_trace.py '{"kv_transfer_config": {...}, "prompts": [[...], ...], "rounds": 2}'
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kvport.model.builtin import builtin_model_dir

    kwargs: dict[str, Any] = dict(cfg.get("llm_kwargs") or {})
    if cfg.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = cfg["kv_transfer_config"]
    llm = LLM(model=str(builtin_model_dir(cfg.get("model", "smollm2-135m"))), dtype="float32",
              enforce_eager=True, max_model_len=cfg.get("max_model_len", 1024),
              max_num_seqs=cfg.get("max_num_seqs", 4), seed=0,
              max_num_batched_tokens=cfg.get("max_num_batched_tokens", 4096), **kwargs)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preemptions: list[int] = []  # per schedule() call, requests it preempted
    schedule = scheduler.schedule

    def counting_schedule(*args: Any, **kw: Any) -> Any:
        out = schedule(*args, **kw)
        preemptions.append(len(out.preempted_req_ids or ()))
        return out

    scheduler.schedule = counting_schedule
    params = SamplingParams(max_tokens=cfg.get("max_tokens", 8), temperature=0.0, logprobs=1,
                            ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    result: dict[str, Any] = {
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "connector": type(scheduler.connector).__name__ if scheduler.connector else None,
        "num_kv_groups": len(scheduler.kv_cache_config.kv_cache_groups),
        "rounds": []}
    try:
        for _ in range(cfg.get("rounds", 1)):
            if cfg.get("one_at_a_time"):  # each prompt its own generate(): nothing waits
                outs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
            else:
                outs = llm.generate(prompts, params, use_tqdm=False)
            result["rounds"].append({
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                             o.outputs[0].token_ids)]
                             for o in outs],
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
            })
            llm.reset_prefix_cache()
    except Exception as exc:  # noqa: BLE001  # a defect under test may stop the engine
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result["preemptions"] = sum(preemptions)
    if cfg.get("trace"):
        result["trace"] = cfg["trace"]
    result["preempted_steps"] = [step for step, n in enumerate(preemptions) if n]
    result["steps"] = len(preemptions)
    if "error" not in result:
        llm.llm_engine.engine_core.shutdown()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
