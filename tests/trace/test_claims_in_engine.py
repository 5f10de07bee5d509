"""The claim rules on traces kvport's engine records: its OffloadingConnector (a private host
tier: the recorder declares it sees all its stores) is judged and clean on prompts that repeat
after a reset, chunked by a small token budget; a planted connector that claims a prompt it saw
keyed by its first block alone claims prompts nobody computed, and is caught (C1) at the claim,
with its step and request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvport import LLM, SamplingParams
from kvport.connectors.noop import NoOpConnector
from kvport.connectors.views import RequestView
from kvport.trace.checker import analyze
from kvport.trace.events import HEADER, TraceHeader, read_events
from kvport.trace.identity import BLOCKS_MARKER

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class FirstBlockConnector(NoOpConnector):
    """Planted: keys what it "stores" by a prompt's first block alone (a key too short), so a
    prompt that starts like an earlier one is claimed whole; it loads nothing."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._seen: set[tuple[int, ...]] = set()

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids)
        first = tuple(prompt[:BLOCK])
        if first not in self._seen:
            self._seen.add(first)
            return 0, False
        return max(0, (len(prompt) - 1) // BLOCK * BLOCK - num_computed_tokens), False


def prompts(n: int = 4, length: int = 70) -> list[list[int]]:
    return [[(t * 7 + 13 * i) % 200 + 3 for t in range(length)] for i in range(n)]


def shared_first_block() -> list[list[int]]:
    """Prompts that start alike and go on differently."""
    return [prompts(1)[0][:BLOCK] + p[BLOCK:] for p in prompts()]


def record(tmp_path: Path, ktc: dict[str, Any], rounds: int,
           workload: list[list[int]] | None = None, **engine: Any) -> tuple[list[Any], Path]:
    trace = tmp_path / "trace.jsonl"
    ktc["kv_connector_extra_config"]["record_trace"] = str(trace)
    llm = LLM("builtin:tiny-llama", block_size=BLOCK, num_kv_blocks=64, max_model_len=128,
              kv_transfer_config=ktc, **engine)
    outs = []
    for _ in range(rounds):
        outs.append([o.outputs[0].token_ids for o in llm.generate(
            workload if workload is not None else prompts(), GREEDY, use_tqdm=False)])
        llm.reset_prefix_cache(reset_connector=False)  # the engine's cache: hits must be claims
    llm.engine.check_no_leaks()
    llm.shutdown()
    return outs, trace


def test_kvports_offloading_connector_is_judged_and_keeps_its_claims(tmp_path: Path) -> None:
    ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20}}
    outs, trace = record(tmp_path, ktc, rounds=3, max_num_batched_tokens=48)  # chunked
    assert outs[0] == outs[1] == outs[2]
    events = read_events(str(trace))
    check = analyze(events)
    assert check.violations == [] and check.notes == []
    claims = [e for e in events if e.method == "get_num_new_matched_tokens"
              and isinstance(e.result, list) and e.result[0]]
    assert len(claims) >= 4, "the repeats were claims, and judged"
    assert any(e.method == BLOCKS_MARKER for e in events)
    headers = [TraceHeader.from_event(e) for e in events if e.method == HEADER]
    assert headers and all(h.sees_all_stores for h in headers)  # a private host tier
    assert any(e.method == "build_connector_meta" and e.computed for e in events)


def test_a_connector_that_claims_what_it_was_only_asked_about_is_c1(tmp_path: Path) -> None:
    ktc = {"kv_connector": "FirstBlockConnector",
           "kv_connector_module_path": __name__, "kv_role": "kv_both",
           "kv_connector_extra_config": {"sees_all_stores": True}}
    _, trace = record(tmp_path, ktc, rounds=1, workload=shared_first_block(), max_num_seqs=1)
    check = analyze(read_events(str(trace)))
    c1 = [v for v in check.violations if v.rule == "C1"]
    assert c1, check.violations
    assert c1[0].req_id is not None and c1[0].step is not None
    assert "was never computed with this connector attached" in c1[0].message
