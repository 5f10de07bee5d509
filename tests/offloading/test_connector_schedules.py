"""Hypothesis-generated schedules for the OffloadingConnector: request mixes that share
prefixes, aborts, small pools (preemption), tiny host tiers (eviction, partial promotion), a disk
tier, a Redis tier (a real redis-server; each example under a tenant salt of its own), async
scheduling and no-forward steps. Every run passes the trace checker, non-aborted requests match
the output of no connector, and nothing leaks."""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_fixtures import RedisServer

from kvport import SamplingParams
from offload_utils import make_llm, offload_config, run_waves

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
FAMILY = [(t * 29 + 5) % 250 + 3 for t in range(80)]  # prompts are prefixes of it, plus tails

prompt_st = st.builds(
    lambda n, tail: FAMILY[:n] + tail,
    st.integers(1, 60), st.lists(st.integers(3, 250), max_size=6))


_SALTS = itertools.count()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    waves=st.lists(st.lists(prompt_st, min_size=1, max_size=4), min_size=1, max_size=3),
    aborts=st.sets(st.integers(0, 11), max_size=3),
    num_kv_blocks=st.integers(32, 60),  # 32: one max_model_len request
    host_blocks=st.integers(2, 40),
    disk=st.booleans(),
    redis=st.booleans(),
    async_scheduling=st.booleans(),
    empty_every=st.sampled_from([0, 2, 3]),
)
def test_random_schedules(redis_url: str, waves: list[list[list[int]]], aborts: set[int],
                          num_kv_blocks: int, host_blocks: int, disk: bool, redis: bool,
                          async_scheduling: bool, empty_every: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        ktc = offload_config(cpu_bytes=host_blocks * 16384, record_trace=str(trace),
                             disk_dir=Path(tmp) if disk else None,
                             redis={"url": redis_url, "tenant_salt": f"example-{next(_SALTS)}"}
                             if redis else None)
        llm = make_llm(ktc, num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling)
        sched = llm.engine.scheduler
        budget = sched.config.max_num_batched_tokens
        schedule = sched.schedule

        def maybe_empty() -> object:  # every empty_every-th step schedules nothing
            if empty_every and sched.step_id % empty_every == 0:
                object.__setattr__(sched.config, "max_num_batched_tokens", 0)
            try:
                return schedule()
            finally:
                object.__setattr__(sched.config, "max_num_batched_tokens", budget)

        sched.schedule = maybe_empty  # type: ignore[method-assign]
        run_waves(llm, waves, aborts, PARAMS, trace, reference)


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def reference(prompt: list[int]) -> list[int]:
    if tuple(prompt) not in _REFERENCE:
        if "llm" not in _REFERENCE_LLM:
            _REFERENCE_LLM["llm"] = make_llm(enable_prefix_caching=False)
        out = _REFERENCE_LLM["llm"].generate([prompt], PARAMS, use_tqdm=False)
        _REFERENCE[tuple(prompt)] = out[0].outputs[0].token_ids
    return _REFERENCE[tuple(prompt)]


_REFERENCE_LLM: dict[str, object] = {}
