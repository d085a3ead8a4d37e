"""The training benchmark: its figures on hand-built timelines, and a tiny end-to-end run."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from spokefs_bench.training import metrics
from spokefs_bench.training.datasets import DatasetSpec, ensure_dataset, sample_digest
from spokefs_bench.training.loop import epoch_order
from spokefs_bench.training.metrics import Batch


def timeline(waits: list[float], compute: float = 0.1, per_epoch: int | None = None,
             samples: int = 8, nbytes: int = 800) -> list[Batch]:
    """Batches with the given data waits; each batch's wall = wait + compute."""
    out, t = [], 0.0
    per_epoch = per_epoch or len(waits)
    for i, w in enumerate(waits):
        t += w + compute
        out.append(Batch(i // per_epoch, i % per_epoch, t, w, compute, samples, nbytes))
    return out


# -- au, steady figures, epochs ----------------------------------------------------------------
def test_au_is_compute_over_wall() -> None:
    tl = timeline([0.1] + [0.0] * 9)  # one 0.1 s wait in 1.1 s
    assert metrics.au(tl) == pytest.approx(1.0 / 1.1)
    assert metrics.au(timeline([0.0] * 5)) == pytest.approx(1.0)
    assert metrics.au([]) == 0.0


def test_epochs_and_steady_figures() -> None:
    tl = timeline([0.5] + [0.0] * 9 + [0.0] * 10, per_epoch=10)
    assert metrics.epoch_s(tl) == pytest.approx([1.5, 1.0])
    assert metrics.au_steady(tl) == pytest.approx(1.0)
    assert metrics.samples_per_s_steady(tl) == pytest.approx(80.0)  # 10 x 8 samples in 1 s
    assert metrics.epoch_spans(tl) == [(0, 10), (10, 20)]


def test_stall_batches_counts_waits_over_two_percent_of_compute() -> None:
    tl = timeline([0.0, 0.002, 0.0021, 0.5, 0.0])  # 2% of 0.1 s is 0.002: not a stall
    assert metrics.stall_batches(tl) == 2


# -- warm-up -----------------------------------------------------------------------------------
def test_warm_from_the_start() -> None:
    assert metrics.warmup(timeline([0.0] * 60)) == (0, True)
    # A small first wait that no 20-batch window notices is not a warm-up.
    assert metrics.warmup(timeline([0.05] + [0.0] * 59)) == (0, True)


def test_cold_batches_then_steady_counts_the_cold_batches() -> None:
    # 30 batches waiting 0.5 s for 0.1 s of compute, then 70 without waits. Any window
    # holding one cold batch is below 0.95 (2.0 / 2.5 s), so warm-up is exactly 30.
    tl = timeline([0.5] * 30 + [0.0] * 70)
    assert metrics.warmup(tl) == (30, True)
    assert metrics.time_to_steady_s(tl, 30, True) == pytest.approx(18.0)
    # A milder cold phase fades inside the window: the last cold batch alone
    # (2.0 / 2.1 s = 0.952) no longer pulls a window below 0.95.
    assert metrics.warmup(timeline([0.1] * 30 + [0.0] * 70)) == (29, True)
    values = metrics.rolling_au(tl)
    assert len(values) == 100 - metrics.WINDOW + 1
    assert values[29] < metrics.STEADY_AU <= values[30]


def test_never_warm_reads_zero_and_not_warmed_up() -> None:
    tl = timeline([0.1] * 50)
    assert metrics.warmup(tl) == (0, False)
    assert metrics.time_to_steady_s(tl, 0, False) is None
    # Warm in the middle but cold again at the end: never steady.
    assert metrics.warmup(timeline([0.0] * 40 + [0.1] * 20)) == (0, False)


def test_a_dip_in_the_middle_extends_the_warmup() -> None:
    waits = [0.0] * 100
    waits[60] = 0.5  # one long stall: every window holding batch 60 is below 0.95
    w, warmed = metrics.warmup(timeline(waits))
    assert warmed and w == 61


def test_short_runs_are_one_window() -> None:
    assert metrics.warmup(timeline([0.0] * 5)) == (0, True)
    assert metrics.warmup(timeline([0.1] * 5)) == (0, False)
    assert metrics.warmup([]) == (0, False)


def test_threshold_sits_at_095() -> None:
    def steady_at(target: float) -> list[Batch]:
        return timeline([0.1 / target - 0.1] * 40)

    assert metrics.warmup(steady_at(0.951)) == (0, True)
    assert metrics.warmup(steady_at(0.949)) == (0, False)


def test_cost_and_summary_fields() -> None:
    c = metrics.cost(2_000_000_000, 1800.0, 0.02, 2.0)
    assert c["cost_wan_usd"] == pytest.approx(0.04)
    assert c["cost_idle_usd"] == pytest.approx(1.0)
    assert c["cost_usd"] == pytest.approx(1.04)
    s = metrics.summarize(timeline([0.1] * 30 + [0.0] * 70, per_epoch=50))
    assert s["warmup_batches"] == 29 and s["warmed_up"] is True
    assert s["batches"] == 100 and s["samples"] == 800 and s["bytes_read"] == 80_000
    assert s["idle_s"] == pytest.approx(3.0)
    assert len(s["epoch_s"]) == 2


# -- data and order ------------------------------------------------------------------------------
def test_shards_index_points_at_each_sample(tmp_path: Path) -> None:
    d = ensure_dataset(DatasetSpec("shards", 30, 20_000, shard_size=200_000), tmp_path)
    ix = d.index
    assert len(ix.files) > 1
    for i in range(len(ix)):
        with open(d.root / ix.paths[i], "rb") as f:
            f.seek(ix.offsets[i])
            assert sample_digest(f.read(ix.sizes[i])) == ix.digests[i]
    again = ensure_dataset(DatasetSpec("shards", 30, 20_000, shard_size=200_000), tmp_path)
    assert again.root == d.root  # reused, not rebuilt
    order = epoch_order(ix, 1, 0, "shards")
    assert sorted(order) == list(range(30))
    # Within a shard, samples come in file order (WebDataset-style sequential reads).
    for shard in ix.files:
        pos = [i for i in order if ix.paths[i] == shard]
        assert pos == sorted(pos)


# -- end to end --------------------------------------------------------------------------------
REQUIRED = ["au", "au_steady", "samples_per_s_steady", "stall_batches", "warmup_batches",
            "warmed_up", "first_epoch_s", "epoch_s", "wan_bytes", "hit_ratio",
            "dataset_bytes", "link_bytes_per_s", "demand_bytes_per_s", "bytes_wrong",
            "cost_usd", "cost_wan_usd", "cost_idle_usd", "reader", "time_to_steady_s"]


@pytest.mark.slow
def test_tiny_end_to_end_run(tmp_path: Path) -> None:
    from spokefs_bench.training.loop import LoopConfig
    from spokefs_bench.training.run import TrainConfig, run_train

    out = tmp_path / "out"
    cfg = TrainConfig(out=out, scenarios=("local", "remote_spoke", "remote_direct"),
                      samples=24, sample_size=20_000, classes=3,
                      loop=LoopConfig(epochs=2, batch_size=4, workers=2, compute_s=0.01),
                      rtt=0.002, bandwidth=1e9, data_dir=tmp_path / "data", progress=False)
    doc = run_train(cfg)
    on_disk = json.loads((out / "results.json").read_text())
    assert set(on_disk) >= {"params", "results"}
    results = on_disk["results"]
    assert set(results) == {"local", "remote_spoke", "remote_direct"}, on_disk["params"]
    data_bytes = doc["params"]["datasets"]["files"]["bytes"]
    for name, r in results.items():
        for f in REQUIRED:
            assert f in r, (name, f)
        assert 0.0 <= r["au"] <= 1.0 and 0.0 <= r["au_steady"] <= 1.0
        assert r["bytes_wrong"] == 0 and r["samples_wrong"] == 0
        assert r["samples"] == 2 * 24 and len(r["epoch_s"]) == 2
        assert r["first_epoch_s"] > 0 and r["demand_bytes_per_s"] > 0
        assert r["dataset_bytes"] == data_bytes
        assert math.isclose(r["cost_usd"], r["cost_wan_usd"] + r["cost_idle_usd"])
    assert results["local"]["wan_bytes"] == 0 and results["local"]["hit_ratio"] is None
    # A cold spoke pulls the whole dataset over the link once; direct reads pull it twice.
    assert results["remote_spoke"]["wan_bytes"] >= data_bytes
    assert results["remote_direct"]["wan_bytes"] >= 2 * data_bytes
    assert 0.0 <= results["remote_spoke"]["hit_ratio"] <= 1.0
    for name in ("timeline.png", "summary.png", "timeline.csv"):
        assert (out / name).stat().st_size > 0
    with (out / "timeline.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["scenario"] for r in rows} == set(results)
    assert len(rows) == 3 * 2 * 6


@pytest.mark.slow
def test_tiny_run_on_an_s3_origin(tmp_path: Path) -> None:
    """``bench seed/train --origin s3``: the dataset in a moto bucket, a hub over it; the
    same figures, the origin recorded."""
    for module in ("boto3", "obstore", "moto"):
        pytest.importorskip(module)
    from spokefs_bench.training.loop import LoopConfig
    from spokefs_bench.training.run import TrainConfig, run_train

    cfg = TrainConfig(out=tmp_path / "out", scenarios=("remote_spoke", "remote_direct"),
                      samples=24, sample_size=20_000, classes=3,
                      loop=LoopConfig(epochs=2, batch_size=4, workers=2, compute_s=0.01),
                      rtt=0.002, bandwidth=1e9, data_dir=tmp_path / "data", progress=False,
                      origin="s3")
    doc = run_train(cfg)
    assert doc["params"]["origin"] == "s3" and not doc["params"]["failed"]
    results = doc["results"]
    data_bytes = doc["params"]["datasets"]["files"]["bytes"]
    for r in results.values():
        assert r["bytes_wrong"] == 0 and r["samples_wrong"] == 0 and r["samples"] == 2 * 24
    assert data_bytes <= results["remote_spoke"]["wan_bytes"] < 1.2 * data_bytes + 200_000
    assert results["remote_direct"]["wan_bytes"] >= 2 * data_bytes
