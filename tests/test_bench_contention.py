"""``spokefs bench contention`` at a tiny size: two jobs through one spoke run, every sample
is right, results.json has the shape the issue asks for, and a reserved share keeps job A's
dataset on the spoke beside job B's scan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from spokefs_bench import contention
from spokefs_bench.training.metrics import Batch

REQUIRED = ["samples_per_s", "au", "hit_ratio", "wan_bytes", "hub_bytes", "steady_hits",
            "steady_misses", "steady_refetch_ratio", "first_epoch_s", "epoch_s", "samples",
            "bytes_read", "samples_wrong", "bytes_wrong", "dataset", "dataset_bytes"]


def test_figures_after_the_first_epoch() -> None:
    # Epoch 1: 2 batches waiting 0.4 s; then 3 batches of 8 samples in 0.3 s.
    tl, t = [], 0.0
    for i, wait in enumerate([0.4, 0.4, 0.0, 0.0, 0.0]):
        t += wait + 0.1
        tl.append(Batch(0 if i < 2 else 1, i if i < 2 else i - 2, t, wait, 0.1, 8, 800))
    s = contention.after_first_epoch(tl)
    assert s["samples_per_s"] == pytest.approx(24 / 0.3)
    assert s["au"] == pytest.approx(1.0)
    assert contention.after_first_epoch(tl[:2])["samples_per_s"] is None  # one epoch
    assert contention.attribute(1000, {"job-a": 300, "job-b": 100}, "job-a") == 750
    assert contention.attribute(1000, {}, "job-a") == 0


@pytest.mark.slow
def test_bench_contention_tiny(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    contention.register(parser.add_subparsers())
    out = tmp_path / "out"
    args = parser.parse_args(["contention", "--out", str(out), "--samples", "40",
                              "--sample-size", "20KB", "--classes", "3", "--epochs", "3",
                              "--batch-size", "4", "--workers", "2", "--compute", "10ms",
                              "--rtt", "2ms", "--bandwidth", "1GB/s",
                              "--data-dir", str(tmp_path / "data")])
    assert args.func(args) == 0
    doc = json.loads((out / "results.json").read_text())
    assert set(doc) >= {"params", "results", "cold", "goals"}
    results = doc["results"]
    assert set(results) == {"alone", "together", "together_shares"}
    p = doc["params"]
    assert all(p["checks"].values()), p["checks"]
    epochs = {"A": p["epochs_a"], "B": p["epochs_b"]}
    for phase, jobs in results.items():
        assert set(jobs) == {"A", "B"}, phase
        for job, r in jobs.items():
            for f in REQUIRED:
                assert f in r, (phase, job, f)
            assert r["bytes_wrong"] == 0 and r["samples_wrong"] == 0, (phase, job)
            assert r["samples"] == epochs[job] * p["datasets"][job]["samples"], (phase, job)
            assert 0.0 < r["au"] <= 1.0 and r["samples_per_s"] > 0, (phase, job)
            assert 0.0 <= r["hit_ratio"] <= 1.0, (phase, job)
            # Every phase starts cold: the job's dataset crosses the link at least once.
            assert r["hub_bytes"] >= r["dataset_bytes"], (phase, job)
            assert r["wan_bytes"] >= r["hub_bytes"], (phase, job)
    # A fits the cache: alone, nothing of it is fetched again after its first epoch.
    alone = results["alone"]["A"]
    assert alone["hit_ratio"] == 1.0 and alone["steady_hub_bytes"] == 0
    # With its reserved share, B's scan beside it costs A no hit. A few of A's blocks may
    # cross again: the reservation holds blocks once A holds them, and before A's first
    # epoch fills it, B's pinned prefetches can take the space outside it, so a cold insert
    # of A's finds no other victim and evicts one of A's own (policy/shares.py, rule 3).
    shared = results["together_shares"]["A"]
    assert shared["hit_ratio"] == 1.0, shared
    assert shared["steady_hub_bytes"] <= 0.25 * shared["dataset_bytes"], shared
    assert p["phases"]["together_shares"]["dataset_rules"].startswith("[datasets.job-a]")
    # Two cold jobs at once: each byte crosses at least once (and headers are small).
    cold = doc["cold"]
    assert cold["read_once_bytes"] == sum(d["bytes"] for d in p["datasets"].values())
    assert cold["read_once_bytes"] <= cold["link_bytes"] < 1.5 * cold["read_once_bytes"]
    assert all(r["bytes_wrong"] == 0 for r in cold["jobs"].values())
    goals = doc["goals"]
    assert {"shares_A_hit_ratio_vs_alone", "shares_A_samples_per_s_vs_alone",
            "no_shares_A_hit_ratio_vs_alone", "no_shares_A_samples_per_s_vs_alone",
            "cold_link_bytes_vs_read_once"} == set(goals)
    for name, g in goals.items():
        assert g["value"] is not None, name
        assert g.get("baseline") or isinstance(g["met"], bool), name
    assert goals["shares_A_hit_ratio_vs_alone"]["met"]
    assert (out / "timeline.csv").stat().st_size > 0
    if p["figures"]:
        assert (out / "contention.png").stat().st_size > 0
