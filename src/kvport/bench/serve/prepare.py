"""Everything `kvport bench serve` decides before a server starts: each scenario's dataset
(flags for vLLM's client, the multi-turn files, which turn each row is and which instance it
goes to) and the KV pool the servers get, sized from the longest request (config.pool_plan).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvport.bench.common.command import JsonObject
from kvport.bench.serve.config import (
    MULTI_TURN,
    PREFILL_DECODE,
    SHARED_PREFIX,
    TWO_INSTANCES,
    PoolPlan,
    ServeBenchConfig,
    pool_plan,
)
from kvport.bench.serve.datasets import (
    WORDS,
    Answer,
    Turn,
    alternating_instances,
    check_prompt_tokens,
    conversation_turns,
    prefix_repetition_args,
    random_args,
    sharegpt_args,
    single_token_words,
    write_sharegpt,
)
from kvport.bench.vllm.engine import VLLM_CPU_BLOCK_SIZE

# two-instances draws other conversations than multi-turn: a system's Redis or disk entries
# from multi-turn must not serve it
TWO_INSTANCES_SEED_OFFSET = 1


@dataclass(frozen=True)
class Dataset:
    """One scenario's requests as vLLM's client gets them."""

    scenario: str
    client_args: tuple[str, ...]
    num_requests: int
    longest_request_tokens: int  # prompt + output
    working_set_blocks: int  # full blocks of the prefixes worth keeping (see `prepare`)
    turns: tuple[int, ...] | None = None  # row -> turn (multi-turn files)
    routes: tuple[int, ...] | None = None  # row -> instance (two-instances)
    # row -> the model's reply its conversation's next prompt carries (model replies only):
    # what the server should answer that row again during the run
    replies: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Prepared:
    datasets: dict[str, Dataset]
    pool: PoolPlan

    def pool_json(self) -> JsonObject:
        return {"block_tokens": VLLM_CPU_BLOCK_SIZE, "max_model_len": self.pool.max_model_len,
                "kv_blocks": self.pool.kv_blocks,
                "kv_tokens": self.pool.kv_blocks * VLLM_CPU_BLOCK_SIZE,
                "longest_request_tokens": self.pool.longest_request_tokens,
                "working_set_blocks": {s: d.working_set_blocks
                                       for s, d in self.datasets.items()},
                "requests": {s: d.num_requests for s, d in self.datasets.items()}}


class Encoder:
    """The model's tokenizer as the bench needs it: tokens of a text as the server counts them
    (special tokens too), and ids without special tokens (for `single_token_words`)."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text).ids)

    def bare_ids(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def prepare(cfg: ServeBenchConfig, encoder: Encoder, out_dir: Path,
            answer: Answer | None = None) -> Prepared:
    """Each scenario's dataset (multi-turn files written to `out_dir`; `answer`: their replies,
    see datasets.conversation_turns) and the pool.

    Working sets, what a cache must keep for every reuse to hit: the shared prefixes' full
    blocks (shared-prefix); every conversation's last transcript's full blocks (multi-turn; in
    two-instances each instance sees every conversation, a turn out of two)."""
    words = single_token_words(WORDS, encoder.bare_ids)
    datasets: dict[str, Dataset] = {}
    if SHARED_PREFIX in cfg.scenarios:
        sp = cfg.shared_prefix
        datasets[SHARED_PREFIX] = Dataset(
            SHARED_PREFIX, tuple(prefix_repetition_args(sp)), sp.num_requests,
            sp.prompt_tokens + sp.output_len,
            sp.num_prefixes * (sp.prefix_len // VLLM_CPU_BLOCK_SIZE))
    for scenario, offset in ((MULTI_TURN, 0), (TWO_INSTANCES, TWO_INSTANCES_SEED_OFFSET)):
        if scenario in cfg.scenarios:
            turns = conversation_turns(cfg.conversation, cfg.seed + offset, words, answer)
            datasets[scenario] = _conversation_dataset(cfg, scenario, turns, encoder.count,
                                                       out_dir, answer is not None)
    if PREFILL_DECODE in cfg.scenarios:  # prompts that share nothing: no working set
        rs = cfg.random
        datasets[PREFILL_DECODE] = Dataset(PREFILL_DECODE, tuple(random_args(rs)),
                                           rs.num_requests, rs.input_len + rs.output_len, 0)
    longest = max(d.longest_request_tokens for d in datasets.values())
    return Prepared(datasets, pool_plan(longest, cfg.concurrency, cfg.kv_blocks))


def _conversation_dataset(cfg: ServeBenchConfig, scenario: str, turns: list[Turn],
                          count_tokens: Callable[[str], int], out_dir: Path,
                          answered: bool) -> Dataset:
    longest = check_prompt_tokens(turns, count_tokens)
    path = out_dir / f"{scenario}.sharegpt.json"
    write_sharegpt(turns, path)
    last = {t.conversation: t for t in turns}  # each conversation's last turn, sent last
    working = sum(math.floor(count_tokens(t.prompt) / VLLM_CPU_BLOCK_SIZE)
                  for t in last.values())
    routes = tuple(alternating_instances(turns)) if scenario == TWO_INSTANCES else None
    return Dataset(scenario, tuple(sharegpt_args(path, cfg.conversation)), len(turns),
                   longest + cfg.conversation.output_len, working,
                   tuple(t.turn for t in turns), routes,
                   tuple(t.reply for t in turns) if answered else None)
