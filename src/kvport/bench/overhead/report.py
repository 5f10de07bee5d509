"""The text table of a `kvport bench connector-overhead` result; inside vLLM also the paired
ratio, the bytes stored and the verdict on the target."""

from __future__ import annotations

from kvport.bench.overhead.config import OverheadResult


def format_overhead(result: OverheadResult) -> str:
    if result.config.engine == "vllm":
        return _format_vllm(result)
    lines = [f"{'system':<28}{'decode tok/s':>14}{'ratio':>9}"]
    for s in result.systems:
        lines.append(f"{s.name:<28}{s.decode_tokens_per_s:>14.1f}{s.ratio_to_no_connector:>9.3f}")
    return "\n".join(lines)


def _format_vllm(result: OverheadResult) -> str:
    cfg = result.config
    target, base_name, goal = cfg.target
    if cfg.recorder:
        what = ("vLLM's ExampleConnector in kvport.vllm's RecordingConnector with recording off "
                "vs unwrapped")
    elif cfg.recording:
        what = ("vLLM's ExampleConnector in kvport.vllm's RecordingConnector writing its trace "
                "vs unwrapped")
    elif cfg.events:
        what = "kvport storing with KV events (ZMQ) and stats on vs off"
    else:
        what = "kvport storing every block and never loading vs no connector"
    version = (result.vllm_info or {}).get("vllm_version")
    lines = [f"vLLM {version}, {cfg.model}: decode tokens/s, {what}",
             f"{'system':<34}{'decode tok/s':>14}{'ratio':>9}{'paired':>9}{'MiB stored':>12}"]
    for s in result.systems:
        lines.append(f"{s.name:<34}{s.decode_tokens_per_s:>14.1f}"
                     f"{s.ratio_to_no_connector:>9.3f}{s.paired_ratio or 0.0:>9.3f}"
                     f"{(s.bytes_stored or 0) / (1 << 20):>12.0f}")
    lines.append(f"ratio: of the medians over rounds, to {base_name}; paired: the median of each "
                 f"round's ratio")
    ratio = result.system(target).paired_ratio or 0.0
    lines.append(f"target {target} decode tokens/s vs {base_name} (paired): "
                 f"{ratio:.3f}x >= {goal:.3f}x: {'met' if ratio >= goal else 'NOT met'}")
    if result.trace_lines_written is not None:
        lines.append(f"trace lines written: {result.trace_lines_written}")
    return "\n".join(lines)
