"""Hypothesis strategies for conformance workloads (workload.WorkloadPlan).

What they draw is what breaks connectors in the field: prompts that share prefixes of one or
several 128-token blocks or end inside one (segments of block-multiple and odd lengths), a
prompt arriving again while an earlier copy is still being prefilled in chunks (arrival steps
close together under a small token budget), the same tokens under two cache_salts (and, when the
engine has adapters, under LoRA adapters), aborts,
reset_prefix_cache() with and without preempting the running requests, and more requests than
a small KV pool holds (preemption). Hypothesis shrinks towards fewer requests, fewer and shorter
segments, earlier arrivals and no resets, aborts or salts: a shrunk failing workload names only
what the failure needs.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from kvport.conformance.workload import RESETS, RequestPlan, WorkloadPlan

# Segment lengths: whole blocks of vLLM's CPU build (128 tokens), and lengths ending inside one.
_LENGTHS = st.one_of(st.sampled_from([128, 256, 384, 512]), st.integers(1, 520))
MAX_STEPS = 6  # arrival steps 0..MAX_STEPS-1


@st.composite
def request_plans(draw: st.DrawFn, prompts: list[tuple[int, ...]], loras: int = 0) -> RequestPlan:
    plan = RequestPlan(
        segments=draw(st.sampled_from(prompts)),
        arrive=draw(st.integers(0, MAX_STEPS - 1)),
        max_tokens=draw(st.integers(1, 6)),
        salt=draw(st.sampled_from([0, 1, 2])),
        abort_after=draw(st.none() | st.integers(1, 4)))
    # Drawn only with adapters, so that a run without them draws what it always drew.
    return replace(plan, lora=draw(st.integers(0, loras))) if loras else plan


@st.composite
def workload_plans(draw: st.DrawFn, max_requests: int = 6, loras: int = 0) -> WorkloadPlan:
    lengths = tuple(draw(st.lists(_LENGTHS, min_size=1, max_size=3)))
    segment = st.integers(0, len(lengths) - 1)
    # A few prompts, each a list of segments starting with segment 0 or another: requests
    # repeat whole prompts (what a connector keyed by the prompt hits) and share prefixes.
    prompts = draw(st.lists(st.tuples(st.just(0) | segment).flatmap(
        lambda first: st.lists(segment, max_size=2).map(lambda rest: first + tuple(rest))),
        min_size=1, max_size=3))
    requests = tuple(draw(st.lists(request_plans(prompts, loras), min_size=1,
                                   max_size=max_requests)))
    # Resets between arrivals: what makes a later request miss vLLM's own prefix cache and ask
    # the connector.
    resets = tuple(draw(st.lists(st.tuples(st.integers(1, MAX_STEPS), st.sampled_from(RESETS)),
                                 max_size=3, unique_by=lambda r: r[0])))
    return WorkloadPlan(lengths, requests, resets, extra_steps=draw(st.integers(0, 2)))
