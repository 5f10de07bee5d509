"""What a server's /metrics says about one run: the counters' change over the run, and from it
where the prompt tokens came from (computed, vLLM's own prefix cache, the connector by tier).

Read from vLLM's Prometheus text before and after each client run, so the numbers are the
server's own and need no change to vLLM's client. Counter names are vLLM 0.32's
(`vllm:prefix_cache_*`, `vllm:external_prefix_cache_*`, `vllm:num_preemptions`) and kvport's
(`vllm:kvport_hit_tokens{tier}`, docs/vllm.md); one missing reads as 0 (no connector).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

Sample = tuple[str, tuple[tuple[str, str], ...], float]  # name, sorted labels, value

COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
            "vllm:num_preemptions_total", "vllm:kvport_hit_tokens_total",
            "vllm:kvport_queried_tokens_total", "vllm:kvport_failures_total",
            "vllm:request_success_total")


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    samples: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        name, _, rest = head.partition("{")
        samples.append((name.strip(), _labels(rest.rstrip("}")), number))
    return samples


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    """`a="1",b="x"` -> (("a", "1"), ("b", "x")); label values here hold no commas or quotes."""
    pairs = []
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if eq:
            pairs.append((key.strip(), value.strip().strip('"')))
    return tuple(sorted(pairs))


def counter_values(samples: Iterable[Sample]) -> dict[str, float]:
    """The COUNTERS as `name` or `name{label=value}` for kvport's per-tier/kind ones, summed
    over every other label (engine, model_name)."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name not in COUNTERS:
            continue
        keep = [f"{k}={v}" for k, v in labels if k in ("tier", "kind")]
        key = f"{name}{{{','.join(keep)}}}" if keep else name
        out[key] = out.get(key, 0.0) + value
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every counter of either (a counter first seen after: from 0)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted({*before, *after})}


@dataclass(frozen=True)
class HitSummary:
    """Where one run's prompt tokens came from, per the servers' counters (summed over the
    instances of a system)."""

    prompt_tokens: int  # tokens the scheduler looked up (vLLM's prefix cache queries)
    device_hit_tokens: int  # found in vLLM's own prefix cache
    connector_hit_tokens: int  # loaded by the connector (vLLM's external hits)
    tier_hit_tokens: dict[str, int]  # kvport's hits by tier (host, disk, redis)
    preemptions: int

    @property
    def computed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.device_hit_tokens - self.connector_hit_tokens)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "computed_tokens": self.computed_tokens}


def hit_summary(delta: dict[str, float]) -> HitSummary:
    tiers = {key.split("tier=", 1)[1].rstrip("}"): int(v) for key, v in delta.items()
             if key.startswith("vllm:kvport_hit_tokens_total{tier=")}
    return HitSummary(
        prompt_tokens=int(delta.get("vllm:prefix_cache_queries_total", 0)),
        device_hit_tokens=int(delta.get("vllm:prefix_cache_hits_total", 0)),
        connector_hit_tokens=int(delta.get("vllm:external_prefix_cache_hits_total", 0)),
        tier_hit_tokens=dict(sorted(tiers.items())),
        preemptions=int(delta.get("vllm:num_preemptions_total", 0)))


def sum_deltas(deltas: Iterable[dict[str, float]]) -> dict[str, float]:
    """Counters of several instances as one system's."""
    total: dict[str, float] = {}
    for delta in deltas:
        for key, value in delta.items():
            total[key] = total.get(key, 0.0) + value
    return total
