"""Real vLLM (the CPU build, SmolLM2-135M in float32, or another builtin (`model`), in this
process) with kvport's
OffloadingConnector (host tier) whose host -> engine copies fail at random blocks
(load_faults.py), for one kv_load_failure_policy and one kind of load (sync or async); prints
one JSON object. Run by the engine pool (engine_worker.py, kind "load_failures").

    round 1  the prompts computed (nothing stored yet): the reference
    round 2  the same prompts, every one a host hit, the loads of `faulty` failing at random
             blocks (spoiled: zeroed), through LLMEngine's own request ids; with `abort` (async
             loads), the first faulty request is aborted while its failing copy runs
    round 3  no faults: the engine serves on, from host memory or recomputing
    round 4  the control: one prompt's load spoiled but reported loaded (silent corruption);
             its logprobs must differ from the reference, or rounds 2-3 could not tell a
             spoiled block from a recomputed one
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from load_faults import FaultyLoads  # noqa: E402
from run_vllm import connector_of  # noqa: E402

NUM_PROMPTS = 3
FAULTY = ("r1", "r2")
FACTS = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(30))


def prompts() -> list[str]:
    """Prompts of 3-4 of vLLM's 128-token CPU blocks that share no block."""
    return [f"Request {w}. Answer in words. " + FACTS + f" What is {7 + i} squared?"
            for i, w in enumerate(("one", "two", "three"))]


def _round(out: list[Any]) -> dict[str, Any]:
    return {"tokens": [list(o.outputs[0].token_ids) for o in out],
            "finish": [str(o.outputs[0].finish_reason) for o in out],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs or [],
                                                         o.outputs[0].token_ids)]
                         for o in out]}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvport.model.builtin import builtin_model_dir

    policy, sync = cfg["policy"], cfg["sync"]
    ktc = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": policy,
           "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20,
                                         "sync_host_loads": sync}}
    llm = LLM(model=str(builtin_model_dir(cfg.get("model", "smollm2-135m"))), dtype="float32",
              enforce_eager=True, max_model_len=cfg.get("max_model_len", 1024),
              max_num_seqs=NUM_PROMPTS, seed=0, kv_transfer_config=ktc)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    texts = prompts()
    reference = _round(llm.generate(texts, params, use_tqdm=False))
    llm.reset_prefix_cache()

    worker = get_kv_transfer_group().worker_half  # in this process: UniProcExecutor

    def spoil(block: int) -> None:
        for seg in worker.host._pool.segments:
            seg[block].zero_()

    # An abort lands while the failing async copies run: they wait for it (`hold`).
    hold = threading.Event() if cfg.get("abort") else None
    faults = FaultyLoads(worker, set(FAULTY), random.Random(cfg.get("seed", 0)), spoil,
                         hold).install()
    engine = llm.llm_engine
    names = [f"r{i}" for i in range(NUM_PROMPTS)]
    for name, text in zip(names, texts):
        engine.add_request(name, text, params)
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if hold is not None and steps == 1:
            engine.abort_request([FAULTY[0]])
            hold.set()
        assert steps < 500, "round 2 did not end"
    faults.faulty.clear()
    second = {n: {"tokens": list(done[n].outputs[0].token_ids),
                  "finish": str(done[n].outputs[0].finish_reason)}
              for n in names if n in done}
    third = _round(llm.generate(texts, params, use_tqdm=False))
    llm.reset_prefix_cache()
    control_faults = FaultyLoads(worker, {"control"}, random.Random(1), spoil, report=False)
    control_faults.install()
    engine.add_request("control", texts[0], params)
    control = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            control = o if o.finished else control
    assert control is not None and control_faults.failed_requests == {"control"}
    connector = connector_of(llm)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    connector.scheduler_half.check_no_leaks()
    pool = scheduler.kv_cache_manager.block_pool
    result = {
        "reference": reference, "second": second, "third": third,
        "control": _round([control]),
        "prompt_tokens": [len(o.prompt_token_ids or []) for o in [control]],
        "failed_requests": sorted(faults.failed_requests),
        "num_failed_blocks": faults.num_failed_blocks,
        "stats": vars(connector.scheduler_half.stats).copy(),
        "num_kv_groups": len(scheduler.kv_cache_config.kv_cache_groups),
        "leaks": {"requests": len(scheduler.requests),
                  "referenced_blocks": sum(b.ref_cnt > 0 for b in pool.blocks),
                  "worker_loads": worker.num_in_flight},
    }
    llm.llm_engine.engine_core.shutdown()
    return result
