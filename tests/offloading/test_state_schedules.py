"""Hypothesis-generated schedules for the OffloadingConnector on a state-space hybrid
(tiny-granite4: a Mamba2 state group and a full-attention group; blocks of 16 tokens): prompts
sharing prefixes of a family, aborts, small pools (preemption), small host tiers (eviction), a
disk tier, prefill chunks that end inside blocks, async scheduling, and the state group's store
interval. Every run passes the trace checker, non-aborted requests match the output of no
connector, and nothing leaks."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvport import LLM, SamplingParams
from offload_utils import run_waves

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
FAMILY = [(t * 29 + 5) % 250 + 3 for t in range(200)]  # prompts are prefixes of it, plus tails

# One request of 256 tokens: 16 attention blocks, the state blocks one prefill chunk writes, and
# the null block (the engine's own count: core.blocks_per_request).
MIN_BLOCKS = {24: 20, 64: 23, 2048: 33}

prompt_st = st.builds(lambda n, tail: FAMILY[:n] + tail,
                      st.integers(1, 190), st.lists(st.integers(3, 250), max_size=20))


def granite(ktc: dict[str, Any] | None = None, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 120)
    return LLM("builtin:tiny-granite4", block_size=16, max_model_len=256, kv_transfer_config=ktc,
               **kwargs)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    waves=st.lists(st.lists(prompt_st, min_size=1, max_size=4), min_size=1, max_size=3),
    aborts=st.sets(st.integers(0, 11), max_size=3),
    extra_blocks=st.integers(0, 30),
    host_blocks=st.integers(4, 60),
    disk=st.booleans(),
    chunk=st.sampled_from([24, 64, 2048]),
    async_scheduling=st.booleans(),
    interval=st.sampled_from([None, 0, 48]),
)
def test_random_state_hybrid_schedules(waves: list[list[list[int]]], aborts: set[int],
                                       extra_blocks: int, host_blocks: int, disk: bool,
                                       chunk: int, async_scheduling: bool,
                                       interval: int | None) -> None:
    num_kv_blocks = MIN_BLOCKS[chunk] + extra_blocks
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        extra: dict[str, Any] = {"cpu_bytes_to_use": host_blocks * 16384,
                                 "record_trace": str(trace)}
        if interval is not None:
            extra["sliding_store_interval"] = interval
        if disk:
            extra["secondary_tiers"] = [{"type": "disk", "root_dir": tmp, "max_bytes": 1 << 26}]
        llm = granite({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra}, num_kv_blocks=num_kv_blocks,
                      max_num_batched_tokens=chunk, async_scheduling=async_scheduling)
        assert llm.engine.kv_cache_manager.group_windows == (2, None)
        run_waves(llm, waves, aborts, PARAMS, trace, reference)


_REFERENCE: dict[tuple[int, ...], list[int]] = {}
_REFERENCE_LLM: dict[str, LLM] = {}


def reference(prompt: list[int]) -> list[int]:
    if tuple(prompt) not in _REFERENCE:
        if "llm" not in _REFERENCE_LLM:
            _REFERENCE_LLM["llm"] = granite(enable_prefix_caching=False)
        out = _REFERENCE_LLM["llm"].generate([prompt], PARAMS, use_tqdm=False)
        _REFERENCE[tuple(prompt)] = out[0].outputs[0].token_ids
    return _REFERENCE[tuple(prompt)]
