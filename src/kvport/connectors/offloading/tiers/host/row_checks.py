"""Bounds checks of the (engine block, host row) pairs a copy moves, before any byte moves.

The C copy (block_copy.c) checks every pair itself. The Python strategies check here: numpy's
`take(mode="clip")` would copy the last row for an id past the end, fancy indexing and torch
slices wrap a negative id or cut a run short, so an id out of range would silently move the
wrong block (or raise halfway, with part of a job copied). A whole job is checked before its
first copy; an id out of range raises `IdOutOfRangeError` naming the pair, the id and the bound.
"""

from __future__ import annotations

from collections.abc import Sequence


class IdOutOfRangeError(ValueError, IndexError):
    """A block, row or slot id outside its pool or tier. A ValueError (a bad argument) and an
    IndexError (what indexing raises), so callers catching either see it."""


def first_bad_pair(a: Sequence[int], num_a: int, b: Sequence[int], num_b: int) -> int:
    """The first i with a[i] outside [0, num_a) or b[i] outside [0, num_b), else -1."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} ids pair with {len(b)}: a copy moves pairs of ids")
    if not a or (min(a) >= 0 and max(a) < num_a and min(b) >= 0 and max(b) < num_b):
        return -1  # the common case: four builtin passes, no Python loop
    return next(i for i, (x, y) in enumerate(zip(a, b))
                if not (0 <= x < num_a and 0 <= y < num_b))


def pair_error(block_ids: Sequence[int], num_blocks: int, row_ids: Sequence[int], num_rows: int,
               bad: int) -> IdOutOfRangeError:
    """The error for pair `bad` of an (engine block, host row) copy."""
    return IdOutOfRangeError(
        f"engine block {block_ids[bad]} <-> host row {row_ids[bad]} (pair {bad}): out of range, "
        f"the pool has {num_blocks} blocks and the tier {num_rows} rows")


def check_pairs(block_ids: Sequence[int], num_blocks: int, row_ids: Sequence[int],
                num_rows: int) -> None:
    """Raise IdOutOfRangeError unless every engine block id is in [0, num_blocks) and every
    host row id in [0, num_rows) (ValueError if the two lists differ in length)."""
    bad = first_bad_pair(block_ids, num_blocks, row_ids, num_rows)
    if bad >= 0:
        raise pair_error(block_ids, num_blocks, row_ids, num_rows, bad)


def check_rows(src_rows: Sequence[int], num_src: int, dst_rows: Sequence[int],
               num_dst: int) -> None:
    """check_pairs for a copy between two row tensors (neither side named a pool)."""
    bad = first_bad_pair(src_rows, num_src, dst_rows, num_dst)
    if bad >= 0:
        raise IdOutOfRangeError(
            f"source row {src_rows[bad]} -> destination row {dst_rows[bad]} (pair {bad}): out "
            f"of range, the source has {num_src} rows and the destination {num_dst}")
