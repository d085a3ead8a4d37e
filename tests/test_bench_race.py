"""``spokefs bench race`` on tiny datasets over a short link: it runs every case it is asked
for, writes results.json in the documented shape, a table and a chart, and the link counters
say what a cache should do (a cold epoch moves the dataset once, a warm one moves nothing)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from spokefs.mount.process import fuse_unusable
from spokefs_bench import race


def run(out: Path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    race.register(parser.add_subparsers())
    args = parser.parse_args(["race", "--out", str(out), *extra])
    assert args.func(args) == 0
    return json.loads((out / "results.json").read_text())


TINY = ("--rtt", "10ms", "--bandwidth", "100MB/s", "--shards", "2", "--shard-size", "5MiB",
        "--small-files", "24", "--small-size", "16KiB", "--small-dirs", "3",
        "--readers", "1,2", "--timeout", "60s", "--verify")


@pytest.mark.skipif(fuse_unusable() is not None, reason=f"no FUSE: {fuse_unusable()}")
def test_race_tiny(tmp_path: Path) -> None:
    doc = run(tmp_path / "out", "--work-dir", str(tmp_path / "work"),
              "--tools", "local,spokefs,spokefs_hints,http_direct", *TINY)
    params, results, floors = doc["params"], doc["results"], doc["floors"]
    assert params["rtt_s"] == pytest.approx(0.010)
    assert params["tokens"] is True  # hub and spoke ran with --auth; every tool had a token
    assert params["bandwidth_Bps"] == pytest.approx(100e6)
    sizes = params["dataset_bytes"]
    assert sizes == {"shards": 2 * 5 * 2**20, "small": 24 * 16 * 2**10}
    assert set(floors) == {"shards", "small"}
    assert floors["small"] == pytest.approx(sizes["small"] / 100e6 + 0.010, abs=1e-3)

    keys = {"tool", "dataset", "readers", "epoch", "seconds", "link_bytes",
            "link_connections"}
    for r in results:
        assert keys <= set(r), r
        assert r["error"] is None and not r["timed_out"], r
        assert r["seconds"] > 0
    epochs = {(r["tool"], r["dataset"], r["readers"], r["epoch"]) for r in results}
    for tool in ("local", "spokefs", "spokefs_hints", "http_direct"):
        for ds in ("shards", "small"):
            for readers in (1, 2):
                assert {(tool, ds, readers, "cold"), (tool, ds, readers, "warm")} <= epochs
    walks = {r["tool"] for r in results if r["epoch"] == "walk"}
    assert walks == {"local", "spokefs", "http_direct"}  # hints do not change a listing

    by = {(r["tool"], r["dataset"], r["readers"], r["epoch"]): r for r in results}
    for ds in ("shards", "small"):
        for readers in (1, 2):
            assert by[("local", ds, readers, "cold")]["link_bytes"] == 0
            for tool in ("spokefs", "spokefs_hints"):
                cold = by[(tool, ds, readers, "cold")]
                warm = by[(tool, ds, readers, "warm")]
                assert cold["files_done"] == params["dataset_files"][ds]
                # the dataset crosses the link once (plus headers), then never again
                assert sizes[ds] <= cold["link_bytes"] <= 1.2 * sizes[ds] + 200_000
                assert warm["link_bytes"] < 0.01 * sizes[ds]
            # no cache: the warm epoch moves the dataset again
            assert by[("http_direct", ds, readers, "warm")]["link_bytes"] >= sizes[ds]
    assert by[("spokefs", "small", 1, "walk")]["link_bytes"] == 0  # metadata is local

    out = tmp_path / "out"
    assert (out / "race.png").stat().st_size > 1000
    table = (out / "table.md").read_text()
    assert "spokefs_hints" in table and "x floor" in table
    assert any(g["goal"].startswith("spokefs small 1r cold") for g in doc["goals"])
    diag = [d for d in doc["diagnostics"] if d["tool"] == "spokefs"]
    assert diag and "fetch_mean_s" in diag[0]


def test_missing_tool_is_skipped_with_a_note(tmp_path: Path) -> None:
    env_path = os.environ["PATH"]
    os.environ["PATH"] = str(tmp_path)  # no rclone on this PATH
    try:
        doc = run(tmp_path / "out", "--work-dir", str(tmp_path / "work"),
                  "--tools", "local,rclone", "--datasets", "small", "--readers", "1",
                  "--no-walk", "--allow-missing-peers", *TINY[:-5])
    finally:
        os.environ["PATH"] = env_path
    assert {r["tool"] for r in doc["results"]} == {"local"}
    assert any(n.startswith("rclone skipped: rclone is not installed") for n in doc["notes"])


def test_epoch_order_is_shared_and_fresh() -> None:
    ds = race.Dataset("small", Path("/nonexistent"), [f"f{i}" for i in range(50)], [1] * 50)
    a0, a1 = race.epoch_order(ds, 1, 0, 1), race.epoch_order(ds, 1, 1, 1)
    assert sorted(a0) == list(range(50)) and a0 != a1          # every file, a fresh order
    assert race.epoch_order(ds, 1, 0, 1) == a0                  # the same for every tool


@pytest.mark.skipif(fuse_unusable() is not None, reason=f"no FUSE: {fuse_unusable()}")
def test_race_tiny_s3_origin(tmp_path: Path) -> None:
    """``--origin s3``: the datasets in a moto bucket, a hub over it behind the same link;
    the same figures, the origin recorded, tokens on as by default."""
    for module in ("boto3", "obstore", "moto"):
        pytest.importorskip(module)
    doc = run(tmp_path / "out", "--work-dir", str(tmp_path / "work"), "--origin", "s3",
              "--tools", "spokefs,http_direct", "--rtt", "10ms", "--bandwidth", "100MB/s",
              "--shards", "2", "--shard-size", "5MiB", "--small-files", "24", "--small-size",
              "16KiB", "--small-dirs", "3", "--readers", "2", "--timeout", "60s", "--verify")
    params, results = doc["params"], doc["results"]
    assert params["origin"] == "s3" and params["tokens"] is True
    sizes = params["dataset_bytes"]
    by = {(r["tool"], r["dataset"], r["readers"], r["epoch"]): r for r in results}
    for ds in ("shards", "small"):
        for tool in ("spokefs", "http_direct"):
            for epoch in ("cold", "warm"):
                r = by[(tool, ds, 2, epoch)]
                assert r["error"] is None and not r["timed_out"], r
                assert r["files_done"] == params["dataset_files"][ds]
                assert "s3" in r["cpu_s"]  # the S3 server's CPU is counted too
        cold, warm = by[("spokefs", ds, 2, "cold")], by[("spokefs", ds, 2, "warm")]
        assert sizes[ds] <= cold["link_bytes"] <= 1.2 * sizes[ds] + 200_000
        assert warm["link_bytes"] < 0.01 * sizes[ds]
        assert by[("http_direct", ds, 2, "warm")]["link_bytes"] >= sizes[ds]
    assert by[("spokefs", "small", 1, "walk")]["link_bytes"] == 0
    assert "origin s3" in (tmp_path / "out" / "table.md").read_text()


@pytest.mark.skipif(fuse_unusable() is not None, reason=f"no FUSE: {fuse_unusable()}")
def test_race_on_a_store_of_ones_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--s3-endpoint``: the datasets go to a store the user runs (here a moto this test
    starts, standing in for MinIO or S3), with the credentials AWS tools find."""
    for module in ("boto3", "obstore", "moto"):
        pytest.importorskip(module)
    from spokefs_bench.s3server import TEST_ENV, S3Server

    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    with S3Server() as store:
        doc = run(tmp_path / "out", "--work-dir", str(tmp_path / "work"), "--origin", "s3",
                  "--s3-endpoint", store.url, "--s3-bucket", "mine", "--datasets", "small",
                  "--tools", "spokefs", "--rtt", "10ms", "--small-files", "12",
                  "--small-size", "16KiB", "--small-dirs", "2", "--readers", "2", "--no-walk",
                  "--timeout", "60s", "--verify")
        import boto3

        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=store.url).list_objects_v2(
            Bucket="mine", Prefix="small/")["Contents"]]
    assert len(keys) == 12
    assert doc["params"]["s3_endpoint"] == store.url
    for r in doc["results"]:
        assert r["error"] is None and r["files_done"] == 12, r
        assert "s3" not in r["cpu_s"]  # not a process of the bench
