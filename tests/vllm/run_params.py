"""Per-request kv_transfer_params in vLLM with kvport's OffloadingConnector (a job of the engine
pool, kind "params"): SmolLM2 with a host tier and kvport's admission check
(kvport.vllm.params.KVTransferParamsCheck). Each case runs one prompt after a reset of vLLM's own
prefix cache, so its cached tokens are the connector's; the answer: per case the cached tokens
and output, and the error a bad value raised, then a good request's output (the engine lives).
"""

from __future__ import annotations

from typing import Any

from run_vllm import PREFIX, QUESTIONS, connector_of, offloading_config

CASES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "max_load_256": {"max_load_tokens": 256},
    "max_load_0": {"max_load_tokens": 0},
    "load_from_storage": {"kv_load_tiers": [{"medium": "STORAGE"}]},  # no such tier: a miss
    "load_from_cpu": {"kv_load_tiers": [{"medium": "CPU", "locality": "LOCAL"}]},
}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    from kvport.model.builtin import builtin_model_dir
    from kvport.vllm.params import KVTransferParamsCheck

    llm = LLM(model=str(builtin_model_dir("smollm2-135m")), dtype="float32", enforce_eager=True,
              max_model_len=1024, max_num_seqs=4, seed=0,
              kv_transfer_config=offloading_config(None),
              logits_processors=[KVTransferParamsCheck])

    def params(kv: dict[str, Any] | None) -> Any:
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                              extra_args=None if kv is None else {"kv_transfer_params": kv})

    prompt = PREFIX + QUESTIONS[0]
    stored = llm.generate([prompt], params({"max_offload_tokens": 384}), use_tqdm=False)[0]
    out: dict[str, Any] = {"stored": list(stored.outputs[0].token_ids), "cases": {}}
    for name, kv in CASES.items():
        assert llm.reset_prefix_cache()
        o = llm.generate([prompt], params(kv), use_tqdm=False)[0]
        out["cases"][name] = {"cached": o.num_cached_tokens, "tokens": list(o.outputs[0].token_ids)}
    try:
        llm.generate([prompt], params({"max_load_tokens": -5}), use_tqdm=False)
    except VLLMValidationError as exc:  # what the OpenAI server answers with a 400
        out["refused"] = str(exc)
    after = llm.generate([prompt], params(None), use_tqdm=False)[0]
    out["after_error"] = list(after.outputs[0].token_ids)
    half = connector_of(llm).inner.scheduler_half
    out["num_bad_transfer_params"] = half.stats.num_bad_transfer_params
    out["num_limited_hits"] = half.stats.num_limited_hits
    llm.llm_engine.engine_core.shutdown()
    return out
