"""``spokefs bench checkpoint`` at a tiny size: every save runs (local, through a writable
mount, through ``spokefs://``, straight to the hub, a spoke killed after the save), every
restore reads every byte right (local, through a fresh tier member, through the hub),
results.json has the figures the issue asks for, and the kill loses nothing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spokefs_bench import checkpoint

FIGURES = ["save_block_ratio_local", "safe_at_hub_ratio_floor", "restore_tier_ratio_local",
           "resume_batches", "lost_bytes"]


def test_bench_checkpoint_tiny(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    checkpoint.register(parser.add_subparsers())
    out = tmp_path / "out"
    args = parser.parse_args(["checkpoint", "--out", str(out), "--size", "2MiB",
                              "--writers", "2", "--rtt", "2ms", "--bandwidth", "1GB/s",
                              "--resume-samples", "160",
                              "--work-dir", str(tmp_path / "work")])
    assert args.func(args) == 0
    doc = json.loads((out / "results.json").read_text())
    for f in FIGURES:
        assert f in doc, f
    assert set(doc["saves"]) == {"local", "mount", "fsspec", "hub", "crash"}
    assert set(doc["restores"]) == {"local", "tier", "hub"}
    assert doc["lost_bytes"] == 0 and doc["restore_wrong_bytes"] == 0
    for name in ("mount", "fsspec"):
        assert doc["saves"][name]["safe_s"] >= doc["saves"][name]["seconds"] > 0
    for r in doc["restores"].values():  # every shard read whole
        assert r["bytes"] == 2 << 20 and r["seconds"] > 0
    # The tier member took the checkpoint from the writing spoke's cache, not over the
    # link (a manifest's bytes at most); the lone fresh spoke fetched it all from the hub.
    assert doc["restores"]["tier"]["wan_bytes"] < (2 << 20) // 4
    assert doc["restores"]["hub"]["wan_bytes"] >= 2 << 20
    # The job killed mid-epoch resumed where its checkpoint was taken, on a fresh node,
    # every sample right.
    r = doc["restart"]
    assert r["batches_per_epoch"] == 10 and r["killed_at_batch"] == 4
    assert r["resumed_at_sample"] == 4 * 16
    assert r["batches_after_restart"] == 10 - 4 and r["wrong_samples"] == 0
    # Every shard of every save through spokefs is at the hub, as written.
    for step in ("step-1", "step-2", "step-3", "step-4"):
        folder = tmp_path / "work" / "ckpt" / step
        for rank in range(2):
            shard = folder / f"__{rank}_0.distcp"
            assert shard.read_bytes() == checkpoint._shard(rank, (2 << 20) // 2), shard
        assert (folder / ".metadata").is_file() and not (folder / ".metadata.tmp").exists()
