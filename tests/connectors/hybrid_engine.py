"""What test_example_hybrid.py and test_multi_hybrid.py share: tiny-gemma3 (two sliding-window
groups, window 48, and one full-attention group) with blocks of 16 tokens, its prompts, their
greedy reference and how every engine test ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvport import LLM, SamplingParams
from kvport.connectors.example import num_aligned_tokens
from kvport.trace.checker import check_file

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def hybrid_prompts() -> list[list[int]]:
    """Four prompts, two pairs each sharing its first 70 tokens (4 whole blocks); lengths 230
    and 201, aligned prefixes 224 and 192: past the window, so sliding layers store 3 blocks."""
    out = []
    for i in range(4):
        shared = [(t * 37 + 11 * (i // 2)) % 250 + 3 for t in range(70)]
        out.append(shared + [(t * 13 + i) % 250 + 3 for t in range(160 - 29 * (i % 2))])
    return out


def example(root: Path) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(root)}}


def gemma(ktc: dict[str, Any], trace: Path, **kwargs: Any) -> LLM:
    """tiny-gemma3 with `ktc`, recording its calls into `trace`."""
    ktc.setdefault("kv_connector_extra_config", {})["record_trace"] = str(trace)
    kwargs.setdefault("num_kv_blocks", 160)
    return LLM("builtin:tiny-gemma3", block_size=BLOCK, kv_transfer_config=ktc, **kwargs)


def reference_tokens() -> list[list[int]]:
    """Greedy tokens of hybrid_prompts() without a connector or a prefix cache."""
    llm = LLM("builtin:tiny-gemma3", block_size=BLOCK, num_kv_blocks=160,
              enable_prefix_caching=False)
    out = tokens(llm, hybrid_prompts())
    llm.shutdown()
    return out


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def one_by_one(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt on its own: (greedy tokens, num_cached_tokens) per prompt."""
    out, cached = [], []
    for p in prompts:
        result = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert result.error is None, result.error
        out.append(result.outputs[0].token_ids)
        cached.append(result.num_cached_tokens)
    return out, cached


def aligned(prompts: list[list[int]]) -> list[int]:
    """What a full hit of each prompt is: its aligned prefix."""
    return [num_aligned_tokens(len(p), BLOCK) for p in prompts]


def finish(llm: LLM, trace: Path) -> None:
    """Nothing leaked, no answer outside the contract, no hook that raised, no failed load; the
    recorded trace checks clean."""
    llm.engine.check_no_leaks()
    stats = llm.engine.scheduler.xfer.stats
    assert (stats.num_bad_answers, stats.num_hook_errors, stats.num_invalid_blocks) == (0, 0, 0)
    llm.shutdown()
    assert check_file(str(trace)) == []
