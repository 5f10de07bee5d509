"""What test_hybrid_engine.py (tiny-gemma3) and test_state_hybrid_engine.py (tiny-granite4)
share: byte prompts, transformers' greedy reference, and how a run is checked."""

from __future__ import annotations

from pathlib import Path

import torch

from kvport import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def byte_prompts(n: int, length: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` byte tokens (BOS first), the first `shared` tokens common."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(32, 127, (shared,), generator=gen).tolist()
    return [[256, *prefix, *torch.randint(32, 127, (length - shared - 1,), generator=gen).tolist()]
            for _ in range(n)]


def greedy_reference(model_dir: Path, prompts: list[list[int]],
                     max_tokens: int = GREEDY.max_tokens) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy continuation of each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: dict[tuple[int, ...], list[int]] = {}
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)
            out[tuple(p)] = ids[0, len(p):].tolist()
    return out


def check(llm: LLM, prompts: list[list[int]], reference: dict[tuple[int, ...], list[int]]) -> None:
    """Greedy output equal to the reference; nothing leaked."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == reference[tuple(p)]
    llm.engine.check_no_leaks()
