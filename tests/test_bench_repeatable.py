"""Headline figures that hold from run to run (issue 26): the warm-up measured against the
co-located run, the training loop's epoch boundaries, ``--repeat N``'s summary, and peers
that are missing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from spokefs.errors import ConfigError
from spokefs_bench import common, race
from spokefs_bench.common import Figure, summarize_runs
from spokefs_bench.training import metrics
from spokefs_bench.training.metrics import Batch


def timeline(waits: list[float], compute: float = 0.1, per_epoch: int = 50) -> list[Batch]:
    """Batches with the given data waits; each batch's wall = wait + compute."""
    out, t = [], 0.0
    for i, w in enumerate(waits):
        t += w + compute
        out.append(Batch(i // per_epoch, i % per_epoch, t, w, compute, 16, 1600))
    return out


def with_dips(base: list[float], at: list[int], wait: float) -> list[float]:
    return [wait if i in at else w for i, w in enumerate(base)]


# -- warm-up against local ---------------------------------------------------------------------
def test_local_against_itself_is_zero() -> None:
    local = timeline(with_dips([0.002] * 150, [50, 100], 0.3))
    assert metrics.warmup_vs(local, local) == (0, True)
    assert metrics.vs_local(local, local)["warmup_batches_vs_local"] == 0


def test_a_dip_both_have_does_not_count() -> None:
    # Epoch boundaries that stall in both runs: the absolute figure calls it a warm-up...
    local = timeline(with_dips([0.002] * 150, [50, 100], 0.3))
    spoke = timeline(with_dips([0.003] * 150, [50, 100], 0.32))
    assert metrics.warmup(spoke) == (101, True)
    # ...against local it is none.
    assert metrics.warmup_vs(spoke, local) == (0, True)


def test_slower_than_local_for_k_batches_reports_k() -> None:
    local = timeline([0.002] * 150)
    for k in (1, 7, 30):
        spoke = timeline([0.2] * k + [0.002] * (150 - k))
        assert metrics.warmup_vs(spoke, local) == (k, True), k
    # One long first wait is one batch (read it with time_to_steady_vs_local_s).
    first = timeline([2.0] + [0.002] * 149)
    r = metrics.vs_local(first, local)
    assert r["warmup_batches_vs_local"] == 1
    assert r["time_to_steady_vs_local_s"] == pytest.approx(2.1)


def test_a_dip_only_the_scenario_has_counts() -> None:
    local = timeline([0.002] * 150)
    spoke = timeline(with_dips([0.002] * 150, [60], 0.3))
    assert metrics.warmup_vs(spoke, local) == (61, True)


def test_within_the_margin_is_warm() -> None:
    local = timeline([0.0] * 100)  # AU 1.0
    # AU 0.96 against 1.0: within 0.05, warm although local is faster.
    assert metrics.warmup_vs(timeline([0.1 / 0.96 - 0.1] * 100), local) == (0, True)
    # AU 0.9: behind everywhere, never.
    never = timeline([0.1 / 0.9 - 0.1] * 100)
    assert metrics.warmup_vs(never, local) == (0, False)
    r = metrics.vs_local(never, local)
    assert r == {"warmup_batches_vs_local": None, "warmed_up_vs_local": False,
                 "time_to_steady_vs_local_s": None}


def test_without_local_there_is_no_figure() -> None:
    s = metrics.summarize(timeline([0.0] * 30))
    assert s["warmup_batches_vs_local"] is None and s["warmed_up_vs_local"] is None
    # the absolute figure stays, under its own name and the old one
    assert s["warmup_batches_au95"] == s["warmup_batches"] == 0 and s["warmed_up"] is True


def test_runs_of_different_lengths_compare_what_both_have() -> None:
    local = timeline([0.002] * 100)
    assert metrics.warmup_vs(timeline([0.3] * 3 + [0.002] * 117), local) == (3, True)
    assert metrics.warmup_vs([], local) == (0, False)


# -- the loop: every epoch in one DataLoader pass ---------------------------------------------
def test_all_epochs_sampler_keeps_epochs_apart() -> None:
    pytest.importorskip("torch")
    from spokefs_bench.training.datasets import Index
    from spokefs_bench.training.loop import EpochSampler, _AllEpochs, epoch_order

    n = 10
    index = Index(paths=[f"f{i}" for i in range(n)], offsets=[0] * n, sizes=[1] * n,
                  labels=[0] * n, digests=[""] * n)
    batches = list(_AllEpochs(EpochSampler(index, 3, "files"), 3, 4))
    assert [len(b) for b in batches] == [4, 4, 2] * 3  # an epoch's short batch stays its own
    assert len(_AllEpochs(EpochSampler(index, 3, "files"), 3, 4)) == 9
    for e in range(3):
        got = [i for b in batches[3 * e:3 * e + 3] for i in b]
        assert got == epoch_order(index, e, 3, "files")


# -- --repeat ----------------------------------------------------------------------------------
def test_summary_median_spread_and_noise_warning() -> None:
    runs = [{"a": Figure(10.0, "ref"), "ref": Figure(10.5), "g": Figure(3.0, 10),
             "w": Figure(None)},
            {"a": Figure(12.0, "ref"), "ref": Figure(10.4), "g": Figure(4.0, 10),
             "w": Figure(5)},
            {"a": Figure(11.0, "ref"), "ref": Figure(10.6), "g": Figure(5.0, 10),
             "w": Figure(7)}]
    summary, warnings = summarize_runs(runs)
    a = summary["a"]
    assert (a["median"], a["min"], a["max"], a["spread"]) == (11.0, 10.0, 12.0, 2.0)
    assert a["values"] == [10.0, 12.0, 11.0] and a["gap"] == pytest.approx(0.5)
    # a spread of 2 around a gap of 0.5 to local: that comparison is noise
    assert len(warnings) == 1 and warnings[0].startswith("a: spread 2 > gap 0.5")
    # a goal 6 away with a spread of 2: no warning
    assert summary["g"]["gap"] == 6 and summary["g"]["against"] == 10
    w = summary["w"]
    assert w["median"] == 6 and w["not_measured"] == 1


def test_reference_spread_counts_too() -> None:
    runs = [{"a": Figure(10.0, "ref"), "ref": Figure(11.0)},
            {"a": Figure(10.0, "ref"), "ref": Figure(14.0)}]
    _, warnings = summarize_runs(runs)
    assert warnings and "spread 3" in warnings[0]


def test_repeat_runs_write_every_run_and_the_summary(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[Path] = []

    def func(args: argparse.Namespace) -> int:
        calls.append(args.out)
        common.write_json(args.out, {"x": 1.0 + len(calls), "work": str(args.work_dir)})
        return 0

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work-dir", type=Path)
    parser.set_defaults(func=func)
    common.add_repeat(parser, lambda doc: {"x": Figure(doc["x"], 2.5)})

    args = parser.parse_args(["--out", str(tmp_path / "one")])
    assert args.func(args) == 0 and calls == [tmp_path / "one"]  # no --repeat: as before

    calls.clear()
    out = tmp_path / "many"
    args = parser.parse_args(["--out", str(out), "--repeat", "3"])
    assert args.func(args) == 0
    assert calls == [out / f"run-{i}" for i in (1, 2, 3)]
    doc = json.loads((out / "results.json").read_text())
    assert doc["repeat"] == 3 and len(doc["runs"]) == 3
    assert [r["headlines"]["x"] for r in doc["runs"]] == [2.0, 3.0, 4.0]
    assert doc["runs"][0]["doc"]["x"] == 2.0
    assert doc["summary"]["x"]["median"] == 3.0 and doc["summary"]["x"]["spread"] == 2.0
    assert doc["warnings"] and "spread 2 > gap 0.5" in doc["warnings"][0]
    works = {r["doc"]["work"] for r in doc["runs"]}
    assert len(works) == 1 and not Path(works.pop()).exists()  # shared, then removed
    assert "WARNING x: spread" in capsys.readouterr().out


def test_repeat_stops_at_the_first_failure(tmp_path: Path) -> None:
    calls = []

    def run_one(folder: Path) -> int:
        calls.append(folder)
        return 2

    assert common.repeat_runs(3, tmp_path, run_one, lambda doc: {}) == 2
    assert len(calls) == 1
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["runs"][0]["rc"] == 2


def test_seed_headlines_compare_with_local_and_goals() -> None:
    from spokefs_bench.training.run import headlines

    def r(scenario: str, sps: float, warm: int | None) -> dict:
        return {"scenario": scenario, "samples_per_s_steady": sps, "first_epoch_s": 5.0,
                "au_steady": 0.98, "warmup_batches_vs_local": warm,
                "warmed_up_vs_local": warm is not None, "warmup_batches": 3,
                "warmed_up": True}

    doc = {"results": {"local": r("local", 156, 0), "remote_spoke": r("remote_spoke", 155, 1),
                       "rclone": r("rclone", 150, None)},
           "goals": {"files": {"x": {"value": 1.0, "goal": 0.99, "met": True},
                               "old": {"value": 5, "goal": 10, "met": True,
                                       "superseded_by": "x"}}}}
    h = headlines(doc)
    assert h["remote_spoke.samples_per_s_steady"] == Figure(155)
    assert h["remote_spoke.first_epoch_s"].against == "local.first_epoch_s"
    assert h["remote_spoke.warmup_batches_vs_local"] == Figure(1, 10)
    assert h["rclone.first_epoch_s"].against == "remote_spoke.first_epoch_s"
    assert h["rclone.warmup_batches_vs_local"].value is None
    assert h["local.first_epoch_s"].against is None
    assert h["goal files x"] == Figure(1.0, 0.99) and "goal files old" not in h


# -- missing peers -------------------------------------------------------------------------------
@pytest.fixture
def no_rclone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))


@pytest.mark.usefixtures("no_rclone")
def test_race_without_rclone_fails_naming_the_package(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    race.register(parser.add_subparsers())
    args = parser.parse_args(["race", "--out", str(tmp_path / "out"), "--tools", "local,rclone",
                              "--datasets", "small", "--readers", "1", "--no-walk"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "rclone is not installed" in err and "apt-get install rclone" in err
    assert "make bench-deps" in err and "--allow-missing-peers" in err
    assert not (tmp_path / "out" / "work" / "data").exists()  # failed before any work


@pytest.mark.usefixtures("no_rclone")
def test_training_bench_without_rclone_fails_naming_the_package(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from spokefs_bench.training.run import TrainConfig, run_train

    cfg = TrainConfig(out=tmp_path / "out", scenarios=("local", "rclone"),
                      allow_missing_peers=False, data_dir=tmp_path / "data", progress=False)
    with pytest.raises(ConfigError, match="apt-get install rclone"):
        run_train(cfg)
    assert not (tmp_path / "data").exists()


def test_race_table_marks_a_missing_peer() -> None:
    doc = {"floors": {}, "params": {"dataset_bytes": {}, "rtt_s": 0.06}, "results": [],
           "missing_peers": {"rclone": "rclone is not installed; install ..."}}
    rows, header, _ = race.summarize(doc)
    assert rows == [["rclone", "MISSING", *[""] * (len(header) - 2)]]

