"""Shared pieces of the OffloadingConnector engine tests: configs, prompts, the leak check."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvport import LLM, SamplingParams
from kvport.connectors.offloading.connector import OffloadingConnector
from kvport.connectors.offloading.scheduler.half import OffloadingScheduler
from kvport.connectors.offloading.worker.half import OffloadingConnectorWorker

BLOCK_SIZE = 4  # engine block (tokens)
OFFLOAD_BLOCK = 8  # two engine blocks per offload block: partial first blocks get exercised
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "async": {"async_scheduling": True},
    "process": {"worker": "process"},
}


def offload_config(cpu_bytes: int = 16 << 20, disk_dir: Path | None = None,
                   disk_bytes: int = 64 << 20, redis: dict[str, Any] | None = None,
                   kv_role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """`redis`: the Redis tier's entry without "type" (at least {"url": ...})."""
    cfg: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "block_size": OFFLOAD_BLOCK, **extra}
    tiers: list[dict[str, Any]] = []
    if disk_dir is not None:
        tiers.append({"type": "disk", "root_dir": str(disk_dir), "max_bytes": disk_bytes})
    if redis is not None:
        tiers.append({"type": "redis", **redis})
    if tiers:
        cfg["secondary_tiers"] = tiers
    return {"kv_connector": "OffloadingConnector", "kv_role": kv_role,
            "kv_connector_extra_config": cfg}


def make_llm(kv_transfer_config: dict[str, Any] | None = None, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 48)
    kwargs.setdefault("max_model_len", 128)
    return LLM("builtin:tiny-llama", block_size=BLOCK_SIZE,
               kv_transfer_config=kv_transfer_config, **kwargs)


def prompts(n: int = 6, length: int = 61, seed: int = 0) -> list[list[int]]:
    """n prompts; pairs share a 40-token prefix; lengths not aligned to any block."""
    out = []
    for i in range(n):
        base = [(t * 37 + 11 * (i // 2) + seed * 101) % 250 + 3 for t in range(length)]
        out.append(base[:40] + [(t * 13 + i) % 250 + 3 for t in range(length - 40 - i)])
    return out


MAX_STEPS = 500  # scenario tests step the engine at most this often between checks


def step_until(llm: LLM, done: Callable[[], bool], max_steps: int = MAX_STEPS) -> None:
    """Step the engine until done() (checked before each step); a bound instead of a hang."""
    for _ in range(max_steps):
        if done():
            return
        llm.engine.step()
    raise AssertionError(f"not done after {max_steps} steps")


def run_bounded(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY,
                ) -> list[list[int]]:
    """generate() with a step bound: the requests' output tokens once nothing is pending."""
    reqs = [llm.engine.add_request(f"bounded-{i}", p, params) for i, p in enumerate(ps)]
    step_until(llm, lambda: not llm.engine.has_pending_work())
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return [list(r.output_token_ids) for r in reqs]


def run(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY,
        ) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(ps, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def run_one_by_one(llm: LLM, ps: list[list[int]] | None = None, params: SamplingParams = GREEDY,
                   ) -> tuple[list[list[int]], list[int]]:
    """Each prompt (default prompts()) in a generate() of its own. In a batch, a request whose
    prefix another request is promoting waits for that load and takes the blocks from the
    engine's prefix cache (or computes them, if the load fails or is late); one at a time, each
    request loads every hit the tiers hold itself."""
    tokens, cached = [], []
    for p in ps if ps is not None else prompts():
        t, c = run(llm, [p], params)
        tokens += t
        cached += c
    return tokens, cached


def all_blocks_hit(cached: list[int]) -> bool:
    """Every full offload block of every prompt was a hit, but for the one holding the prompt's
    last token when it is full: a hit leaves that token to compute (a synchronous one leaves
    its whole block, as the engine's own prefix cache does)."""
    return all(c >= (len(p) - 1) // OFFLOAD_BLOCK * OFFLOAD_BLOCK
               for c, p in zip(cached, prompts(), strict=True))


def offloading_half(llm: LLM) -> OffloadingScheduler:
    connector = llm.engine.scheduler.connector
    connector = getattr(connector, "inner", connector)  # unwrap a trace recorder
    assert isinstance(connector, OffloadingConnector), connector
    return connector.scheduler_half


def keys_per_group(llm: LLM, num_groups: int) -> list[int]:
    """Host-tier keys per KV cache group (a key of several groups ends with its group's index)."""
    counts = [0] * num_groups
    for key, _ in offloading_half(llm).manager._blocks():
        counts[int.from_bytes(key[-4:], "little")] += 1
    return counts


def worker_half(llm: LLM) -> OffloadingConnectorWorker:
    """The worker half of an in-process engine's connector."""
    connector = llm.engine.runner.driver.connector  # type: ignore[union-attr]
    connector = getattr(connector, "inner", connector)  # unwrap a trace recorder
    assert isinstance(connector, OffloadingConnector), connector
    return connector.worker_half


def assert_nothing_leaked(llm: LLM) -> None:
    """No block, slot, pin, job or wait left behind, and the engine corrected no answer of the
    connector and caught no exception of its hooks: where vLLM would crash, a scenario fails."""
    llm.engine.check_no_leaks()
    offloading_half(llm).check_no_leaks()
    stats = llm.engine.scheduler.xfer.stats
    assert (stats.num_bad_answers, stats.num_hook_errors) == (0, 0), \
        f"corrected answers {stats.num_bad_answers}, hook errors {stats.num_hook_errors}"
    assert offloading_half(llm).stats.num_mismatched_hashes == 0  # the check never misfires


@functools.cache
def offload_block_bytes() -> int:
    """Bytes of one offload block (OFFLOAD_BLOCK tokens) of make_llm()'s model."""
    spec = make_llm().engine.runner.kv_cache_spec
    return spec.block_bytes * (OFFLOAD_BLOCK // spec.block_size)


def host_metrics(llm: LLM) -> dict[str, Any]:
    return llm.get_metrics()["connector"]["requests"]


def run_waves(llm: LLM, waves: list[list[list[int]]], aborts: set[int],
              params: SamplingParams, trace: Path,
              reference: Callable[[list[int]], list[int]]) -> None:
    """A generated schedule: each wave's prompts added, six steps, requests named in `aborts`
    aborted at the third; then every request drained. Nothing leaks, the trace is clean, and
    every request not aborted gives `reference(prompt)`."""
    from kvport.trace.checker import check_file

    engine = llm.engine
    requests, n = {}, 0
    for wave in waves:
        for prompt in wave:
            requests[str(n)] = (prompt, engine.add_request(str(n), prompt, params))
            n += 1
        for step in range(6):
            engine.step()
            engine.abort_requests([rid for rid in requests if int(rid) in aborts and step == 2])
    step_until(llm, lambda: not engine.has_pending_work(), max_steps=3000)
    assert_nothing_leaked(llm)
    llm.shutdown()
    assert check_file(str(trace)) == []
    for rid, (prompt, req) in requests.items():
        if req.status.name != "FINISHED_ABORTED":
            assert req.output_token_ids == reference(prompt), rid
