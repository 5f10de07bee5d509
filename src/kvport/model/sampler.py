"""Token sampling: greedy, temperature, top-k, top-p, per-request generators, optional logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvport.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: top-n logprobs plus the sampled token's


def sample(
    logits: torch.Tensor,  # (B, vocab) float32
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> SamplerOutput:
    assert logits.shape[0] == len(params) == len(generators), "one row per request"
    tokens = logits.argmax(dim=-1)  # greedy rows keep this
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        scaled = logits[rows] / torch.tensor([params[i].temperature for i in random_rows]).unsqueeze(1)
        scaled = _apply_top_k_top_p(scaled, [params[i] for i in random_rows])
        probs = torch.softmax(scaled, dim=-1)
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    token_list = tokens.tolist()
    out_logprobs: list[dict[int, float] | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        # Logprobs of the model's own distribution (before temperature / top-k / top-p).
        lp = torch.log_softmax(logits[want], dim=-1)
        for j, i in enumerate(want):
            n = params[i].logprobs or 0
            entry: dict[int, float] = {}
            if n:
                top_v, top_i = lp[j].topk(n)
                entry = dict(zip(top_i.tolist(), top_v.tolist()))
            entry[token_list[i]] = float(lp[j, token_list[i]])
            out_logprobs[i] = entry
    return SamplerOutput(token_list, out_logprobs)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top-k and nucleus (top-p) with -inf."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    if bool((top_k == vocab).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, masked)
