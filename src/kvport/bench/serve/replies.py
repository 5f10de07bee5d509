"""The model's own replies for the multi-turn transcripts, made before the run (datasets.py says
why): a server without a connector is started for it, and every round's prompts are sent to it
as the client will send them during the run (completions, greedy, exactly `output_len` tokens:
--temperature 0 --ignore-eos), a round at a time, up to `concurrency` at once. The server is
stopped before any measured server starts.

The same greedy request gives the same tokens on the measured servers, so a turn's prompt holds
the previous turn's answer as the server generated it. The text goes through the tokenizer once
more in the next prompt; where it does not encode back to the same tokens (BPE merges across the
boundary), the hit of the stored answer ends there, as it would behind a chat front end.
"""

from __future__ import annotations

import json
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvport.bench.serve.config import LENGTH_MARGIN_TOKENS, ServeBenchConfig
from kvport.bench.serve.datasets import SHAREGPT_MAX_PROMPT_TOKENS
from kvport.bench.serve.server import ServerProcess, ServerSpec, start_server
from kvport.bench.vllm.engine import VLLM_CPU_BLOCK_SIZE

ANSWER_TIMEOUT_S = 600.0  # one reply, queued behind the round's others on a slow machine


def reply_server_spec(cfg: ServeBenchConfig, model_dir: str) -> ServerSpec:
    """No connector; room for `concurrency` of the longest prompt vLLM's client keeps (a longer
    one fails the bench later, in datasets.check_prompt_tokens) and its answer."""
    tokens = SHAREGPT_MAX_PROMPT_TOKENS + cfg.conversation.output_len + LENGTH_MARGIN_TOKENS
    per_request = math.ceil(tokens / VLLM_CPU_BLOCK_SIZE)
    return ServerSpec("replies", model_dir, cfg.dtype, per_request * VLLM_CPU_BLOCK_SIZE,
                      cfg.concurrency * per_request, cfg.concurrency, cfg.seed, None,
                      cfg.threads)


def complete(url: str, model: str, prompt: str, max_tokens: int,
             timeout_s: float = ANSWER_TIMEOUT_S) -> str:
    """The server's greedy completion of `prompt`: exactly `max_tokens` tokens, as text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": False}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        answer = json.load(reply)
    text = answer["choices"][0]["text"]
    if not isinstance(text, str):
        raise TypeError(f"the reply server answered no text: {answer!r}")
    return text


class ModelReplies:
    """A `datasets.Answer` backed by a started server: `answer(prompts)` returns each
    prompt's completion, in order."""

    def __init__(self, server: ServerProcess, model: str, output_len: int,
                 concurrency: int) -> None:
        self.server = server
        self.model = model
        self.output_len = output_len
        self.concurrency = concurrency
        self.num_requests = 0

    def __call__(self, prompts: list[str]) -> list[str]:
        self.server.check_running()
        with ThreadPoolExecutor(self.concurrency) as pool:
            replies = list(pool.map(lambda p: complete(self.server.url, self.model, p,
                                                       self.output_len), prompts))
        self.num_requests += len(prompts)
        return replies


def start_reply_server(cfg: ServeBenchConfig, model_dir: Path, port: int,
                       logs: Path) -> ServerProcess:
    """The reply server, started and ready (ServerFailed if it is not in time)."""
    server = start_server(reply_server_spec(cfg, str(model_dir)), port, logs)
    try:
        server.wait_ready(cfg.start_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server

