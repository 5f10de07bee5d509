"""Load rule C3: a load brings back the KV that was computed for its tokens.

C1 judges what a connector claims; C3 judges what its load wrote. A connector can claim only
blocks it was handed and still load wrong KV: a store that ran after the request's blocks were
freed and handed to another request (vLLM 46951: an offloader that fences only some
allocations), a store that reads before the forward that writes the block has finished, a key
that names another block. None of these crash anything; the request decodes from another
request's attention state.

The worker half of a recorder (kvport.vllm.recording_kv) keeps a fingerprint of every full block
the engine computes, by the block's engine hash, taken at the end of the step that completed it.
When a connector's load of a block has finished (a sync load at the end of its step, an async one
when get_finished reports the request), it fingerprints the block again and writes the relative
distance between the two:

    {"method": "trace_loaded", "req_ids": ["r1"], "ints": [FIRST_BLOCK],
     "result": {"block_ids": [...], "distances": [0.0, 0.0, null, ...]}}

One record per request load, at most MAX_BLOCKS_PER_RECORD blocks (identity.py). A distance is
`|a - b| / max(|a|, |b|)` (L2 norms) over the same sampled elements of the block in the first
layer; null when the block's tokens were never computed where the recorder saw them (a store
that started full) or its load failed (the engine recomputes it): not judged, counted in a note. Recomputing a block gives back its KV up to rounding (its first
layer depends only on the tokens and their positions), so a distance above MAX_DISTANCE means
another block's KV. """

from __future__ import annotations

from typing import Any

from kvport.trace.events import TraceEvent
from kvport.trace.findings import Findings

LOADED_MARKER = "trace_loaded"
# Far above rounding (recomputed blocks measure 0 to 1e-3 in float32 and bfloat16, docs/vllm.md),
# far below another block's KV (0.5 and more).
MAX_DISTANCE = 0.05


class LoadCheck:
    """C3 over one worker group's `trace_loaded` records."""

    def __init__(self, out: Findings) -> None:
        self.out = out
        self.judged = 0
        self.unjudged = 0
        self.bad_records: list[str] = []

    def event(self, pos: int, e: TraceEvent) -> None:
        if e.method != LOADED_MARKER:
            return
        result: Any = e.result
        distances = result.get("distances") if isinstance(result, dict) else None
        block_ids = result.get("block_ids") if isinstance(result, dict) else None
        if not e.req_ids or len(e.ints) != 1 or not isinstance(distances, list) or \
                not isinstance(block_ids, list) or len(block_ids) != len(distances):
            self.bad_records.append(f"record #{pos}: malformed {LOADED_MARKER} record")
            return
        rid, first = e.req_ids[0], e.ints[0]
        for k, (block_id, distance) in enumerate(zip(block_ids, distances)):
            if distance is None:
                self.unjudged += 1
                continue
            self.judged += 1
            if float(distance) > MAX_DISTANCE:
                j = first + k
                self.out.add(pos, "C3", e.step, rid,
                             f"the load of block {j} (engine block {block_id}) left KV at "
                             f"distance {float(distance):.3g} from the KV computed for its "
                             f"tokens (at most {MAX_DISTANCE} is rounding): the store read "
                             "another block, or the key names one")
                return  # one finding per load: the rest of it is the same story

    def notes(self) -> list[str]:
        out = list(self.bad_records)
        if self.unjudged:
            out.append(f"{self.out.where}: {self.unjudged} loaded block(s) not judged (C3): their "
                       "tokens never computed in this run, or their load failed")
        return out


def check_loads(group: list[tuple[int, TraceEvent]], out: Findings) -> list[str]:
    """C3 over one worker group; returns the notes (what was not judged, and why)."""
    check = LoadCheck(out)
    for pos, e in group:
        check.event(pos, e)
    return check.notes()
