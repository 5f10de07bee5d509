"""`kvport bench connector-overhead --engine vllm`: decode tokens/s of vLLM with kvport's
OffloadingConnector storing every block to its host tier and never loading (kv_producer), next to
vLLM without a connector: what offloading costs a vLLM engine when nothing hits.

Each engine is a vLLM process (bench.vllm) with prefix caching off, the same pool and batch. Every
round draws fresh random prompts, the same for both engines, so the connector stores new blocks
in every run (a prompt it had stored before would be skipped, and cost nothing). Each round times
both engines (rounds) on one batch decoding `decode_tokens` tokens and another fresh batch
decoding 1 token. A run's time includes the stores that were still in flight when its last
request finished. Reported: the median over rounds per engine, and the median of the rounds'
paired ratios (the verdict): a round times both engines back to back, so its ratio cancels the
machine's slow drifts.

`events` compares kvport's storing engine with the same engine publishing KV events (vLLM's
ZMQ publisher, to a loopback endpoint nobody listens on: every event is built, encoded and
sent) and logging stats (kvport's metrics built every step): what a router's and a dashboard's
view costs when nothing hits.

`recorder` compares two other engines the same way: vLLM's ExampleConnector, and the same
connector inside kvport.vllm's RecordingConnector with recording off (no `record_trace`): what
the wrapper costs when it only forwards. `recording`: the same with recording on (every call
written, the claim records too, as `kvport conformance` records). Each engine's ExampleConnector writes to a directory of
its own, removed at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
from collections.abc import Callable

from kvport.bench.common.command import JsonObject
from kvport.bench.common.machine import machine_info
from kvport.bench.common.models import prompt_sampler, resolve_model_dir
from kvport.bench.overhead.config import (
    EVENTS,
    EXAMPLE,
    NO_CONNECTOR,
    RECORDED,
    STORING,
    WRAPPED,
    OverheadConfig,
    OverheadResult,
    OverheadSystem,
)
from kvport.bench.overhead.rounds import rotated_rounds
from kvport.bench.vllm.engine import VLLM_CPU_BLOCK_SIZE, VllmEngineProcess, threads_env


def engine_kwargs(cfg: OverheadConfig, model_dir: str, storage: str = "") -> dict[str, JsonObject]:
    """Each engine's vllm.LLM keyword arguments, by name (ExampleConnector's under `storage`)."""
    max_len = cfg.prompt_len + cfg.decode_tokens
    blocks = cfg.batch * -(-max_len // VLLM_CPU_BLOCK_SIZE) + 1  # the batch at full length, +null
    common = {"model": model_dir, "dtype": cfg.dtype, "seed": cfg.seed, "enforce_eager": True,
              "skip_tokenizer_init": True, "enable_prefix_caching": False,
              "max_model_len": max_len, "max_num_seqs": cfg.batch,
              "max_num_batched_tokens": max(2048, cfg.batch * cfg.prompt_len),
              "num_gpu_blocks_override": blocks}
    storing = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
               "kv_role": "kv_producer",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}
    if cfg.recorder or cfg.recording:
        def example(name: str) -> JsonObject:
            return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "shared_storage_path": os.path.join(storage, name)}}

        name = RECORDED if cfg.recording else WRAPPED
        extra: JsonObject = {"connector": example(name)}
        if cfg.recording:  # every call, the claim records too (kvport conformance's setting)
            extra.update(record_trace=os.path.join(storage, "trace.jsonl"), sees_all_stores=True)
        wrapped = {"kv_connector": "RecordingConnector",
                   "kv_connector_module_path": "kvport.vllm", "kv_role": "kv_both",
                   "kv_connector_extra_config": extra}
        return {EXAMPLE: {**common, "kv_transfer_config": example(EXAMPLE)},
                name: {**common, "kv_transfer_config": wrapped}}
    if cfg.events:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "kv"}
        return {STORING: {**common, "kv_transfer_config": storing},
                EVENTS: {**common, "kv_transfer_config": storing, "kv_events_config": events,
                         "disable_log_stats": False}}
    return {NO_CONNECTOR: common, STORING: {**common, "kv_transfer_config": storing}}


def free_port() -> int:
    """A loopback port nothing listens on now (the publisher connects to it; nobody answers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_vllm_overhead(cfg: OverheadConfig, log: Callable[[str], None]) -> OverheadResult:
    model_dir = resolve_model_dir(cfg.model)
    draw = prompt_sampler(model_dir, cfg.seed)
    engines: dict[str, VllmEngineProcess] = {}
    storage = (tempfile.mkdtemp(prefix="kvport-overhead-") if cfg.recorder or cfg.recording
               else "")
    _, base_name, _ = cfg.target
    try:
        for name, kwargs in engine_kwargs(cfg, str(model_dir), storage).items():
            engines[name] = VllmEngineProcess(f"config {name}: vLLM engine", kwargs,
                                              cfg.vllm_python, threads_env(cfg.threads))
        warm = draw(cfg.batch, cfg.prompt_len)
        for engine in engines.values():  # first-call costs, the connector's too
            engine.run_phase({f"warm{i}": p for i, p in enumerate(warm)}, cfg.batch, 4)
        batches: dict[int, tuple[list[list[int]], list[list[int]]]] = {}

        def time_pair(r: int, name: str) -> tuple[float, float]:
            if r not in batches:  # fresh prompts each round, the same for every engine
                batches[r] = (draw(cfg.batch, cfg.prompt_len), draw(cfg.batch, cfg.prompt_len))
            long_prompts, short_prompts = batches[r]
            engine = engines[name]
            t_long = engine.run_phase({f"r{r}l{i}": p for i, p in enumerate(long_prompts)},
                                      cfg.batch, cfg.decode_tokens)["busy_s"]
            t_short = engine.run_phase({f"r{r}s{i}": p for i, p in enumerate(short_prompts)},
                                       cfg.batch, 1)["busy_s"]
            return t_long, t_short

        rates = rotated_rounds(list(engines), cfg.rounds, cfg.batch, cfg.decode_tokens,
                               time_pair, log, digits=1)
        stored = {name: 0 for name in engines}
        for name in (STORING, EVENTS):
            if name in engines:
                host = (engines[name].metrics().get("connector") or {}).get("host") or {}
                stored[name] = int(host.get("bytes_stored") or 0)
        info = engines[base_name].info
        lines = _count_lines(os.path.join(storage, "trace.jsonl")) if cfg.recording else None
    finally:
        for engine in engines.values():
            engine.shutdown()
        if storage:
            shutil.rmtree(storage, ignore_errors=True)
    return OverheadResult(cfg, machine_info(), _systems(rates, base_name, stored),
                          trace_lines_written=lines, vllm_info=info)


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _systems(rates: dict[str, list[float]], base_name: str,
             stored: dict[str, int]) -> tuple[OverheadSystem, ...]:
    base = statistics.median(rates[base_name])
    return tuple(OverheadSystem(
        n, statistics.median(rates[n]), statistics.median(rates[n]) / base, rates[n],
        baseline=base_name,
        paired_ratio=statistics.median(a / b for a, b in zip(rates[n], rates[base_name],
                                                             strict=True)),
        bytes_stored=stored[n]) for n in rates)
