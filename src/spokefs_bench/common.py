"""Small helpers shared by the benchmarks: output folder, JSON, tables, percentiles,
tokens, missing peers, and ``--repeat N``."""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spokefs.tables import table  # also the benchmarks' import
from spokefs.wire.auth import ENV_TOKEN


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def write_json(out: Path, doc: dict[str, Any], name: str = "results.json") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


@dataclass(frozen=True)
class BenchTokens:
    """Tokens for a benchmark's servers, as a deployment would have them: hub and spoke run
    with ``--auth`` (one file here), the spoke presents its own read token upstream, and the
    benchmark, its mounts and clients present an admin token (``SPOKEFS_TOKEN``)."""

    path: Path
    admin: str
    upstream_file: Path

    @classmethod
    def make(cls, folder: Path) -> BenchTokens:
        folder.mkdir(parents=True, exist_ok=True)
        admin, spoke = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        path, upstream = folder / "tokens", folder / "spoke-upstream-token"
        for p, text in ((path, f"bench admin {admin}\nspoke read {spoke}\n"),
                        (upstream, spoke + "\n")):
            p.write_text(text)
            p.chmod(0o600)
        return cls(path, admin, upstream)

    def hub_args(self) -> list[str]:
        return ["--auth", str(self.path)]

    def spoke_args(self) -> list[str]:
        return ["--auth", str(self.path), "--upstream-token-file", str(self.upstream_file)]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin}"}

    @contextlib.contextmanager
    def as_client(self) -> Iterator[None]:
        """Clients made meanwhile (here and in child processes) present the admin token."""
        before = os.environ.get(ENV_TOKEN)
        os.environ[ENV_TOKEN] = self.admin
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ENV_TOKEN, None)
            else:
                os.environ[ENV_TOKEN] = before


PLOTS_HINT = "install spokefs[bench] for plots (pip install 'spokefs[bench]')"


@contextlib.contextmanager
def spokefs_mount(url: str, mp: Path, log: Path, *extra: str) -> Iterator[None]:
    """``spokefs mount URL MP [EXTRA...]`` (it returns once the mount works), ``spokefs
    umount`` after. RuntimeError, with the mount's own words, when it does not mount."""
    from spokefs.mount.process import unmount
    from spokefs.procs import cli

    mp.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cli("mount", url, str(mp), "--log-file", str(log), *extra),
                       capture_output=True, text=True, timeout=120, check=False)
    if r.returncode != 0 or not os.path.ismount(mp):
        with contextlib.suppress(OSError):
            unmount(mp)
        raise RuntimeError(f"spokefs mount {' '.join(extra)} failed (exit {r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()[-400:]}")
    try:
        yield
    finally:
        subprocess.run(cli("umount", str(mp)), capture_output=True, timeout=60, check=False)
        with contextlib.suppress(OSError):
            unmount(mp)


def free_port() -> int:
    """A port on 127.0.0.1 free now, for a service that must know its URL before it starts
    (a tier's members list each other)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def have_matplotlib() -> bool:
    """Whether plots can be drawn (matplotlib, Agg backend); if not, say how to get them.
    The numbers (results.json, tables) are written either way."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plots; {PLOTS_HINT}", flush=True)
        return False
    matplotlib.use("Agg")
    return True


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


# -- missing peers ---------------------------------------------------------------------------
# What installs each peer a benchmark compares with (`make bench-deps` installs them all).
PEER_PACKAGES = {
    "rclone": "the Debian package rclone (apt-get install rclone)",
    "fsspec": "the Python packages fsspec and aiohttp (pip install fsspec aiohttp)",
}


def missing_peer(peer: str, reason: str) -> str:
    """``reason`` with what to install (``peer``: a PEER_PACKAGES key)."""
    return f"{reason}; install {PEER_PACKAGES[peer]}, or run `make bench-deps`"


def add_allow_missing_peers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-missing-peers", action="store_true",
                   help="run without a peer that is not installed (its row says MISSING); "
                   "without this, a missing peer is an error")


# -- --repeat N ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figure:
    """One headline figure of one run, and what it is compared with: another figure's name
    (its median) or a number (a goal). None: not measured in that run (never warm, timed
    out)."""

    value: float | None
    against: str | float | None = None


Headlines = Callable[[dict[str, Any]], dict[str, Figure]]


def summarize_runs(runs: list[dict[str, Figure]]) -> tuple[dict[str, Any], list[str]]:
    """Median, min, max and spread (max - min) of each figure over the runs, and a warning
    for each figure whose spread (or the spread of the figure it is compared with) exceeds
    the gap between the two medians: that comparison could come out either way."""
    names = list(dict.fromkeys(k for r in runs for k in r))
    out: dict[str, Any] = {}
    for name in names:
        values = [r[name].value for r in runs if name in r]
        nums = sorted(float(v) for v in values if v is not None)
        against = next((r[name].against for r in runs if name in r), None)
        s: dict[str, Any] = {"values": values, "median": statistics.median(nums) if nums
                             else None, "min": nums[0] if nums else None,
                             "max": nums[-1] if nums else None,
                             "spread": nums[-1] - nums[0] if nums else None,
                             "not_measured": len(values) - len(nums)}
        if against is not None:
            s["against"] = against
        out[name] = s
    warnings = []
    for name, s in out.items():
        against = s.get("against")
        if against is None or s["median"] is None:
            continue
        ref = out.get(against) if isinstance(against, str) else None
        ref_median = ref["median"] if ref is not None else against
        if not isinstance(ref_median, int | float):
            continue
        spread = max(s["spread"], ref["spread"] or 0.0) if ref is not None else s["spread"]
        s["gap"] = abs(s["median"] - ref_median)
        if spread > s["gap"]:
            warnings.append(f"{name}: spread {spread:.4g} > gap {s['gap']:.4g} to {against} "
                            f"({ref_median:.4g}): the comparison is within the noise")
    return out, warnings


def repeat_runs(n: int, out: Path, run_one: Callable[[Path], int],
                headlines: Headlines) -> int:
    """Run a benchmark ``n`` times (run *i* writes to OUT/run-i/), then write OUT/results.json
    (``{"repeat", "runs", "summary", "warnings"}``: every run's document and headline
    figures, and their summary) and print the summary. Stops at the first run that fails;
    returns its exit status (0 when all passed)."""
    runs: list[dict[str, Any]] = []
    figures: list[dict[str, Figure]] = []
    rc = 0
    for i in range(1, n + 1):
        folder = out / f"run-{i}"
        print(f"== run {i} of {n} -> {folder}", flush=True)
        rc = run_one(folder) or 0
        path = folder / "results.json"
        doc = json.loads(path.read_text()) if path.exists() else {}
        figs = headlines(doc) if doc else {}
        figures.append(figs)
        runs.append({"out": str(folder), "rc": rc,
                     "headlines": {k: f.value for k, f in figs.items()}, "doc": doc})
        if rc:
            print(f"run {i} failed (exit {rc}); not repeating", flush=True)
            break
    summary, warnings = summarize_runs(figures)
    write_json(out, {"repeat": n, "runs": runs, "summary": summary, "warnings": warnings,
                     "machine": machine()})
    rows = [[name, _g(s["median"]), _g(s["min"]), _g(s["max"]), _g(s["spread"]),
             s.get("against", ""), s["not_measured"] or ""] for name, s in summary.items()]
    print(f"\n{len(runs)} runs: median, min, max and spread of each headline figure")
    print(table(rows, ["figure", "median", "min", "max", "spread", "compared with",
                       "not measured"]))
    for w in warnings:
        print(f"WARNING {w}")
    print(f"results: {out / 'results.json'} (each run's own: {out}/run-N/)")
    return rc


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def add_repeat(p: argparse.ArgumentParser, headlines: Headlines) -> None:
    """``--repeat N`` on a benchmark whose parser has ``--out`` and a ``func`` default (set
    it first): N runs, one folder each, and the spread of ``headlines`` in OUT/results.json.
    Runs without ``--work-dir`` share one temporary work folder (datasets made once)."""
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run N times (OUT/run-1 ...) and write the median and spread of each "
                   "headline figure to OUT/results.json (default 1: one run, as always)")
    p.set_defaults(func=functools.partial(_repeated, p.get_default("func"), headlines))


def _repeated(func: Callable[[argparse.Namespace], int], headlines: Headlines,
              args: argparse.Namespace) -> int:
    n = getattr(args, "repeat", 1)
    if n <= 1:
        return func(args)
    with contextlib.ExitStack() as stack:
        shared = None
        if getattr(args, "work_dir", "") is None:
            shared = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="spokefs-bench-repeat-")))

        def one(folder: Path) -> int:
            run_args = copy.copy(args)
            run_args.out = folder
            if shared is not None:
                run_args.work_dir = shared
            return func(run_args)

        return repeat_runs(n, args.out, one, headlines)
