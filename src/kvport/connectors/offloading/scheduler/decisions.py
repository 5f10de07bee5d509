"""What the scheduler half decided, for operators: where each admitted prompt's tokens came from,
how each store to the host tier ended, and the distributions behind them (lookup latency per
tier, transfer sizes), which a counter cannot show.

    DecisionCounters   cumulative counters (exported in metrics.DecisionMetrics)
    Observations       single measurements (seconds, bytes, blocks) kept until a reader takes
                       them (kvport.vllm turns them into Prometheus histograms); nothing is kept
                       before the first take (kvport's engine never takes them), and at most
                       MAX_OBSERVATIONS per name between two takes
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Measurements kept per name between two takes; older ones are dropped (counted).
MAX_OBSERVATIONS = 4096

LOOKUP_CALL = "lookup_call_seconds"  # one get_num_new_matched_tokens
STORE_BYTES = "store_bytes"  # one store's ENGINE -> HOST copy
LOAD_BYTES = "load_bytes"  # one load's HOST -> ENGINE copy
ALLOCATION_BLOCKS = "allocation_blocks"  # blocks one prepare_store call asked for


def lookup_seconds(medium: str) -> str:
    """The name of one tier's lookup latency (HOST, DISK, REDIS)."""
    return f"lookup_seconds.{medium.lower()}"


@dataclass
class DecisionCounters:
    # Prompt tokens of admitted requests, by where their KV came from.
    prompt_tokens_device: int = 0  # the engine's own prefix cache
    prompt_tokens_host: int = 0
    prompt_tokens_disk: int = 0
    prompt_tokens_redis: int = 0
    prompt_tokens_computed: int = 0
    # Host-tier store outcomes, in blocks offered: stored and failed are the manager's.
    host_present_blocks: int = 0  # held already (or being written): nothing to copy
    host_refused_blocks: int = 0  # no room: offered again next step

    def count_prompt(self, num_prompt: int, num_local: int, loaded: dict[str, int]) -> None:
        """A request's first admission: its prompt's tokens from the engine's own hit, those
        the connector loads (`loaded`: per tier, HOST, DISK, REDIS), the rest computed."""
        device = min(num_local, num_prompt)
        self.prompt_tokens_device += device
        self.prompt_tokens_host += loaded.get("HOST", 0)
        self.prompt_tokens_disk += loaded.get("DISK", 0)
        self.prompt_tokens_redis += loaded.get("REDIS", 0)
        self.prompt_tokens_computed += max(0, num_prompt - device - sum(loaded.values()))


class Observations:
    def __init__(self, max_per_name: int = MAX_OBSERVATIONS) -> None:
        self._max = max_per_name
        self._values: dict[str, deque[float]] = {}
        self.num_dropped = 0
        self.read = False  # a reader has taken them once: from then on they are kept

    def add(self, name: str, value: float) -> None:
        if not self.read:
            return
        values = self._values.get(name)
        if values is None:
            values = self._values[name] = deque(maxlen=self._max)
        if len(values) == self._max:
            self.num_dropped += 1
        values.append(value)

    def take(self) -> dict[str, list[float]]:
        """Every measurement since the last take, by name (and forgets them)."""
        self.read = True
        out = {name: list(values) for name, values in self._values.items() if values}
        for values in self._values.values():
            values.clear()
        return out
