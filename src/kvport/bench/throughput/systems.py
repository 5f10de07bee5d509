"""A system under test of `kvport bench throughput`, and kvport's engine as one.

A system runs a list of tasks (config.Task), timing each `generate` call, and reports the torch
thread count it really runs with (`threads`) and what it was started with (`settings`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvport.bench.throughput.config import Task

PromptSets = dict[str, list[list[int]]]  # set name -> prompts of token ids
Generate = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, max_tokens) -> outputs


@dataclass(frozen=True)
class TaskTimes:
    """One round of tasks: seconds per task key; the outputs of the tasks that keep theirs."""

    times: dict[str, float]
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)


class System(Protocol):
    name: str
    version: str
    threads: int
    settings: dict[str, Any]

    def run_tasks(self, prompt_sets: PromptSets, tasks: list[Task]) -> TaskTimes: ...

    def close(self) -> None: ...


def time_tasks(generate: Generate, prompt_sets: PromptSets, tasks: list[Task]) -> TaskTimes:
    """Times `generate(prompts, max_tokens)` once per task, in order; RuntimeError naming the
    task unless every prompt got exactly `max_tokens` tokens."""
    times: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    for task in tasks:
        prompts = prompt_sets[task.set][: task.batch]
        start = time.perf_counter()
        ids = generate(prompts, task.max_tokens)
        times[task.key] = time.perf_counter() - start
        if len(ids) != len(prompts) or any(len(x) != task.max_tokens for x in ids):
            raise RuntimeError(f"task {task.key}: got lengths {[len(x) for x in ids]}, "
                               f"expected {task.max_tokens} for each of {len(prompts)} prompts")
        if task.keep_output:
            outputs[task.key] = ids
    return TaskTimes(times, outputs)


class KvportSystem:
    """kvport's `LLM` as a system under test; prefix caching off, so every run computes."""

    def __init__(self, name: str, model: str, dtype: str, max_num_batched_tokens: int | None,
                 max_model_len: int, max_num_seqs: int) -> None:
        import torch

        import kvport
        from kvport import LLM, SamplingParams

        kwargs: dict[str, Any] = {"dtype": dtype, "enable_prefix_caching": False, "seed": 0,
                                  "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        self.name = name
        self.settings = kwargs
        self.version = kvport.__version__
        self.threads = torch.get_num_threads()
        self._params = SamplingParams
        self.llm = LLM(model=model, **kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def run_tasks(self, prompt_sets: PromptSets, tasks: list[Task]) -> TaskTimes:
        return time_tasks(self.generate, prompt_sets, tasks)

    def close(self) -> None:
        self.llm.shutdown()
