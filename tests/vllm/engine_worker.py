"""One process of the vLLM engine pool (engine_pool.py): reads one JSON job per stdin line,
{"kind": "trace" | "e2e" | "load_failures" | "events" | "params" | "claims", "cfg": {...}}, runs it with that module's main (a fresh
vLLM engine per job, in this process) and prints one "RESULT <json>" line per job. Importing
vLLM costs about 11 s of the 15 s an engine process takes to start: a worker pays it once for
all its jobs.

A job whose engine stopped on an error leaves that engine unshut: the worker exits after
answering it, and the pool starts a fresh worker for the next job.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import run_claims
import run_events
import run_load_failures
import run_params
import run_trace
import run_vllm

MAINS = {"trace": run_trace.main, "e2e": run_vllm.main, "load_failures": run_load_failures.main,
         "events": run_events.main, "params": run_params.main, "claims": run_claims.main}


def answer(job: dict[str, Any]) -> dict[str, Any]:
    try:
        return MAINS[job["kind"]](job["cfg"])
    except Exception as exc:  # noqa: BLE001  # reported to the test, which fails on it
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def serve() -> None:
    for line in sys.stdin:
        result = answer(json.loads(line))
        print("RESULT " + json.dumps(result), flush=True)
        if "error" in result:
            return


if __name__ == "__main__":
    serve()
