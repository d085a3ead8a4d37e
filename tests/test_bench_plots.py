"""Benchmarks without the plot extra: a hint to install it, never a traceback, and
results.json written all the same. matplotlib is blocked in the child process
(``sys.modules['matplotlib'] = None`` makes its import fail as if it were not installed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BLOCKED = "import sys; sys.modules['matplotlib'] = None\n"


def run_blocked(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKED + code, *args], capture_output=True,
                          text=True, timeout=300)


def test_race_without_matplotlib(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_blocked("from spokefs.cli import main; sys.exit(main(sys.argv[1:]))",
                    "bench", "race", "--out", str(out), "--work-dir", str(tmp_path / "work"),
                    "--tools", "local", "--datasets", "small", "--readers", "1", "--no-walk",
                    "--rtt", "10ms", "--bandwidth", "100MB/s", "--small-files", "12",
                    "--small-size", "16KiB", "--small-dirs", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "install spokefs[bench] for plots" in r.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["results"] and not (out / "race.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="the training benchmark needs the torch extra")
def test_training_bench_without_matplotlib(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path\n"
        "from spokefs_bench.training.loop import LoopConfig\n"
        "from spokefs_bench.training.run import TrainConfig, run_train\n"
        "out = Path(sys.argv[1])\n"
        "run_train(TrainConfig(out=out, scenarios=('local',), samples=16, sample_size=4096,\n"
        "    classes=2, loop=LoopConfig(epochs=1, batch_size=4, workers=0, compute_s=0.0),\n"
        "    rtt=0.002, bandwidth=1e9, data_dir=out.parent / 'data', progress=False))\n")
    out = tmp_path / "out"
    r = run_blocked(code, str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "install spokefs[bench] for plots" in r.stdout
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["results"]) == {"local"} and doc["params"]["figures"] == []
    assert (out / "timeline.csv").exists()
