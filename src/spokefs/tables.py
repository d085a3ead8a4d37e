"""Plain-text tables for the command line and the benchmarks."""

from __future__ import annotations

from typing import Any


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
