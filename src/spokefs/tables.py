"""Plain-text tables for the command line and the benchmarks, laid out by rich.

The output is for people and for scripts alike (``spokefs inventory``, ``spokefs top
--once``, benchmark summaries): ASCII only, no colour, no wrapping, whatever the terminal, so
the same rows always print the same text. rich is imported on the first table, not with this
module: commands that print no table do not pay for it.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.box import Box

__all__ = ["table"]

# Wide enough never to wrap a row: the table is as wide as its content, not the console.
_WIDTH = 100_000
_box: Box | None = None


def _plain_box() -> Box:
    """Columns apart by spaces, a rule of dashes under the header, nothing else."""
    global _box
    if _box is None:
        from rich.box import Box

        # Eight rows of four (left, line, divider, right): top, head, head row, mid, row,
        # foot row, foot, bottom. Only the head row draws anything.
        _box = Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)
    return _box


def table(rows: list[list[Any]], header: list[str]) -> str:
    """``rows`` under ``header``: the first column left-aligned, the others right-aligned;
    floats to three significant figures (whole numbers from 1000 up)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    for r in rows:
        if len(r) != len(header):
            raise ValueError(f"a row of {len(r)} cells under a header of {len(header)}: {r!r}")
    t = Table(box=_plain_box(), show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
              collapse_padding=True)
    for i, h in enumerate(header):
        t.add_column(Text(str(h)), justify="right" if i else "left", no_wrap=True)
    for r in rows:
        # Text, not str: a cell is shown as it is ("[x]" is no markup, ":x:" no emoji).
        t.add_row(*(Text(_fmt(c)) for c in r))
    out = io.StringIO()
    Console(file=out, width=_WIDTH, color_system=None, force_terminal=False,
            force_jupyter=False, legacy_windows=False, emoji=False, markup=False,
            highlight=False, soft_wrap=False).print(t)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").split("\n"))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
