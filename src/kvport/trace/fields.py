"""What a record holds for the calls kvport's and vLLM's connector APIs share, spelled once, so
both recorders write the same record for the same call (kvport.trace.events names the fields;
the checker's rules read them). Arguments are taken by what they are, not by either API's types.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvport.trace.writer import Record


def sorted_ids(ids: Iterable[str] | None) -> list[str]:
    return sorted(ids) if ids else []


def request_fields(req_id: str, ints: list[int] | None = None,
                   block_ids: Sequence[int] | Sequence[Sequence[int]] | None = None) -> Record:
    """A scheduler call about one request: its id, its integer arguments, its block count (and
    per KV cache group, where the argument holds a table per group)."""
    fields: Record = {"req_ids": [req_id]}
    if ints is not None:
        fields["ints"] = ints
    if block_ids is not None:
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            per_group = [len(table) for table in block_ids]  # type: ignore[arg-type]
            fields["num_blocks"] = sum(per_group)
            if len(per_group) > 1:
                fields["group_blocks"] = per_group
        else:
            fields["num_blocks"] = len(block_ids)
    return fields


def schedule_fields(scheduled: Mapping[str, int], total_num_scheduled_tokens: int,
                    computed_before: Mapping[str, int] | None = None) -> Record:
    """build_connector_meta: the step's scheduled requests (id -> tokens scheduled), its token
    count and, when the caller knows each request's tokens computed before the step, their
    tokens computed by its end (the claim rules' "handed for saving")."""
    ids = sorted(scheduled)
    fields: Record = {"req_ids": ids, "ints": [total_num_scheduled_tokens]}
    if computed_before is not None and all(r in computed_before for r in ids):
        fields["computed"] = [computed_before[r] + scheduled[r] for r in ids]
    return fields


def output_fields(finished_sending: Iterable[str] | None, finished_recving: Iterable[str] | None,
                  invalid_block_ids: Iterable[int] | None) -> Record:
    """update_connector_output: what the worker reported for the step."""
    sending, recving = sorted_ids(finished_sending), sorted_ids(finished_recving)
    return {"req_ids": sorted(set(sending) | set(recving)), "finished_sending": sending,
            "finished_recving": recving, "invalid_block_ids": sorted(invalid_block_ids or ())}


def finished_result(out: tuple[Iterable[str] | None, Iterable[str] | None]) -> list[list[str]]:
    """get_finished's answer: [finished sending, finished receiving]."""
    return [sorted_ids(out[0]), sorted_ids(out[1])]


def matched_result(out: tuple[int | None, bool]) -> list[Any]:
    """get_num_new_matched_tokens' answer: [tokens, is_async]."""
    return [out[0], bool(out[1])]


def kept_result(out: tuple[bool, Any]) -> bool:
    """request_finished's answer: whether the connector keeps the request's blocks."""
    return bool(out[0])
