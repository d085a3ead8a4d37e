"""``spokefs bench policy`` on a tiny trace: it runs, writes results.json, and the figures
say what the design expects (learning beats LRU under a fresh shuffle)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spokefs_bench import policy as bench_policy


def run(out: Path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench_policy.register(sub)
    args = parser.parse_args(["policy", "--out", str(out), "--procs", "1", *extra])
    assert args.func(args) == 0
    return json.loads((out / "results.json").read_text())


def test_bench_policy_tiny(tmp_path: Path) -> None:
    doc = run(
        tmp_path, "--files", "128", "--epochs", "3", "--sizes", "0.5",
        "--traces", "fresh_shuffle,two_jobs", "--file-size", "1MiB",
    )  # fmt: skip
    assert doc["benchmark"] == "policy"
    rows = doc["rows"]
    configs = {c["name"] for c in doc["configs"]}
    assert {"lru", "s3fifo", "belady-order", "learn+lru"} <= configs
    assert len(rows) == 2 * (len(configs) + 1)  # each trace: every config and the optimum
    for r in rows:
        assert {"trace", "cache", "config", "hit", "ready", "hit_all", "optimum_hit",
                "vs_optimum"} <= set(r)  # fmt: skip
        assert 0.0 <= r["hit"] <= 1.0
    by = {(r["trace"], r["config"]): r for r in rows}
    fresh = "fresh_shuffle"
    assert by[(fresh, "learn+lru")]["hit"] > by[(fresh, "lru")]["hit"] + 0.15
    assert by[(fresh, "belady-order")]["ready"] > 0.9
    assert "order_min_vs_optimum" in doc["goals"]


def test_bench_policy_rejects_unknown_names(tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench_policy.register(parser.add_subparsers())
    args = parser.parse_args(["policy", "--out", str(tmp_path), "--traces", "nope"])
    assert args.func(args) == 2
    assert "nope" in capsys.readouterr().out
