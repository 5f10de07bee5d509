"""The text table of a `kvport bench throughput` result: tokens/s per system and model, the
ratio to transformers in ( ), the machine's ceilings, and notes (systems that did not run, the
ratios to vLLM, the load other processes added)."""

from __future__ import annotations

from kvport.bench.common.table import table_lines
from kvport.bench.throughput.run import ModelResult, SystemResult, ThroughputResult


def format_throughput(result: ThroughputResult) -> str:
    cfg, machine = result.config, result.machine
    title = (f"engine throughput, tokens/s (ratio to transformers); {cfg.dtype}, "
             f"{machine.torch_threads} torch threads, {machine.cpu_model}, median of "
             f"{cfg.repeats}; decode: {cfg.prompt_len}-token prompts, "
             f"{cfg.decode_tokens} new tokens")
    names = [f"decode_b{b}" for b in cfg.batch_sizes] + ["prefill"]
    heads = [f"decode b={b}" for b in cfg.batch_sizes] + [f"prefill {cfg.prefill_len}"]
    rows = [["model", "system", "threads", *heads, "other load"]]
    notes: list[str] = []
    for model in result.models:
        for s in model.systems:
            if s.status != "ok":
                notes.append(_not_run(model, s))
                continue
            values = s.metrics()
            cells = [_cell(values.get(n), s.ratio_to_transformers.get(n)) for n in names]
            # Cores kept busy by other processes during the worst timed round of this system.
            loads = [x for x in s.other_load if x is not None]
            other = f"{max(loads):.2f}" if loads else "?"
            rows.append([model.model, s.system, str(s.threads), *cells, other])
            if s.system != "vllm" and s.ratio_to_vllm:
                notes.append(f"{model.model} {s.system} / vllm: " + ", ".join(
                    f"{h} {s.ratio_to_vllm[n]:.2f}x" for n, h in zip(names, heads)
                    if s.ratio_to_vllm.get(n) is not None))
        ceil = model.ceilings
        rows.append([model.model, "(ceiling)", str(ceil.threads),
                     *[_cell(ceil.metrics.get(n), None) for n in names], ""])
        rates = ", ".join(f"{d} {g:.0f}" for d, g in ceil.mm_gflop_s.items())
        notes.append(f"{model.model} (ceiling): decode = batch x {ceil.read_gb_s:.1f} "
                     f"GB/s read / {ceil.weight_bytes_per_step / 1e6:.0f} MB of weights "
                     f"per step; prefill = its {ceil.prefill_flops / 1e9:.0f} GFLOP at "
                     f"torch.mm's float32 rate (GFLOP/s: {rates})")
    notes.append("other load: cores busy with other processes in the worst timed round; "
                 "well above 0 means the numbers are noisy")
    return "\n".join([title, *table_lines(rows, left=2), *notes])


def _not_run(model: ModelResult, s: SystemResult) -> str:
    # A failed vLLM server's reason ends with its log tail: the JSON has all of it.
    why = (s.reason or "").strip().splitlines() or [""]
    short = why[0] if len(why) == 1 else f"{why[0]} ... {why[-1]}"
    return f"{model.model} {s.system}: {s.status}: {short}"


def _cell(value: float | None, ratio: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} ({ratio:.2f}x)" if ratio is not None else f"{value:.1f}"
