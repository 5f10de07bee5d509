"""The table `kvport bench hybrid-pool` prints."""

from __future__ import annotations

from kvport.bench.hybrid.run import PoolResult


def format_pool(result: PoolResult) -> str:
    cfg = result.config
    lines = [f"vLLM {result.vllm_version}, {result.model}, {cfg.kv_gib} GiB of KV, requests of "
             f"{cfg.prompt_len} + {cfg.max_tokens} tokens in chunks of "
             f"{cfg.max_num_batched_tokens}",
             f"{'config':<8} {'groups':>6} {'blocks':>7} {'block':>6} {'requests held':>13} "
             f"{'check run s':>11}"]
    for r in result.rows:
        lines.append(f"{r.config:<8} {r.num_kv_groups:>6} {r.num_blocks:>7} {r.kv_block_size:>6} "
                     f"{r.max_concurrency:>13.1f} {r.busy_s:>11.1f}")
    by_name = {r.config: r for r in result.rows}
    on, off = by_name.get("hma-on"), by_name.get("hma-off")
    if on is not None and off is not None and off.max_concurrency:
        lines.append(f"hma-on vs hma-off: {on.max_concurrency / off.max_concurrency:.2f}x the "
                     f"requests of {cfg.prompt_len + cfg.max_tokens} tokens vLLM's pool holds")
    n = result.rows[0].requests if result.rows else 0
    lines.append(f"greedy outputs of {n} requests equal in both: {result.outputs_equal}")
    return "\n".join(lines)
