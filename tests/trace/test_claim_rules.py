"""Claim rules C1 and C2 on hand-made traces: a claim is judged against the blocks the connector
was handed (every full block some request computed, by the end of an earlier step), by the
engine's hash; a claim of blocks whose tokens were handed under another salt or LoRA is C2; a
connector whose store others may write is not judged, and says so in a note."""

from __future__ import annotations

import hashlib
from typing import Any

from kvport.trace.checker import RULES, analyze
from kvport.trace.events import HEADER, SCHEDULER, STEP_MARKER, TraceEvent, TraceHeader
from kvport.trace.identity import (
    BLOCKS_MARKER, BlockLog, RequestBlocks, block_records, salt_digest, short_hash,
)
from kvport.trace.profiles import COMMON_WHY
from kvport.trace.report import text_report

BS = 4  # block size of the hand-made requests


class Trace:
    """A scheduler group's records, built call by call."""

    def __init__(self, sees_all_stores: bool = True) -> None:
        self.events: list[TraceEvent] = []
        self.step = 0
        header = TraceHeader("vllm", "0.32.0", "vllm-0.32", sees_all_stores)
        self._add(HEADER, None, result=header.to_result())
        self.log = BlockLog(lambda r: (r["hashes"], r["tokens"], r.get("salt"), r.get("lora"),
                                       BS))

    def _add(self, method: str, step: int | None, **fields: Any) -> None:
        self.events.append(TraceEvent(len(self.events), 1, SCHEDULER, "C", step, method,
                                      **fields))

    def next_step(self) -> None:
        self.step += 1
        self._add(STEP_MARKER, self.step)

    def request(self, rid: str, tokens: list[int], salt: str | None = None,
                lora: str | None = None) -> None:
        """The engine's hashes depend on the salt and LoRA, as vLLM's do."""
        hashes = [hashlib.sha256(f"{salt}|{lora}|{tokens[:(j + 1) * BS]}".encode()).digest()
                  for j in range(len(tokens) // BS)]
        request = {"hashes": hashes, "tokens": tokens, "salt": salt, "lora": lora}
        for fields in self.log.seen(rid, request):
            self._add(BLOCKS_MARKER, self.step, **fields)

    def claim(self, rid: str, local: int, tokens: int) -> None:
        self._add("get_num_new_matched_tokens", self.step, req_ids=[rid], ints=[local],
                  result=[tokens, False])

    def build(self, computed: dict[str, int]) -> None:
        ids = sorted(computed)
        self._add("build_connector_meta", self.step, req_ids=ids, ints=[sum(computed.values())],
                  computed=[computed[r] for r in ids])

    def check(self) -> tuple[list[str], list[str]]:
        result = analyze(self.events)
        return [v.rule for v in result.violations], result.notes


PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks and one token


def computed_whole(t: Trace, rid: str, tokens: list[int], **kw: Any) -> None:
    t.next_step()
    t.request(rid, tokens, **kw)
    t.claim(rid, 0, 0)
    t.build({rid: len(tokens)})


def test_a_claim_of_blocks_computed_earlier_is_clean() -> None:
    t = Trace()
    computed_whole(t, "a", PROMPT)
    t.next_step()
    t.request("b", PROMPT)
    t.claim("b", 0, 16)  # every full block
    t.build({"b": 17})
    assert t.check() == ([], [])


def test_a_claim_beyond_the_first_chunk_of_a_chunked_prompt_is_c1() -> None:
    """The ExampleConnector's bug: it stored what the first chunk computed, and claims the
    whole prompt for a request with the same prompt arriving while the rest is computed."""
    t = Trace()
    t.next_step()
    t.request("a", PROMPT)
    t.claim("a", 0, 0)
    t.build({"a": 8})  # the first chunk: 2 blocks
    t.next_step()
    t.request("b", PROMPT)
    t.claim("b", 0, 16)
    t.build({"a": 16, "b": 17})
    rules, _ = t.check()
    assert rules == ["C1"]
    (v,) = analyze(t.events).violations
    assert v.req_id == "b" and v.step == 2
    assert "block 2 (tokens [8, 12)) was never computed" in v.message


def test_the_block_a_claim_ends_inside_and_the_local_blocks_are_not_judged() -> None:
    t = Trace()
    computed_whole(t, "a", PROMPT[:8])  # two blocks
    t.next_step()
    t.request("b", PROMPT)
    t.claim("b", 8, 3)  # local blocks 0-1 (not the connector's), then 3 tokens of block 2
    t.build({"b": 17})
    assert t.check() == ([], [])


def test_a_hit_across_a_salt_is_c2_and_names_both() -> None:
    t = Trace()
    computed_whole(t, "a", PROMPT, salt="tenant-a")
    t.next_step()
    t.request("b", PROMPT, salt="tenant-b")
    t.claim("b", 0, 16)
    t.build({"b": 17})
    violations = analyze(t.events).violations
    assert [v.rule for v in violations] == ["C2"]
    message = violations[0].message
    assert f"salt {salt_digest('tenant-a')}" in message
    assert f"salt {salt_digest('tenant-b')}" in message
    assert "tenant-a" not in message and "tenant-b" not in message  # a salt is a secret


def repeated_without(**first: str) -> Trace:
    """PROMPT computed under `first` (a salt or a LoRA), then claimed whole without it."""
    t = Trace()
    computed_whole(t, "a", PROMPT, **first)
    t.next_step()
    t.request("b", PROMPT)
    t.claim("b", 0, 16)
    t.build({"b": 17})
    return t


def test_a_hit_across_a_lora_is_c2() -> None:
    assert repeated_without(lora="sql").check()[0] == ["C2"]


def test_a_store_others_may_write_is_not_judged_and_a_note_says_so() -> None:
    t = Trace(sees_all_stores=False)
    t.next_step()
    t.request("b", PROMPT)
    t.claim("b", 0, 16)  # stored by another process, maybe
    t.build({"b": 17})
    rules, notes = t.check()
    assert rules == []
    assert len(notes) == 1 and "not judged (C1, C2)" in notes[0]


def test_a_request_without_hashes_is_not_judged() -> None:
    t = Trace()
    computed_whole(t, "a", PROMPT)
    t.next_step()
    t.claim("x", 0, 16)
    t.build({"x": 17})
    rules, notes = t.check()
    assert rules == [] and "without block hashes" in notes[0]


def test_blocks_are_recorded_once_in_bounded_records() -> None:
    tokens = list(range(4 * 100))
    state = RequestBlocks()
    hashes = [bytes([j % 256]) * 32 for j in range(100)]
    first = list(block_records("r", state, hashes[:60], tokens, 4, "s", None))
    assert [r["ints"] for r in first] == [[0, 4], [48, 4]]  # at most 48 blocks a record
    again = list(block_records("r", state, hashes, tokens, 4, "s", None))
    assert [r["ints"] for r in again] == [[60, 4]]
    assert again[0]["result"]["hashes"][0] == short_hash(hashes[60])
    assert list(block_records("r", state, hashes, tokens, 4, "s", None)) == []
    # content hashes depend on the tokens and the chain only
    other = RequestBlocks()
    list(block_records("q", other, [b"x"] * 2, tokens[:8], 4, None, "lora"))
    assert other.contents == state.contents[:2]


def test_the_rules_have_their_text_and_why() -> None:
    assert "C1" in RULES and "C2" in RULES
    assert "16928" in COMMON_WHY["C1"] and "53495" in COMMON_WHY["C2"]
    t = repeated_without(salt="x")
    lines = text_report("t.jsonl", t.events, analyze(t.events))
    assert any(line.startswith("C2: 1 violation") for line in lines)
    assert any("why: a hit across a salt" in line for line in lines)
