"""Run vLLM's CPU build in this process on SmolLM2-135M (float32; or another builtin, `model`:
tiny-gemma3, a hybrid model of three KV cache groups), with or without kvport's
OffloadingConnector, for a few rounds of the same prompts (the engine's prefix cache dropped
between rounds), and print one JSON object: per round the token ids, logprobs and cached token
counts, and kvport's connector statistics. The end-to-end tests run it as a subprocess (one
vLLM engine per process).

    python run_vllm.py '{"connector": true, "disk_dir": "/tmp/kv", "rounds": 2}'
    python run_vllm.py '{"connector": true, "redis_url": "redis://127.0.0.1:6379/0"}'
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PREFIX = ("You are a helpful assistant. "
          + " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40)))
QUESTIONS = [" What is 7 squared?", " What is 17 squared?", " What is 12 squared?",
             " What is 31 squared?"]


def offloading_config(disk_dir: str | None, redis_url: str | None = None,
                      kv_role: str = "kv_both") -> dict[str, Any]:
    # A request waits for another one's promotion (inflight_wait_s): long enough here that a
    # busy CI machine never ends that wait by its bound, so the hits asserted do not depend on it.
    extra: dict[str, Any] = {"cpu_bytes_to_use": 256 << 20, "inflight_wait_s": 30.0}
    tiers: list[dict[str, Any]] = []
    if disk_dir:
        tiers.append({"type": "disk", "root_dir": disk_dir, "max_bytes": 1 << 30})
    if redis_url:
        tiers.append({"type": "redis", "url": redis_url})
    if tiers:
        extra["secondary_tiers"] = tiers
    return {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
            "kv_role": kv_role, "kv_connector_extra_config": extra,
            "kv_load_failure_policy": "recompute"}


def connector_of(llm: Any) -> Any:
    """kvport's scheduler-side connector inside an in-process vLLM engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


class LayoutWarnings(logging.Handler):
    """vLLM's warnings that mention the KV cache layout (a connector's wish it drops)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "layout" in record.getMessage():
            self.messages.append(record.getMessage())


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kvport.connectors.base import plain_data
    from kvport.model.builtin import builtin_model_dir

    kwargs: dict[str, Any] = {}
    if cfg.get("example_dir"):  # kvport's ExampleConnector instead
        kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_connector_module_path": "kvport.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"shared_storage_path": cfg["example_dir"]}}
    elif cfg.get("connector"):
        kwargs["kv_transfer_config"] = offloading_config(
            cfg.get("disk_dir"), cfg.get("redis_url"), cfg.get("kv_role", "kv_both"))
    if "enable_prefix_caching" in cfg:
        kwargs["enable_prefix_caching"] = cfg["enable_prefix_caching"]
    if cfg.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = cfg["num_gpu_blocks_override"]
    layout_warnings = LayoutWarnings()
    logging.getLogger("vllm").addHandler(layout_warnings)
    try:
        llm = LLM(model=str(builtin_model_dir(cfg.get("model", "smollm2-135m"))),
                  dtype="float32", enforce_eager=True,
                  max_model_len=cfg.get("max_model_len", 1024),
                  max_num_seqs=cfg.get("max_num_seqs", 4), seed=0, **kwargs)
    finally:
        logging.getLogger("vllm").removeHandler(layout_warnings)
    preemptions = 0
    if cfg.get("connector"):  # count the preemptions the scheduler reports to the connector
        connector = connector_of(llm)
        build = connector.build_connector_meta

        def counting_build(so: Any) -> Any:
            nonlocal preemptions
            preemptions += len(so.preempted_req_ids or ())
            return build(so)

        connector.build_connector_meta = counting_build
    params = SamplingParams(max_tokens=cfg.get("max_tokens", 8), temperature=0.0, logprobs=1,
                            ignore_eos=True)
    prompts = [PREFIX + q for q in QUESTIONS[:cfg.get("num_prompts", 3)]]
    if cfg.get("short"):  # a sentence each: no prefix shared, long decodes grow them
        prompts = [f"Prompt {i}.{q}" for i, q in enumerate(QUESTIONS[:cfg.get("num_prompts", 3)])]
    rounds = []
    for _ in range(cfg.get("rounds", 1)):
        outs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)]
                         for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
        })
        llm.reset_prefix_cache()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    result: dict[str, Any] = {
        "rounds": rounds, "preemptions": preemptions,
        "num_kv_groups": len(scheduler.kv_cache_config.kv_cache_groups),
        "prompt_lens": [len(llm.get_tokenizer().encode(p)) for p in prompts]}
    if cfg.get("connector") and not cfg.get("example_dir"):
        connector = connector_of(llm)
        result["stats"] = vars(connector.scheduler_half.stats).copy()
        result["metrics"] = plain_data(connector.scheduler_half.metrics())
        # what kvport asked, what vLLM resolved, what names kvport's disk namespace
        result["layout"] = {"asked": connector.get_required_kvcache_layout(scheduler.vllm_config),
                            "resolved": scheduler.vllm_config.cache_config.kv_cache_layout,
                            "kv_cache_config": scheduler.kv_cache_config.kv_cache_layout,
                            "spec": connector._spec.layout,
                            "warnings": layout_warnings.messages}
    llm.llm_engine.engine_core.shutdown()  # drains kvport's write-throughs
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
