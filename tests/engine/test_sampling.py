"""Sampling: seeds, top-k / top-p, logprobs, and the sampler's masking on its own."""

from __future__ import annotations

from collections.abc import Iterator

import math

import pytest
import torch

from kvport import LLM, SamplingParams
from kvport.model.sampler import sample


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM("builtin:tiny-llama", block_size=4, max_num_batched_tokens=32)
    yield llm
    llm.engine.check_no_leaks()


PROMPT = [5, 17, 33, 81, 120, 7, 9]


def tokens(llm: LLM, params: SamplingParams, ps: list[list[int]] | None = None) -> list[list[int]]:
    outs = llm.generate(ps or [PROMPT], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = tokens(llm, params)[0]
    others = [[i + 1, i + 2, i + 3] for i in range(5)]
    batched = tokens(llm, params, others + [PROMPT])[-1]
    assert alone == batched
    other_seed = tokens(llm, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed != alone


def test_seeded_sampling_survives_preemption() -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    ps = [[(i * 13 + j) % 200 + 1 for j in range(30)] for i in range(6)]
    roomy = LLM("builtin:tiny-llama", block_size=4, max_model_len=64)
    tight = LLM("builtin:tiny-llama", block_size=4, num_kv_blocks=16, max_model_len=64)
    a = roomy.generate(ps, params, use_tqdm=False)
    b = tight.generate(ps, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in b) > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    roomy.engine.check_no_leaks()
    tight.engine.check_no_leaks()


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = tokens(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    top1 = tokens(llm, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    assert greedy == top1


def test_logprobs_are_returned_and_consistent(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3  # greedy token is also the top-1
        assert lp[tok] == max(lp.values()) <= 0.0
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)))


def test_sampler_top_k_and_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gens = [torch.Generator().manual_seed(0)]
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),  # 0.5 < 0.7 <= 0.8
        (SamplingParams(temperature=1.0, top_p=0.5), {0}),
        (SamplingParams(temperature=1.0, top_p=0.96), {0, 1, 2, 3}),
    ]:
        seen = {sample(logits, [params], gens).token_ids[0] for _ in range(300)}
        assert seen == allowed, (params, seen)


def test_sampler_temperature_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).unsqueeze(0)
    gen = [torch.Generator().manual_seed(1)]
    counts = [0, 0, 0]
    n = 3000
    for _ in range(n):
        counts[sample(logits, [SamplingParams(temperature=1.0)], gen).token_ids[0]] += 1
    for c, p in zip(counts, probs.tolist()):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)  # within 4 sigma


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=-1), "logprobs"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_params(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
