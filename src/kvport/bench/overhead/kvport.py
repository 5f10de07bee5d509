"""The connector framework's own cost in kvport's engine: decode throughput with connectors that
never hit vs none.

Four engines on the same model live in one process: no connector, `OffloadingConnector` storing
every block to a host tier without ever loading (kv_producer: offloading with no hits),
`NoOpConnector`, and `NoOpConnector` with call recording on. Each round times every engine on the
same batch of prompts (rounds); reported: the median over rounds, and each engine's ratio to the
engine without a connector. Prefix caching is off, so every round computes the same work.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvport.bench.common.machine import machine_info
from kvport.bench.overhead.config import (
    NO_CONNECTOR,
    STORING,
    OverheadConfig,
    OverheadResult,
    OverheadSystem,
)
from kvport.bench.overhead.rounds import rotated_rounds


def _engines(cfg: OverheadConfig, trace_dir: Path) -> dict[str, Any]:
    from kvport import LLM

    common: dict[str, Any] = {"dtype": cfg.dtype, "enable_prefix_caching": False,
                              "max_num_seqs": max(cfg.batch, 1),
                              "max_model_len": cfg.prompt_len + cfg.decode_tokens + 16}
    noop = {"kv_connector": "NoOpConnector"}
    recorded = {"kv_connector": "NoOpConnector",
                "kv_connector_extra_config": {"record_trace": str(trace_dir / "trace.jsonl")}}
    # Stores every full 16-token block to a host tier and never loads (kv_producer): the cost
    # of offloading when nothing hits.
    offloading = {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 512 << 20,
                                                "block_size": 16}}
    return {
        NO_CONNECTOR: LLM(cfg.model, **common),
        STORING: LLM(cfg.model, block_size=16, kv_transfer_config=offloading, **common),
        "noop-connector": LLM(cfg.model, kv_transfer_config=noop, **common),
        "noop-connector+recording": LLM(cfg.model, kv_transfer_config=recorded, **common),
    }


def _timer(llm: Any, prompts: list[list[int]]) -> Callable[[int], float]:
    from kvport import SamplingParams

    def run(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return run


def run_kvport_overhead(cfg: OverheadConfig, log: Callable[[str], None]) -> OverheadResult:
    with tempfile.TemporaryDirectory(prefix="kvport-overhead-") as tmp:
        engines = _engines(cfg, Path(tmp))
        vocab = next(iter(engines.values())).engine.loaded.config.vocab_size
        rng = random.Random(cfg.seed)
        prompts = [[rng.randrange(3, min(vocab, 250)) for _ in range(cfg.prompt_len)]
                   for _ in range(cfg.batch)]
        timers = {name: _timer(llm, prompts) for name, llm in engines.items()}
        for run in timers.values():  # warm-up
            run(4)
        names = list(engines)
        rates = rotated_rounds(names, cfg.rounds, cfg.batch, cfg.decode_tokens,
                               lambda _, name: (timers[name](cfg.decode_tokens),
                                                timers[name](1)), log)
        with open(Path(tmp) / "trace.jsonl", encoding="utf-8") as trace:
            trace_lines = sum(1 for _ in trace)
        for llm in engines.values():
            llm.shutdown()
    base = statistics.median(rates[NO_CONNECTOR])
    systems = tuple(OverheadSystem(name, statistics.median(rates[name]),
                                   statistics.median(rates[name]) / base, rates[name])
                    for name in names)
    return OverheadResult(cfg, machine_info(), systems, trace_lines_written=trace_lines)
