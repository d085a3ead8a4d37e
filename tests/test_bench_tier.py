"""``spokefs bench tier`` at a tiny size: it runs, every file is right, and results.json has
the shape the issue asks for."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spokefs_bench import tier as bench_tier


def test_bench_tier_tiny(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_tier.register(parser.add_subparsers())
    out = tmp_path / "out"
    args = parser.parse_args(["tier", "--out", str(out), "--quick", "--counts", "1,2",
                              "--files", "16", "--file-size", "64KiB", "--readers", "2",
                              "--rtt", "10ms", "--work-dir", str(tmp_path / "work")])
    assert args.func(args) == 0
    doc = json.loads((out / "results.json").read_text())
    assert {"counts", "files", "file_size", "readers", "rtt_s", "bandwidth"} <= set(doc["params"])
    assert [r["spokes"] for r in doc["results"]] == [1, 2]
    for r in doc["results"]:
        assert {"spokes", "wan_bytes_ratio", "cold_epoch_s", "warm_epoch_s"} <= set(r)
        assert r["wrong_files"] == 0
        assert 1.0 <= r["wan_bytes_ratio"] <= 1.1  # one copy over the WAN, whatever the count
        assert r["cold_epoch_s"] > 0 and r["warm_epoch_s"] > 0 and r["warm_alone_epoch_s"] > 0
