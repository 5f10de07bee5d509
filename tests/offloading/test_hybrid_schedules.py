"""Hypothesis-generated schedules for the OffloadingConnector on hybrid models, blocks of 16
tokens: tiny-gemma3 (two sliding-window groups, window 48, and one full-attention group) and
tiny-granite4 (a Mamba2 state group and a full-attention group). Prompts sharing prefixes of a
family, aborts, small pools (preemption), small host tiers (eviction), a disk tier, prefill
chunks (ending inside blocks), async scheduling, and the store interval of the sliding or state
groups. Every run passes the trace checker (G1, G2 among its rules), non-aborted requests match
the output of no connector, and nothing leaks."""

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
GEMMA, GRANITE = "builtin:tiny-gemma3", "builtin:tiny-granite4"

# Per model and prefill chunk, the pool of one request of 256 tokens: 16 blocks of the full
# group, of each sliding group its window and a chunk's blocks, of the state group a chunk's
# blocks, and the null block (the engine's own count: core.blocks_per_request).
MIN_BLOCKS = {GEMMA: {32: 29, 64: 33, 2048: 48}, GRANITE: {24: 20, 64: 23, 2048: 33}}
WINDOWS = {GEMMA: (48, 48, None), GRANITE: (2, None)}

prompt_st = st.builds(lambda n, tail: FAMILY[:n] + tail,
                      st.integers(1, 190), st.lists(st.integers(3, 250), max_size=20))
waves_st = st.lists(st.lists(prompt_st, min_size=1, max_size=4), min_size=1, max_size=3)
SETTINGS = settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hybrid(model: str, ktc: dict[str, Any] | None = None, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 120)
    return LLM(model, block_size=16, max_model_len=256, kv_transfer_config=ktc, **kwargs)


@SETTINGS
@given(waves=waves_st, aborts=st.sets(st.integers(0, 11), max_size=3),
       extra_blocks=st.integers(0, 40), host_blocks=st.integers(4, 60), disk=st.booleans(),
       chunk=st.sampled_from([32, 64, 2048]), async_scheduling=st.booleans(),
       interval=st.sampled_from([None, 0, 32]))
def test_random_hybrid_schedules(waves: list[list[list[int]]], aborts: set[int],
                                 extra_blocks: int, host_blocks: int, disk: bool, chunk: int,
                                 async_scheduling: bool, interval: int | None) -> None:
    _run(GEMMA, waves, aborts, extra_blocks, host_blocks, disk, chunk, async_scheduling, interval)


@SETTINGS
@given(waves=waves_st, aborts=st.sets(st.integers(0, 11), max_size=3),
       extra_blocks=st.integers(0, 30), host_blocks=st.integers(4, 60), disk=st.booleans(),
       chunk=st.sampled_from([24, 64, 2048]), async_scheduling=st.booleans(),
       interval=st.sampled_from([None, 0, 48]))
def test_random_state_hybrid_schedules(waves: list[list[list[int]]], aborts: set[int],
                                       extra_blocks: int, host_blocks: int, disk: bool,
                                       chunk: int, async_scheduling: bool,
                                       interval: int | None) -> None:
    _run(GRANITE, waves, aborts, extra_blocks, host_blocks, disk, chunk, async_scheduling,
         interval)


def _run(model: str, waves: list[list[list[int]]], aborts: set[int], extra_blocks: int,
         host_blocks: int, disk: bool, chunk: int, async_scheduling: bool,
         interval: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        extra: dict[str, Any] = {"cpu_bytes_to_use": host_blocks * 16384,
                                 "record_trace": str(trace)}
        if interval is not None:
            extra["sliding_store_interval"] = interval
        if disk:
            extra["secondary_tiers"] = [{"type": "disk", "root_dir": tmp, "max_bytes": 1 << 26}]
        llm = hybrid(model, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": extra},
                     num_kv_blocks=MIN_BLOCKS[model][chunk] + extra_blocks,
                     max_num_batched_tokens=chunk, async_scheduling=async_scheduling)
        assert llm.engine.kv_cache_manager.group_windows == WINDOWS[model]
        run_waves(llm, waves, aborts, PARAMS, trace, lambda p: _reference(model, p))


_REFERENCE: dict[tuple[str, tuple[int, ...]], list[int]] = {}
_REFERENCE_LLM: dict[str, LLM] = {}


def _reference(model: str, prompt: list[int]) -> list[int]:
    key = (model, tuple(prompt))
    if key not in _REFERENCE:
        if model not in _REFERENCE_LLM:
            _REFERENCE_LLM[model] = hybrid(model, enable_prefix_caching=False)
        out = _REFERENCE_LLM[model].generate([prompt], PARAMS, use_tqdm=False)
        _REFERENCE[key] = out[0].outputs[0].token_ids
    return _REFERENCE[key]
