"""The simulation's workload, decided by the seed before the run (Plan), and the reference it
is checked against: each prompt's greedy tokens without a connector."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sim_transfers import FaultRates
from kvport import LLM, SamplingParams
from kvport.connectors.offloading.mediums import DISK, ENGINE, HOST
from offload_utils import OFFLOAD_BLOCK, make_llm

MAX_TOKENS = 8  # the reference's tokens per prompt; a request asks for 1..MAX_TOKENS
MAX_MODEL_LEN = 96


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Plan:
    """Everything the seed decides before the run (the rest comes from seeded streams)."""

    seed: int
    async_scheduling: bool
    call_order: str
    num_kv_blocks: int
    host_slots: int
    disk_slots: int
    arrivals: tuple[Arrival, ...]
    restarts: tuple[int, ...]  # steps before which the engine is dropped and built again
    abort_rate: float
    disk_fault_rate: float  # per step: an entry evicted or corrupted between steps
    rates: dict[tuple[str, str], FaultRates]

    @staticmethod
    def from_seed(seed: int, num_requests: int = 18, num_steps: int = 40) -> Plan:
        rng = random.Random(f"plan-{seed}")
        docs = [[rng.randrange(3, 250) for _ in range(rng.choice((16, 24, 40, 56)))]
                for _ in range(3)]
        arrivals: list[Arrival] = []
        for _ in range(num_requests):
            head = rng.choice(docs + docs + [[]])
            if arrivals and rng.random() < 0.3:  # a next turn: an earlier prompt, extended
                head = list(rng.choice(arrivals).prompt)
            n = max(1, min(MAX_MODEL_LEN - MAX_TOKENS, len(head) + rng.randint(0, 24)))
            if rng.random() < 0.3:  # block aligned: a full hit leaves one token to compute
                n = max(OFFLOAD_BLOCK, n // OFFLOAD_BLOCK * OFFLOAD_BLOCK)
            tail = [rng.randrange(3, 250) for _ in range(max(0, n - len(head)))]
            arrivals.append(Arrival(rng.randrange(num_steps), tuple((head + tail)[:n]),
                                    rng.randint(1, MAX_TOKENS)))
        arrivals.sort(key=lambda a: a.step)
        restarts = tuple(sorted(rng.sample(range(5, num_steps), rng.choice((0, 1, 1, 2)))))
        lower = FaultRates(hold=0.3, stuck=rng.choice((0.0, 0.1)), fail=0.05, tier=0.1)
        copy = FaultRates(hold=0.25, fail=0.05)
        return Plan(seed, rng.random() < 0.4, rng.choice(("vllm-0.32", "legacy")),
                    rng.choice((24, 32, 48)), rng.choice((6, 12, 48)), rng.choice((8, 32)),
                    tuple(arrivals), restarts, rng.choice((0.0, 0.02)),
                    rng.choice((0.0, 0.05)),
                    {(ENGINE, HOST): copy, (HOST, ENGINE): copy, (HOST, DISK): lower,
                     (DISK, HOST): lower})


_REFERENCE: dict[tuple[int, ...], list[int]] = {}
_REFERENCE_LLM: list[LLM] = []


def reference(prompts: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """Greedy MAX_TOKENS tokens of each prompt without a connector or a prefix cache (cached
    for the process: the same prompt always gives the same tokens)."""
    todo = sorted({p for p in prompts if p not in _REFERENCE})
    if todo:
        if not _REFERENCE_LLM:
            _REFERENCE_LLM.append(make_llm(enable_prefix_caching=False,
                                           max_model_len=MAX_MODEL_LEN, num_kv_blocks=256))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = _REFERENCE_LLM[0].generate([list(p) for p in todo], params, use_tqdm=False)
        for p, out in zip(todo, outs, strict=True):
            _REFERENCE[p] = list(out.outputs[0].token_ids)
    return {p: _REFERENCE[p] for p in prompts}


def reference_tokens(prompt: list[int]) -> list[int]:
    """The reference of a prompt reference() computed already."""
    return _REFERENCE[tuple(prompt)]
