"""Plain-text tables for what tfpar prints (plans, analyses); no TensorFlow."""
from __future__ import annotations

from typing import Sequence


def format_table(rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns with a rule under the header row."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
