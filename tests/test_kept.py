"""Which published checkpoints stay pinned in a spoke's cache (spoke.kept.LastN): policy
without I/O, fed commits as the hub publishes them."""

from __future__ import annotations

import json
from pathlib import Path

from spokefs.spoke.kept import Commit, LastN
from spokefs.spoke.writeback import read_done


def _commit(ds: str, name: str, blocks: int, size: int = 10) -> Commit:
    return Commit(ds, name, {(f"{name}-v", i): size for i in range(blocks)})


def test_the_last_n_of_each_dataset_stay_pinned() -> None:
    last = LastN(keep=2, limit=1000)
    pin, unpin = last.published(_commit("a", "c1", 3))
    assert len(pin) == 3 and unpin == []
    last.published(_commit("a", "c2", 3))
    last.published(_commit("b", "x1", 2))
    pin, unpin = last.published(_commit("a", "c3", 1))
    assert pin == [("c3-v", 0)] and sorted(unpin) == [("c1-v", i) for i in range(3)]
    assert last.kept("a") == ["c2", "c3"] and last.kept("b") == ["x1"]
    assert last.pinned_bytes == (3 + 2 + 1) * 10


def test_a_commit_told_twice_is_pinned_once() -> None:
    last = LastN(keep=2, limit=1000)
    last.published(_commit("a", "c1", 3))
    assert last.published(_commit("a", "c1", 3)) == ([], [])
    assert last.pinned_bytes == 30


def test_pins_stay_within_their_share_of_the_cache() -> None:
    last = LastN(keep=3, limit=100)
    last.published(_commit("a", "c1", 4))   # 40
    last.published(_commit("b", "x1", 4))   # 80
    pin, unpin = last.published(_commit("a", "c2", 4))  # 120 > 100: the oldest gives way
    assert len(pin) == 4 and len(unpin) == 4
    assert last.pinned_bytes <= 100
    # One larger than the whole share: cached, not pinned, and nothing let go for it.
    before = last.pinned_bytes
    assert last.published(_commit("a", "huge", 11)) == ([], [])
    assert last.pinned_bytes == before


def test_keep_zero_pins_nothing() -> None:
    assert LastN(keep=0, limit=100).published(_commit("a", "c1", 2)) == ([], [])


def test_a_commit_recorded_twice_by_a_crash_is_listed_once_as_its_last_line(
        tmp_path: Path) -> None:
    # A spoke killed after done.jsonl's line but before the journal was retired publishes the
    # commit again at restart (the hub has it already) and writes a second line; status and
    # the re-pinning read each commit once, and a torn or foreign line is skipped.
    done = tmp_path / "done.jsonl"
    lines = [{"commit": "c1", "snapshot": "s1"}, {"commit": "c2", "snapshot": "s2"},
             {"commit": "c1", "snapshot": "s1", "again": True}]
    done.write_text("\n".join(json.dumps(x) for x in lines) + "\n[1]\n{\"commit\": \"c3\"")
    got = read_done(done)
    assert [d["commit"] for d in got] == ["c1", "c2"]
    assert got[0].get("again") is True
    assert read_done(tmp_path / "missing.jsonl") == []
