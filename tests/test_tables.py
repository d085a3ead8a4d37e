"""``spokefs.tables.table``: the plain tables of the command line and the benchmarks (rich lays
them out; the text must stay plain and the same whatever the terminal)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spokefs.tables import table


def test_layout_first_column_left_others_right_floats_rounded() -> None:
    text = table([["imagenet", 3.14159, 12345.6, "done"], ["a", 7, 0.001, "-"]],
                 ["dataset", "x", "bytes", "state"])
    assert text.split("\n") == [
        "dataset      x  bytes  state",
        "--------- ----- ------ -----",
        "imagenet  3.14  12346   done",
        "a            7  0.001      -",
    ]


def test_cells_are_shown_as_they_are() -> None:
    # Not rich markup, not emoji codes, no colour, no wrapping of a long cell.
    long = "x" * 300
    text = table([["[bold]a[/bold]", ":smile:", long]], ["name", "note", "long"])
    assert "[bold]a[/bold]" in text and ":smile:" in text and long in text
    assert "\x1b" not in text and text.isascii()
    assert all(line == line.rstrip() for line in text.split("\n"))
    assert table([], ["a", "b"]).split("\n")[0] == "a  b"


def test_a_narrow_terminal_changes_nothing() -> None:
    code = ("from spokefs.tables import table; "
            "print(table([['a' * 50, 'b' * 50]], ['first', 'second']))")
    wide = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={"COLUMNS": "300", "PATH": ""}).stdout
    narrow = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={"COLUMNS": "20", "PATH": ""}).stdout
    assert wide == narrow and "a" * 50 + "  " + "b" * 50 in narrow


def test_rows_must_match_the_header() -> None:
    with pytest.raises(ValueError, match="2 cells under a header of 3"):
        table([[1, 2]], ["a", "b", "c"])


def test_importing_tables_does_not_import_rich() -> None:
    # Commands that print no table must not pay rich's import.
    code = "import sys, spokefs.tables; print('rich' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
