"""Plain-text tables of the benchmarks' reports: columns padded to their widest cell."""

from __future__ import annotations

from collections.abc import Sequence


def table_lines(rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """One line per row; the first `left` columns left-aligned (names), the others right-aligned
    (numbers), two spaces between columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
