"""``spokefs bench node`` on tiny datasets: every tool and state it is asked for runs, each
file's bytes are checked (--verify), and results.json has the documented shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from spokefs.mount.process import fuse_unusable
from spokefs_bench import node


@pytest.mark.skipif(fuse_unusable() is not None, reason=f"no FUSE: {fuse_unusable()}")
def test_node_tiny(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    node.register(parser.add_subparsers())
    out = tmp_path / "out"
    args = parser.parse_args([
        "node", "--out", str(out), "--work-dir", str(tmp_path / "work"), "--verify",
        "--small-files", "30", "--small-size", "16KiB", "--large-files", "2",
        "--large-size", "5MiB", "--readers", "3", "--tools", "local,spokefs",
        "--timeout", "60s"])
    assert args.func(args) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["params"]["datasets"] == {"small": {"files": 30, "bytes": 30 * 16 * 1024},
                                         "large": {"files": 2, "bytes": 2 * 5 * 2**20}}
    got = {(r["tool"], r["dataset"], r["state"]): r for r in doc["results"]}
    want = {(t, d, s) for d in ("small", "large") for t, s in (
        ("local", "cold"), ("local", "warm"), ("spokefs", "cold"), ("spokefs", "warm"),
        ("spokefs", "spoke_hot"))}
    assert set(got) == want
    for (tool, ds, _), r in got.items():
        assert r["error"] is None and not r["timed_out"], r
        assert r["files"] == doc["params"]["datasets"][ds]["files"]
        assert r["bytes"] == doc["params"]["datasets"][ds]["bytes"]
        assert set(r["cpu_s"]) >= ({"hub", "readers"} | ({"spoke", "mount"}
                                                          if tool == "spokefs" else set()))
        assert r["ratio_vs_local"] is not None
    assert got[("local", "small", "cold")]["ratio_vs_local"] == 1.0
    assert set(doc["headlines"]) >= {"small_cold_ratio", "small_cpu_ms_per_file",
                                     "large_cold_ratio", "large_cpu_s_per_gib"}
    assert doc["headlines"]["small_cold_ratio"] == got[("spokefs", "small", "cold")][
        "ratio_vs_local"]
    assert (out / "table.md").read_text().count("spokefs") == 6
