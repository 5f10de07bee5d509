"""Scenarios the OffloadingConnector's hybrid tests run on each hybrid builtin
(test_hybrid_offloading.py: sliding windows, tiny-gemma3; test_state_offloading.py: Mamba
states, tiny-granite4). Each takes the model's engine factory, prompts and greedy reference, runs
the scenario and checks what holds for every KV cache group layout; what differs between the
models (which blocks a group keeps) stays in the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import faulty_connector
from kvport import LLM, SamplingParams
from kvport.connectors.offloading.mediums import ENGINE, HOST
from kvport.trace.checker import check_file
from offload_utils import assert_nothing_leaked, run, run_one_by_one

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class MakeLLM(Protocol):
    """The model on 16-token blocks with the OffloadingConnector (`extra`: its config keys) or
    another connector class of `faulty_connector`."""

    def __call__(self, extra: dict[str, Any] | None = None,
                 connector: str = "OffloadingConnector", **kwargs: Any) -> LLM: ...


def offloading_llm(model: str) -> MakeLLM:
    """The factory of `model` (e.g. "builtin:tiny-gemma3") with a 32 MiB host tier."""

    def make(extra: dict[str, Any] | None = None, connector: str = "OffloadingConnector",
             **kwargs: Any) -> LLM:
        cfg = {"cpu_bytes_to_use": 32 << 20, **(extra or {})}
        ktc: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both",
                               "kv_connector_extra_config": cfg}
        if connector != "OffloadingConnector":
            ktc["kv_connector_module_path"] = "faulty_connector"
        kwargs.setdefault("num_kv_blocks", 160)
        return LLM(model, block_size=BLOCK, kv_transfer_config=ktc, **kwargs)

    return make


def reference_tokens(model: str) -> list[list[int]]:
    """Greedy tokens of pair_prompts() without a connector or a prefix cache."""
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=160, enable_prefix_caching=False)
    return run(llm, pair_prompts(), GREEDY)[0]


def pair_prompts() -> list[list[int]]:
    """Four prompts: two pairs, each pair sharing its first 150 tokens (lengths 230, 201)."""
    out = []
    for i in range(4):
        shared = [(t * 37 + 11 * (i // 2)) % 250 + 3 for t in range(150)]
        out.append(shared + [(t * 13 + i) % 250 + 3 for t in range(80 - 29 * (i % 2))])
    return out


def full_hit(prompt: list[int]) -> int:
    """Every whole block but the one holding the prompt's last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def finish(llm: LLM) -> None:
    assert_nothing_leaked(llm)
    llm.shutdown()


def shared_prefix_hits(make: MakeLLM, prompts: list[list[int]], reference: list[list[int]],
                       interval: int | None, hit_blocks: int) -> None:
    """The second prompt of a pair hits `hit_blocks` of the 9 shared blocks (where the first
    stored what a hit there needs); it met the first at block 9 (the junction) and stores there,
    so a third prompt with the prefix hits all 9."""
    llm = make({} if interval is None else {"sliding_store_interval": interval})
    third = prompts[0][:150] + [(t * 7 + 5) % 250 + 3 for t in range(40)]
    first, _ = run_one_by_one(llm, prompts[:1], GREEDY)
    llm.reset_prefix_cache()
    second, cached = run_one_by_one(llm, prompts[1:2], GREEDY)
    assert first + second == reference[:2]
    assert cached == [hit_blocks * BLOCK]
    llm.reset_prefix_cache()
    expected, _ = run_one_by_one(make(enable_prefix_caching=False), [third], GREEDY)
    tokens, cached = run_one_by_one(llm, [third], GREEDY)
    assert tokens == expected and cached == [9 * BLOCK]
    finish(llm)


def chunked_prefill_and_preemption(llm: LLM, prompts: list[list[int]],
                                   reference: list[list[int]]) -> None:
    """Equal output with requests preempted; after a reset every prompt hits."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.reset_prefix_cache()
    tokens, cached = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == reference and all(c > 0 for c in cached)
    finish(llm)


def disk_hits_in_a_new_engine(make: MakeLLM, root: Path, prompts: list[list[int]],
                              reference: list[list[int]]) -> None:
    """A second engine on the same disk root, its host tier empty, hits every prompt whole:
    from disk, but for a pair's second prompt, whose shared 9 blocks the first promoted."""
    tiers = {"secondary_tiers": [{"type": "disk", "root_dir": str(root), "max_bytes": 256 << 20}]}
    llm = make(tiers)
    assert run(llm, prompts, GREEDY)[0] == reference
    finish(llm)
    fresh = make(tiers)
    tokens, cached = run_one_by_one(fresh, prompts, GREEDY)
    assert tokens == reference
    assert cached == [full_hit(p) for p in prompts]
    disk = fresh.get_metrics()["connector"]["disk"]
    assert disk["hit_tokens"] == sum(cached) - 2 * 9 * BLOCK
    finish(fresh)


def failed_loads_recompute(make: MakeLLM, tmp_path: Path, prompts: list[list[int]],
                           reference: list[list[int]], sync: bool) -> None:
    """Loads 1 and 3 fail; the requests recompute (in chunks of 64 tokens) to equal output,
    nothing leaks and the recorded trace checks clean."""
    faulty_connector.FAULTS[(HOST, ENGINE)] = {"fail_on": {1, 3}}
    llm = make({"sync_host_loads": sync, "record_trace": str(tmp_path / "trace.jsonl")},
               connector="FaultyOffloadingConnector", max_num_batched_tokens=64)
    assert run(llm, prompts, GREEDY)[0] == reference
    llm.reset_prefix_cache()
    tokens, _ = run_one_by_one(llm, prompts, GREEDY)
    assert tokens == reference
    m = llm.get_metrics()
    assert m["kv_transfer"]["num_invalid_blocks"] > 0
    assert m["connector"]["requests"]["num_failed_loads"] == 2
    finish(llm)
    assert check_file(str(tmp_path / "trace.jsonl")) == []
