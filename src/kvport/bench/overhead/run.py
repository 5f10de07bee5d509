"""`kvport bench connector-overhead`: the run of the config's engine (kvport's in this process,
or vLLM's engine processes)."""

from __future__ import annotations

from collections.abc import Callable

from kvport.bench.overhead.config import OverheadConfig, OverheadResult


def run_overhead(cfg: OverheadConfig, log: Callable[[str], None] = print) -> OverheadResult:
    """Time every engine of `cfg.engine`'s comparison; `log` gets a line per round."""
    if cfg.engine == "vllm":
        from kvport.bench.overhead.vllm import run_vllm_overhead

        return run_vllm_overhead(cfg, log)
    from kvport.bench.overhead.kvport import run_kvport_overhead

    return run_kvport_overhead(cfg, log)
