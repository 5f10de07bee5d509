"""A finding written out: the shrunk workload as a script that reproduces it on its own.

The script needs vLLM's CPU build and kvport (the RecordingConnector and the trace checker), no
Hypothesis and nothing of the run that found it: the connector's config, the engine shape and
every prompt's token ids are in it. It plays the workload into a fresh engine the way the
driver does (driver.py), checks the trace and exits 1 when the rule is broken again (or the
engine stops), 0 when not. Beside it: the workload as JSON and the finding's trace.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvport.conformance.workload import EngineShape, Workload
from kvport.trace.events import encode_line

STORE = "{store}"  # where the connector's storage goes; the script fills in a fresh directory

_SCRIPT = '''#!/usr/bin/env python
"""{title}

Found by `kvport conformance` ({found}); the workload, shrunk:
    {summary}

    python {name} [MODEL_DIR]      (default: kvport's builtin SmolLM2-135M)

Needs vLLM's CPU build and kvport. Exit status 1: {key} again; 0: not reproduced.
"""

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# "{store}" becomes a fresh, empty directory; "{trace}" the trace (recorded children)
CONNECTOR = json.loads({connector!r})
SEES_ALL_STORES = {sees_all_stores!r}  # the connector's store starts empty: claims are judged
SHAPE = json.loads({shape!r})
STEPS = json.loads({steps!r})
EXPECTED = {key!r}


def main() -> int:
    from vllm import LLM, SamplingParams

    from kvport.conformance.lora import adapters_for
    from kvport.trace.checker import analyze
    from kvport.trace.events import read_events

    work = tempfile.mkdtemp(prefix="kvport-repro-")
    trace = os.path.join(work, "trace.jsonl")
    inner = json.loads(json.dumps(CONNECTOR).replace("{store}", os.path.join(work, "store"))
                       .replace("{trace}", trace))
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from kvport.model.builtin import builtin_model_dir
        model = str(builtin_model_dir("smollm2-135m"))
    # LoRA adapters with random weights, the same ones the run used (seeded)
    lora_args, adapters = adapters_for(Path(model), Path(work), SHAPE.get("max_loras", 0))
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, max_model_len=SHAPE["max_model_len"],
              max_num_seqs=SHAPE["max_num_seqs"],
              max_num_batched_tokens=SHAPE["max_num_batched_tokens"],
              long_prefill_token_threshold=SHAPE["long_prefill_token_threshold"],
              num_gpu_blocks_override=SHAPE["num_gpu_blocks"],
              kv_transfer_config={{
                  "kv_connector": "RecordingConnector", "kv_connector_module_path": "kvport.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {{"record_trace": trace, "connector": inner,
                                                "sees_all_stores": SEES_ALL_STORES}}}},
              **lora_args)
    engine = llm.llm_engine
    error = None
    try:
        for step in STEPS:
            if step["reset"]:
                # vLLM raises on preempting all when blocks stay held (an async load, a send)
                sched = engine.engine_core.engine_core.scheduler
                running = {{r.request_id for r in sched.running}}
                can = all(rid in running or req.status.name == "WAITING"
                          for rid, req in sched.requests.items())
                llm.reset_prefix_cache(reset_running_requests=step["reset"] == "running" and can)
            if step["aborts"]:
                engine.abort_request(step["aborts"])
            for a in step["arrivals"]:
                prompt = {{"prompt_token_ids": a["prompt"]}}
                if a["cache_salt"]:
                    prompt["cache_salt"] = a["cache_salt"]
                engine.add_request(a["req_id"], prompt, SamplingParams(
                    max_tokens=a["max_tokens"], temperature=0.0, ignore_eos=True),
                    lora_request=adapters.get(a.get("lora") or ""))
            engine.step()
        for _ in range(400):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        else:
            error = "hang: requests still in the engine 400 steps after the last"
    except Exception:  # the connector under test may stop the engine
        error = traceback.format_exc()
    check = analyze(read_events(trace))
    for v in check.violations:
        print(v)
    if error:
        print("the engine stopped:", error.strip().splitlines()[-1])
    print(f"trace: {{trace}} (kvport trace check {{trace}})")
    rules = {{v.rule for v in check.violations}}
    again = EXPECTED in rules or (EXPECTED in ("crash", "hang") and error is not None)
    print(f"{{EXPECTED}}: " + ("reproduced" if again else "not reproduced"))
    return 1 if again else 0


if __name__ == "__main__":
    sys.exit(main())
'''


def write_finding(out_dir: Path, *, key: str, title: str, found: str, connector: dict[str, Any],
                  sees_all_stores: bool, shape: EngineShape, workload: Workload,
                  events: list[dict[str, Any]]) -> Path:
    """Write repro.py, workload.json and trace.jsonl into `out_dir`; the script's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = workload.to_json()
    script = out_dir / "repro.py"
    script.write_text(_SCRIPT.format(
        title=title, found=found, summary=workload.summary(), name=script.name,
        connector=json.dumps(connector), sees_all_stores=sees_all_stores,
        shape=json.dumps(asdict(shape)), steps=json.dumps(steps, separators=(",", ":")),
        key=key, store=STORE, trace="{trace}"), encoding="utf-8")
    script.chmod(0o755)
    (out_dir / "workload.json").write_text(json.dumps(
        {"shape": asdict(shape), "steps": steps}, separators=(",", ":")), encoding="utf-8")
    (out_dir / "trace.jsonl").write_bytes(b"".join(encode_line(e) for e in events))
    return script
