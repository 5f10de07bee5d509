"""vLLM's own serving client, `vllm bench serve` (run as `python -m kvport.vllm bench serve`),
as `kvport bench serve` runs it: one process per run, against one base URL, its result read
from the JSON file it saves (`--save-result --save-detailed`: the summary fields and, per
request, `ttfts`, `itls`, `input_lens`, `output_lens`, `errors`, in the dataset's order).

Every run of a scenario gets the same flags but the URL: the same dataset and seed (the
prefix_repetition prompts and their shuffle, the Poisson arrival times), the same request rate
and concurrency cap, greedy sampling and exactly `output_len` tokens per answer (--ignore-eos).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvport.bench.common.command import JsonObject
from kvport.bench.serve.server import server_env, server_last_error

# The client stamps each request `x-request-id: <prefix><row>`; the forwarder routes by it.
REQUEST_ID_PREFIX = "kvport-serve-"
PERCENTILES = "50,90,99"
LOG_TAIL_CHARS = 3000


class ClientFailed(RuntimeError):
    """vLLM's client exited with an error, or ran past its deadline."""


@dataclass(frozen=True)
class ClientRun:
    base_url: str
    model_dir: str
    dataset_args: tuple[str, ...]  # datasets.prefix_repetition_args / sharegpt_args
    request_rate: float
    max_concurrency: int
    seed: int
    result_path: Path
    log_path: Path


def client_argv(run: ClientRun, python: str | None = None) -> list[str]:
    """The command line of one `vllm bench serve` run."""
    return [python or sys.executable, "-m", "kvport.vllm", "bench", "serve",
            "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", run.base_url,
            "--model", run.model_dir, "--tokenizer", run.model_dir, *run.dataset_args,
            "--request-rate", repr(float(run.request_rate)),
            "--max-concurrency", str(run.max_concurrency), "--seed", str(run.seed),
            "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
            "--request-id-prefix", REQUEST_ID_PREFIX,
            "--save-result", "--save-detailed", "--result-dir", str(run.result_path.parent),
            "--result-filename", run.result_path.name]


def run_client(run: ClientRun, timeout_s: float) -> JsonObject:
    """Run vLLM's client to the end and return its saved result. Its process group is killed
    if the run ends early (deadline, Ctrl-C). ClientFailed with its log's last error if it
    fails or saves no result."""
    # one thread: the client tokenizes and waits on sockets; the cores are the server's
    env = server_env(threads=1)
    with open(run.log_path, "wb") as log:
        proc = subprocess.Popen(client_argv(run), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClientFailed(_message(run, f"ran past {timeout_s:.0f} s")) from None
    finally:
        if proc.poll() is None:  # the deadline passed, or Ctrl-C while waiting
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if code != 0 or not run.result_path.is_file():
        raise ClientFailed(_message(run, f"exited with code {code}"))
    result: JsonObject = json.loads(run.result_path.read_text())
    return result


def _message(run: ClientRun, what: str) -> str:
    try:
        log = run.log_path.read_text(errors="replace")
    except OSError:
        log = ""
    reason = server_last_error(log) or what
    return (f"vllm bench serve against {run.base_url} {what}: {reason}\n"
            f"its log ({run.log_path}) ends:\n{log[-LOG_TAIL_CHARS:]}")
