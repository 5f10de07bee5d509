"""Token sampling: greedy, temperature, top-k, top-p, per-request generators, optional logprobs.

Everything runs on the logits' device; the results come to the host at the end, in one copy of
the token ids per step (two more when some request asks for logprobs), never one per request:
on a GPU each copy waits for the step's work to finish.
"""

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
    generators: list[torch.Generator],  # on the logits' device
) -> SamplerOutput:
    assert logits.shape[0] == len(params) == len(generators), "one row per request"
    dev = logits.device
    # Greedy rows keep the argmax: they draw nothing, so their tokens do not depend on the
    # generators (nor on which device's RNG those are).
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=dev)
        temps = torch.tensor([params[i].temperature for i in random_rows], device=dev)
        scaled = logits[rows] / temps.unsqueeze(1)
        scaled = _apply_top_k_top_p(scaled, [params[i] for i in random_rows])
        probs = torch.softmax(scaled, dim=-1)
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return SamplerOutput(tokens.tolist(), [None] * len(params))
    # Logprobs of the model's own distribution (before temperature / top-k / top-p). Each
    # row's top-n and its sampled token's logprob are gathered on the device, then the ids
    # (with the sampled tokens) and the values come over in one copy each.
    lp = torch.log_softmax(logits[torch.tensor(want, device=dev)], dim=-1)
    chosen = lp.gather(1, tokens[want].unsqueeze(1)).squeeze(1)  # (len(want),)
    tops = [lp[j].topk(params[i].logprobs or 0) for j, i in enumerate(want)]
    ids = torch.cat([tokens, *(t.indices for t in tops)]).tolist()
    values = torch.cat([chosen, *(t.values for t in tops)]).tolist()
    token_list, top_ids = ids[:len(params)], ids[len(params):]
    top_values = values[len(want):]
    out_logprobs: list[dict[int, float] | None] = [None] * len(params)
    at = 0
    for j, i in enumerate(want):
        n = params[i].logprobs or 0
        entry = dict(zip(top_ids[at:at + n], top_values[at:at + n]))
        at += n
        entry[token_list[i]] = values[j]
        out_logprobs[i] = entry
    return SamplerOutput(token_list, out_logprobs)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top-k and nucleus (top-p) with -inf."""
    vocab = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # Decided on the host, from the params: no device tensor is read back for it.
    if all(k == vocab for k in ks) and all(p.top_p >= 1.0 for p in params):
        return logits
    dev = logits.device
    top_k = torch.tensor(ks, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, masked)
