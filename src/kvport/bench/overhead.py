"""The connector framework's own cost: decode throughput with a no-op connector vs none.

Four engines on the same model live in one process: no connector, `OffloadingConnector` storing
every block to a host tier without ever loading (kv_producer: offloading with no hits),
`NoOpConnector`, and `NoOpConnector` with call recording on. Each round times, for each engine in turn, one batch of
`batch` prompts decoding `decode_tokens` tokens and the same batch decoding 1 token; decode tokens/s
= batch * (decode_tokens - 1) / (t_long - t_short). Rounds rotate the engines' order (each engine
runs first, second and third equally often: the slot after another engine's run measured ~3 %
slower), and the median over rounds is reported, with each engine's ratio to the engine without a connector.
Prefix caching is off, so every round computes the same work.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvport.bench import machine_info


@dataclass(frozen=True)
class OverheadConfig:
    model: str = "builtin:tiny-llama"
    dtype: str = "float32"
    batch: int = 8
    prompt_len: int = 128
    decode_tokens: int = 128
    rounds: int = 7
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "decode_tokens", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens must be >= 2, got {self.decode_tokens}")


def _engines(cfg: OverheadConfig, trace_dir: Path) -> dict[str, Any]:
    from kvport import LLM

    common = dict(dtype=cfg.dtype, enable_prefix_caching=False, max_num_seqs=max(cfg.batch, 1),
                  max_model_len=cfg.prompt_len + cfg.decode_tokens + 16)
    noop = {"kv_connector": "NoOpConnector"}
    recorded = {"kv_connector": "NoOpConnector",
                "kv_connector_extra_config": {"record_trace": str(trace_dir / "trace.jsonl")}}
    # Stores every full 16-token block to a host tier and never loads (kv_producer): the cost
    # of offloading when nothing hits.
    offloading = {"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"cpu_bytes_to_use": 512 << 20,
                                                "block_size": 16}}
    return {
        "no-connector": LLM(cfg.model, **common),
        "offloading-stores-no-hits": LLM(cfg.model, block_size=16,
                                         kv_transfer_config=offloading, **common),
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


def run_overhead(cfg: OverheadConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    import random

    with tempfile.TemporaryDirectory(prefix="kvport-overhead-") as tmp:
        engines = _engines(cfg, Path(tmp))
        vocab = next(iter(engines.values())).engine.loaded.config.vocab_size
        rng = random.Random(cfg.seed)
        prompts = [[rng.randrange(3, min(vocab, 250)) for _ in range(cfg.prompt_len)]
                   for _ in range(cfg.batch)]
        timers = {name: _timer(llm, prompts) for name, llm in engines.items()}
        for run in timers.values():  # warm-up
            run(4)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        names = list(engines)
        for r in range(cfg.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # each engine in each slot
            for name in order:
                t_long = timers[name](cfg.decode_tokens)
                t_short = timers[name](1)
                rates[name].append(cfg.batch * (cfg.decode_tokens - 1) / max(t_long - t_short, 1e-9))
            log(f"round {r + 1}/{cfg.rounds}: " + ", ".join(
                f"{n} {rates[n][-1]:.0f} tok/s" for n in names))
        trace_lines = sum(1 for _ in open(Path(tmp) / "trace.jsonl", encoding="utf-8"))
        for llm in engines.values():
            llm.shutdown()
    base = statistics.median(rates["no-connector"])
    systems = []
    for name in names:
        median = statistics.median(rates[name])
        systems.append({"name": name, "decode_tokens_per_s": median, "ratio_to_no_connector": median / base,
                        "rounds_tokens_per_s": rates[name]})
    return {"benchmark": "connector-overhead", "config": cfg.__dict__, "machine": machine_info(),
            "systems": systems, "trace_lines_written": trace_lines}


def format_overhead(result: dict[str, Any]) -> str:
    lines = [f"{'system':<28}{'decode tok/s':>14}{'ratio':>9}"]
    for s in result["systems"]:
        lines.append(f"{s['name']:<28}{s['decode_tokens_per_s']:>14.1f}{s['ratio_to_no_connector']:>9.3f}")
    return "\n".join(lines)
