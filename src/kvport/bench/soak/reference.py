"""The soak's reference: every request's prompt answered again by kvport's engine without a
connector (greedy), after the soak, in the soak's own process; an answer that differs is a
mismatch (wrong KV was loaded somewhere, or a load was wrong and not recomputed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BATCH = 32  # prompts per generate call: small enough to stay within the pool


@dataclass(frozen=True)
class Mismatch:
    incarnation: int
    prompt_kind: str
    prompt_len: int
    max_tokens: int
    first_difference: int  # output token index
    expected: tuple[int, ...]
    got: tuple[int, ...]
    # what the engine said of the request: its prompt tokens not computed (local prefix hits
    # and loaded), loaded by the connector, preemptions; and the prompt, to replay it
    cached: int
    external: int
    preemptions: int
    prompt: tuple[int, ...]


@dataclass(frozen=True)
class ReferenceCheck:
    checked: int  # requests compared
    distinct_prompts: int
    mismatches: tuple[Mismatch, ...]
    failed_requests: int  # requests that ended other than by length or stop


def check_outputs(requests: list[dict[str, Any]], model: str, dtype: str, block_size: int,
                  num_kv_blocks: int, threads: int) -> ReferenceCheck:
    """Compare each request record ({"prompt", "max_tokens", "output", "status", ...}) with the
    reference engine's greedy answer of the same prompt and length (each distinct pair once)."""
    import torch

    from kvport import LLM, SamplingParams

    ok = [r for r in requests if r["status"] in ("length", "stop")]
    wanted = sorted({(tuple(r["prompt"]), int(r["max_tokens"])) for r in ok})
    answers: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
    if wanted:
        torch.set_num_threads(threads)
        llm = LLM(model, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                  max_num_seqs=8, seed=0)
        try:
            for start in range(0, len(wanted), BATCH):
                batch = wanted[start:start + BATCH]
                params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                          for _, n in batch]
                outs = llm.generate([list(p) for p, _ in batch], params, use_tqdm=False)
                for key, out in zip(batch, outs):
                    answers[key] = tuple(out.outputs[0].token_ids)
        finally:
            llm.shutdown()
    mismatches: list[Mismatch] = []
    for r in ok:
        expected = answers[(tuple(r["prompt"]), int(r["max_tokens"]))]
        got = tuple(r["output"])
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                      min(len(expected), len(got)))
            mismatches.append(Mismatch(
                int(r["incarnation"]), str(r["prompt_kind"]), len(r["prompt"]),
                int(r["max_tokens"]), at, expected, got, int(r.get("cached", -1)),
                int(r.get("external", -1)), int(r.get("preemptions", -1)),
                tuple(r["prompt"])))
    return ReferenceCheck(checked=len(ok), distinct_prompts=len(wanted),
                          mismatches=tuple(mismatches), failed_requests=len(requests) - len(ok))
