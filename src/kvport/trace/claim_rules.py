"""Claim rules C1, C2: what a connector claims against what it was handed.

Read per scheduler connector group in file order, from three kinds of records:

- `trace_blocks` (identity.py): each request's blocks, by the engine's hash and by their tokens,
  with the request's salt digest and LoRA;
- `build_connector_meta` with `computed`: each scheduled request's tokens computed by the end of
  the step. Every full block below that is "handed" to the connector (vLLM gives a connector every
  token it computes, to save or not), under its engine hash;
- `get_num_new_matched_tokens` (ints [local tokens], result [tokens, is_async]): a claim of the
  tokens after the local ones.

C1: every full block a claim covers was handed in an earlier build (a connector that stored only
the first chunk of a chunked prompt, or nothing, claims beyond it); the block the claim ends
inside is not judged (the engine never hashes a partial block). C2: the more specific finding
when such a block's tokens were handed, but under another salt or LoRA: a hit keyed by tokens
alone crossed a tenant's boundary.

What was handed only says what the connector's store can hold if it started empty and nothing
else writes it. A recorder declares that (`sees_all_stores` in its header); without it the claims
beyond this run's blocks are counted in a note, not reported as violations. A request without
block hashes (prefix caching off) is not judged either.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvport.trace.events import TraceEvent
from kvport.trace.findings import Findings
from kvport.trace.identity import BLOCKS_MARKER, BlockNames, read_blocks


@dataclass(frozen=True)
class _Handed:
    step: int | None
    req_id: str
    salt: str | None
    lora: str | None


class ClaimCheck:
    def __init__(self, out: Findings, judged: bool) -> None:
        self.out = out
        self.judged = judged  # the header's sees_all_stores
        self.names: dict[str, BlockNames] = {}
        self.done: dict[str, int] = {}  # req_id -> its blocks handed so far
        self.by_hash: dict[str, _Handed] = {}  # engine hash -> where it was first handed
        self.by_content: dict[str, _Handed] = {}  # content hash -> where it was first handed
        self.unjudged = 0  # claims beyond what was handed, not reported (not judged)
        self.unnamed = 0  # claims of requests without block hashes
        self.bad_records: list[str] = []

    def event(self, pos: int, e: TraceEvent) -> None:
        rid = e.req_ids[0] if e.req_ids else None
        if e.method == BLOCKS_MARKER and rid is not None:
            problem = read_blocks(self.names, rid, e.ints, e.result)
            if problem is not None:
                self.bad_records.append(f"record #{pos}: {problem}")
        elif e.method == "build_connector_meta" and e.computed:
            for req_id, end in zip(e.req_ids, e.computed):
                self._hand(req_id, end, e.step)
        elif e.method == "get_num_new_matched_tokens" and rid is not None:
            self._claim(pos, e, rid)

    def _hand(self, req_id: str, end: int, step: int | None) -> None:
        names = self.names.get(req_id)
        if names is None:
            return
        full = min(end // names.block_size, len(names.hashes))
        for j in range(self.done.get(req_id, 0), full):
            where = _Handed(step, req_id, names.salt, names.lora)
            self.by_hash.setdefault(names.hashes[j], where)
            self.by_content.setdefault(names.contents[j], where)
        self.done[req_id] = max(self.done.get(req_id, 0), full)

    def _claim(self, pos: int, e: TraceEvent, rid: str) -> None:
        answer = e.result if isinstance(e.result, list) and len(e.result) == 2 else [None, None]
        tokens = answer[0]
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            return
        local = e.ints[0] if e.ints else 0
        names = self.names.get(rid)
        if names is None or not names.hashes:
            self.unnamed += 1
            return
        bs = names.block_size
        first, end = -(-local // bs), min((local + tokens) // bs, len(names.hashes))
        for j in range(first, end):
            if names.hashes[j] in self.by_hash:
                continue
            if not self.judged:
                self.unjudged += 1
                return
            claim = f"claims tokens [{local}, {local + tokens})"
            other = self.by_content.get(names.contents[j])
            if other is not None and (other.salt, other.lora) != (names.salt, names.lora):
                self.out.add(pos, "C2", e.step, rid, f"{claim}; block {j} holds the tokens "
                             f"request {other.req_id} computed in step {other.step} under "
                             f"{_identity(other.salt, other.lora)}, and this request has "
                             f"{_identity(names.salt, names.lora)}")
            else:
                self.out.add(pos, "C1", e.step, rid,
                             f"{claim}; block {j} (tokens [{j * bs}, {(j + 1) * bs})) was never "
                             "computed with this connector attached: it cannot hold its KV")
            return

    def notes(self) -> list[str]:
        out = list(self.bad_records)
        if self.unjudged:
            out.append(f"{self.where()}: {self.unjudged} claim(s) went beyond the blocks this "
                       "run handed to the connector; not judged (C1, C2): its store may hold "
                       "what others wrote (a recorder declares sees_all_stores when it does not)")
        if self.unnamed and self.names:  # a recorder of identities (older traces have none)
            out.append(f"{self.where()}: {self.unnamed} claim(s) of requests without block "
                       "hashes (prefix caching off?): not judged (C1, C2)")
        return out

    def where(self) -> str:
        return self.out.where


def _identity(salt: str | None, lora: str | None) -> str:
    parts = [f"salt {salt}" if salt else "no salt", f"LoRA {lora!r}" if lora else "no LoRA"]
    return ", ".join(parts)


def check_claims(group: list[tuple[int, TraceEvent]], out: Findings, judged: bool) -> list[str]:
    """C1, C2 over one scheduler group; returns the notes (what was not judged, and why)."""
    check = ClaimCheck(out, judged)
    for pos, e in group:
        check.event(pos, e)
    return check.notes()
