"""A conformance workload: what arrives at, is aborted from and is reset in a vLLM engine, step
by step, and the engine shape it runs on.

A workload is data only (JSON round trip, no vLLM): the search (search.py) draws one, the
driver (driver.py) plays it into an engine, a reproduction script (repro.py) carries it.

Prompts are token ids. Their content does not matter to a connector's contract, only which
prompts share which prefixes: a plan names segments (lengths) and builds each prompt from some
of them; `materialize` fills the segments with token ids drawn from a seed. The search gives
every example its own seed, so two examples run on one engine never share a prefix and an
earlier example's stored KV cannot be claimed by a later one.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

# Token ids drawn for prompts: above the special tokens of SmolLM2 and tiny-llama, below their
# vocabularies (49152, 32000).
TOKEN_LOW, TOKEN_HIGH = 3, 31_999
RESETS = ("prefix", "running")  # reset_prefix_cache(), and with reset_running_requests=True


def adapter_name(k: int) -> str:
    """The k-th LoRA adapter of a workload (k >= 1; lora.py writes its weights)."""
    return f"adapter-{k}"


@dataclass(frozen=True)
class EngineShape:
    """The engine a workload runs on: a small token budget makes chunked prefill, a small KV
    pool makes preemption."""

    max_num_batched_tokens: int = 256
    # vLLM 0.32 chunks a long prompt to this many tokens a step when several requests can run
    long_prefill_token_threshold: int = 128
    num_gpu_blocks: int = 16  # of 128 tokens on vLLM's CPU build
    max_num_seqs: int = 4
    max_model_len: int = 1024
    # LoRA adapters with random weights (lora.py) that requests may run under; 0: LoRA off
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 0 or (value == 0 and name not in (
                    "long_prefill_token_threshold", "max_loras")):
                raise ValueError(f"engine shape {name} must be a whole number > 0, got {value!r}")


@dataclass(frozen=True)
class Arrival:
    """A request added before the engine step it arrives at."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int = 2
    cache_salt: str | None = None
    lora: str | None = None  # an adapter's name (adapter_name), None: the base model


@dataclass(frozen=True)
class Step:
    """What happens before one engine step: resets first, then aborts, then arrivals."""

    arrivals: tuple[Arrival, ...] = ()
    aborts: tuple[str, ...] = ()  # request ids added at an earlier step
    reset: str | None = None  # one of RESETS

    def __post_init__(self) -> None:
        if self.reset is not None and self.reset not in RESETS:
            raise ValueError(f"step reset must be one of {RESETS} or None, got {self.reset!r}")


@dataclass(frozen=True)
class Workload:
    steps: tuple[Step, ...]

    @property
    def arrivals(self) -> list[Arrival]:
        return [a for step in self.steps for a in step.arrivals]

    def to_json(self) -> list[dict[str, Any]]:
        return [{"arrivals": [{"req_id": a.req_id, "prompt": list(a.prompt),
                               "max_tokens": a.max_tokens, "cache_salt": a.cache_salt,
                               "lora": a.lora}
                              for a in s.arrivals],
                 "aborts": list(s.aborts), "reset": s.reset} for s in self.steps]

    @classmethod
    def from_json(cls, steps: list[dict[str, Any]]) -> Workload:
        return cls(tuple(Step(tuple(Arrival(a["req_id"], tuple(a["prompt"]), a["max_tokens"],
                                            a.get("cache_salt"), a.get("lora"))
                                    for a in s.get("arrivals", ())),
                              tuple(s.get("aborts", ())), s.get("reset")) for s in steps))

    def summary(self) -> str:
        """One line a reader can picture: per step what arrived (length, /salt, @LoRA), aborts,
        resets."""
        parts = []
        for i, step in enumerate(self.steps):
            what = [f"{a.req_id}:{len(a.prompt)}" + (f"/{a.cache_salt}" if a.cache_salt else "")
                    + (f"@{a.lora}" if a.lora else "") for a in step.arrivals]
            what += [f"abort {r}" for r in step.aborts]
            if step.reset:
                what.insert(0, f"reset {step.reset}")
            if what:
                parts.append(f"step {i}: " + ", ".join(what))
        return "; ".join(parts)


@dataclass(frozen=True)
class RequestPlan:
    segments: tuple[int, ...]  # indexes into WorkloadPlan.segment_lengths, in prompt order
    arrive: int  # the step it arrives at
    max_tokens: int = 2
    salt: int = 0  # 0: no cache_salt; n: the n-th tenant
    lora: int = 0  # 0: the base model; n: the n-th LoRA adapter
    abort_after: int | None = None  # steps after arrival; None: runs to the end


@dataclass(frozen=True)
class WorkloadPlan:
    """The structure of a workload: which prompts share which segments, when they come."""

    segment_lengths: tuple[int, ...]
    requests: tuple[RequestPlan, ...]
    resets: tuple[tuple[int, str], ...] = ()  # (step, kind)
    extra_steps: int = 0  # empty steps after the plan's last event, before the drain

    def materialize(self, seed: int, max_prompt_len: int) -> Workload:
        """The workload with each segment filled with token ids drawn from `seed`; prompts
        longer than `max_prompt_len` are cut to it."""
        rng = random.Random(seed)
        content = [tuple(rng.randint(TOKEN_LOW, TOKEN_HIGH) for _ in range(n))
                   for n in self.segment_lengths]
        last = max([r.arrive + (r.abort_after or 0) for r in self.requests]
                   + [s for s, _ in self.resets] + [0])
        arrivals: list[list[Arrival]] = [[] for _ in range(last + 1 + self.extra_steps)]
        aborts: list[list[str]] = [[] for _ in arrivals]
        for i, r in enumerate(self.requests):
            prompt = tuple(t for s in r.segments for t in content[s])[:max_prompt_len]
            req_id = f"r{i}"
            arrivals[r.arrive].append(Arrival(req_id, prompt, r.max_tokens,
                                              f"tenant-{r.salt}" if r.salt else None,
                                              adapter_name(r.lora) if r.lora else None))
            if r.abort_after is not None:
                aborts[r.arrive + r.abort_after].append(req_id)
        resets = dict(self.resets)
        return Workload(tuple(Step(tuple(arrivals[i]), tuple(aborts[i]), resets.get(i))
                              for i in range(len(arrivals))))
