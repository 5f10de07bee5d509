"""ExampleConnector and MultiConnector on a state-space hybrid (tiny-granite4: Mamba2 layers 0
and 2 in a state group, attention layers 1 and 3; blocks of 16 tokens). A state layer's entry is
the one block before the aligned end (its states there), an attention layer's every aligned
token; a load fills the state group's block before the hit and the attention group's table;
greedy output equals no connector in every mode, with chunked prefill, preemption and a
MultiConnector of ExampleConnector and OffloadingConnector; traces check clean."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hybrid_engine import BLOCK, GREEDY, aligned, example, finish, one_by_one, tokens
from safetensors.torch import load_file

from kvport import LLM
from kvport.connectors.base import layer_name

MODES: dict[str, dict[str, Any]] = {"sync": {}, "async": {"async_scheduling": True},
                                    "process": {"worker": "process"}}
OFFLOADING = {"kv_connector": "OffloadingConnector",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 32 << 20}}


def granite(ktc: dict[str, Any], trace: Path, **kwargs: Any) -> LLM:
    ktc.setdefault("kv_connector_extra_config", {})["record_trace"] = str(trace)
    kwargs.setdefault("num_kv_blocks", 160)
    return LLM("builtin:tiny-granite4", block_size=BLOCK, kv_transfer_config=ktc, **kwargs)


def state_prompts() -> list[list[int]]:
    """Four prompts, two pairs each sharing its first 70 tokens; lengths 230 and 201."""
    out = []
    for i in range(4):
        shared = [(t * 37 + 11 * (i // 2)) % 250 + 3 for t in range(70)]
        out.append(shared + [(t * 13 + i) % 250 + 3 for t in range(160 - 29 * (i % 2))])
    return out


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("builtin:tiny-granite4", block_size=BLOCK, num_kv_blocks=160,
              enable_prefix_caching=False)
    out = tokens(llm, state_prompts())
    llm.shutdown()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_every_prompt_comes_back_from_its_entry_after_a_reset(
        tmp_path: Path, reference: list[list[int]], mode: str) -> None:
    llm = granite(example(tmp_path / "s"), tmp_path / "t.jsonl", **MODES[mode])
    assert llm.engine.kv_cache_manager.group_windows == (2, None)  # the groups are kept
    prompts = state_prompts()
    assert tokens(llm, prompts) == reference
    assert len(os.listdir(tmp_path / "s")) == 4
    llm.reset_prefix_cache()
    assert one_by_one(llm, prompts) == (reference, aligned(prompts))
    finish(llm, tmp_path / "t.jsonl")


def test_state_layers_store_one_block(tmp_path: Path, reference: list[list[int]]) -> None:
    llm = granite(example(tmp_path / "s"), tmp_path / "t.jsonl")
    assert tokens(llm, state_prompts()[:2]) == reference[:2]
    sizes = sorted(
        tuple(load_file(entry / f"{layer_name(i)}.safetensors")["kv_cache"].shape[0]
              for i in range(4))
        for entry in (tmp_path / "s").iterdir())
    # Layers 0 and 2 keep a state: the block before the aligned end (16 token rows of the slot).
    assert sizes == [(16, 192, 16, 192), (16, 224, 16, 224)]
    finish(llm, tmp_path / "t.jsonl")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_preemption(tmp_path: Path, reference: list[list[int]],
                                        async_scheduling: bool) -> None:
    llm = granite(example(tmp_path / "s"), tmp_path / "t.jsonl", num_kv_blocks=30,
                  max_num_batched_tokens=24, async_scheduling=async_scheduling)
    prompts = state_prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.reset_prefix_cache()
    assert one_by_one(llm, prompts) == (reference, aligned(prompts))
    finish(llm, tmp_path / "t.jsonl")


@pytest.mark.parametrize("first", ["example", "offloading"])
def test_a_multi_connector_of_both_keeps_the_groups(tmp_path: Path, reference: list[list[int]],
                                                    first: str) -> None:
    children = [example(tmp_path / "s"), OFFLOADING]
    if first == "offloading":
        children.reverse()
    llm = granite({"kv_connector": "MultiConnector",
                   "kv_connector_extra_config": {"connectors": children}}, tmp_path / "t.jsonl")
    assert llm.engine.kv_cache_manager.group_windows == (2, None)
    prompts = state_prompts()
    assert tokens(llm, prompts) == reference
    llm.reset_prefix_cache()
    out, cached = one_by_one(llm, prompts)
    assert out == reference and all(c > 0 for c in cached)
    finish(llm, tmp_path / "t.jsonl")
