"""``spokefs bench node``: one node's epoch on loopback, no link emulator in the path.

Hub, spoke and mount on one host, so nothing but the software between the reader and the
bytes is measured: what a node's accelerators wait on when the link is not the limit (a
spoke near a fast link, or a warm cache). The same files are read by 8 threads

- with a plain read of the source folder (``local``: cold = its pages dropped, warm = in
  the page cache),
- through ``spokefs mount`` over a spoke of the hub (``spokefs``: cold = empty spoke and
  fresh mount; warm = the same mount again, its pages in the kernel's cache; ``spoke_hot`` =
  a fresh mount over a spoke that holds everything: what the mount itself costs),
- through ``rclone mount`` of the hub's HTTP tree with its full VFS cache (``rclone``).

Two datasets: many small files (8,000 of 128 KiB) and fewer large ones (128 of 8 MiB).
Every row counts the CPU-seconds of each process involved (hub, spoke with its workers,
mount or rclone, and the bench's reader threads) from /proc, so a row says files per
second and CPU per file, and each tool's throughput is divided by the plain read's in the
same run. Writes DIR/results.json, DIR/table.md and DIR/node.png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spokefs.units import format_size, parse_duration, parse_size
from spokefs_bench.common import (
    BenchTokens,
    Figure,
    add_allow_missing_peers,
    add_repeat,
    have_matplotlib,
    machine,
    missing_peer,
    write_json,
)
from spokefs_bench.dataplane import tree_cpu_s
from spokefs_bench.race import (
    TOOL_CLASSES,
    Dataset,
    Params,
    Served,
    Tool,
    build_dataset,
    epoch_order,
    run_epoch,
)

TOOLS = ["local", "spokefs", "rclone"]
DATASETS = ["small", "large"]
# (state, the plain read's state it is divided by)
STATES = {"cold": "cold", "warm": "warm", "spoke_hot": "cold"}
GOALS = {  # issue "A native data plane": the loopback epoch's goals
    "small_cold_ratio": 0.7, "small_cpu_ms_per_file": 0.15, "small_warm_ratio": 0.8,
    "large_cold_ratio": 0.9, "large_cpu_s_per_gib": 0.5}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "node", help="one node's epoch on loopback: mount vs plain read vs rclone, CPU/file",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="results folder")
    p.add_argument("--work-dir", type=Path,
                   help="datasets, caches and mountpoints (default: a temporary folder; "
                   "datasets are reused there when their parameters match)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes (600 x 128KiB, 16 x 8MiB): a run of about a minute")
    p.add_argument("--small-files", type=int, help="files in `small` (8000)")
    p.add_argument("--small-size", type=parse_size, help="size of each small file (128KiB)")
    p.add_argument("--large-files", type=int, help="files in `large` (128)")
    p.add_argument("--large-size", type=parse_size, help="size of each large file (8MiB)")
    p.add_argument("--readers", type=int, default=8, help="reader threads (8)")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma list (small,large)")
    p.add_argument("--tools", default=",".join(TOOLS), help="comma list (local,spokefs,rclone)")
    p.add_argument("--timeout", type=parse_duration, default=300.0,
                   help="deadline of one epoch (300s)")
    p.add_argument("--spoke-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `spokefs spoke serve` (repeatable)")
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `spokefs mount` (repeatable), e.g. "
                   "--mount-arg=--engine=python")
    p.add_argument("--verify", action="store_true",
                   help="check every file's bytes (sha1) against the source; costs CPU")
    p.add_argument("--no-tokens", action="store_true",
                   help="hub and spoke without --auth (default: with tokens, as deployed)")
    p.add_argument("--seed", type=int, default=1, help="seed of the data and the orders")
    add_allow_missing_peers(p)
    p.set_defaults(func=run)
    add_repeat(p, headlines)


@dataclass(frozen=True)
class _Direct:
    """Where a link emulator would be in ``bench race``: here the hub itself."""

    url: str
    proc: None = None


def _params(a: argparse.Namespace) -> dict[str, Params]:
    q = a.quick

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if q else full)

    tools = [t for t in a.tools.split(",") if t]
    for t in tools:
        if t not in TOOLS:
            raise SystemExit(f"spokefs bench node: unknown tool {t!r} (known: {TOOLS})")
    base = {"rtt": 0.0, "bandwidth": float("inf"), "readers": [a.readers], "tools": tools,
            "timeout": a.timeout, "skip_slow": False, "walk": False, "verify": a.verify,
            "seed": a.seed, "spoke_args": list(a.spoke_arg), "mount_args": list(a.mount_arg),
            "tokens": not a.no_tokens}
    small_n, small_size = pick(a.small_files, 8000, 600), pick(a.small_size, 128 << 10, None)
    large_n, large_size = pick(a.large_files, 128, 16), pick(a.large_size, 8 << 20, None)
    # bench race's dataset layouts: "small" (files in folders) and "shards" (large files)
    return {
        "small": Params(**base, shards=0, shard_size=0, small_files=small_n,
                        small_size=small_size or (128 << 10), small_dirs=40,
                        datasets=["small"]),
        "large": Params(**base, shards=large_n, shard_size=large_size or (8 << 20),
                        small_files=0, small_size=0, small_dirs=1, datasets=["shards"])}


@contextlib.contextmanager
def _hub(ds: Dataset, work: Path, tokens: BenchTokens | None) -> Iterator[Any]:
    from spokefs.procs import Service, hub_args

    hub = Service(hub_args(ds.root, work / f"hubstate-{ds.name}")
                  + (tokens.hub_args() if tokens else []))
    hub.start(timeout=600)
    try:
        yield hub
    finally:
        hub.stop()


class _Meter:
    """CPU-seconds of named processes (with their children) and of this process's threads."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = {k: v for k, v in pids.items() if v is not None}

    def __enter__(self) -> _Meter:
        self.t0 = time.perf_counter()
        self.start = {k: tree_cpu_s(p) for k, p in self.pids.items()}
        t = os.times()
        self.self0 = t.user + t.system
        return self

    def __exit__(self, *exc: object) -> None:
        t = os.times()
        self.used = {k: round(tree_cpu_s(p) - self.start[k], 3) for k, p in self.pids.items()}
        self.used["readers"] = round(t.user + t.system - self.self0, 3)


def _epoch(tool: Tool, hub: Any, ds: Dataset, p: Params, epoch: int, state: str
           ) -> dict[str, Any]:
    pids: dict[str, int | None] = {"hub": hub.proc.pid if hub.proc else None, **tool.pids()}
    order = epoch_order(ds, p.readers[0], epoch, p.seed)
    with _Meter(pids) as m:
        r = run_epoch(tool, order, p.readers[0], p.timeout)
    cpu = sum(m.used.values())
    files = max(r.files_done, 1)
    return {"state": state, "seconds": round(r.seconds, 4), "files": r.files_done,
            "bytes": r.bytes_read, "files_per_s": round(r.files_done / r.seconds, 1),
            "gb_per_s": round(r.bytes_read / r.seconds / 1e9, 4), "cpu_s": m.used,
            "cpu_s_total": round(cpu, 3), "cpu_ms_per_file": round(1e3 * cpu / files, 4),
            "cpu_s_per_gib": round(cpu / max(r.bytes_read, 1) * (1 << 30), 3),
            "timed_out": r.timed_out, "error": r.error,
            "load_avg": round(os.getloadavg()[0], 2)}


def _run_tool(name: str, served: Served, work: Path, p: Params) -> list[dict[str, Any]]:
    ds, hub = served.dataset, served.hub
    tool = TOOL_CLASSES[name](served, work / name, p)
    (work / name).mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        tool.start()
        rows.append(_epoch(tool, hub, ds, p, 0, "cold"))
        if rows[-1]["error"] is None and not rows[-1]["timed_out"]:
            rows.append(_epoch(tool, hub, ds, p, 1, "warm"))
            if name == "spokefs":  # a fresh mount over the spoke that now holds it all
                from spokefs.mount.process import MountProcess, unmount

                tool.mount.stop()  # type: ignore[attr-defined]
                mp = work / name / "mnt"
                unmount(mp)
                tool.mount = MountProcess(  # type: ignore[attr-defined]
                    f"{tool.spoke.url}/{ds.name}", mp, *p.mount_args).start()  # type: ignore[attr-defined]
                rows.append(_epoch(tool, hub, ds, p, 2, "spoke_hot"))
    finally:
        tool.stop()
        shutil.rmtree(work / name, ignore_errors=True)
    return [{"tool": name, "dataset": ds.name, **r} for r in rows]


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="spokefs-bench-node-")))
        work.mkdir(parents=True, exist_ok=True)
        params = _params(args)
        names = [d for d in args.datasets.split(",") if d]
        for d in names:
            if d not in DATASETS:
                raise SystemExit(f"spokefs bench node: unknown dataset {d!r} ({DATASETS})")
        tools = params[names[0]].tools if names else []
        missing = {t: why for t in tools if (why := TOOL_CLASSES[t].missing())}
        for t, why in missing.items():
            msg = missing_peer(t, why)
            if not args.allow_missing_peers:
                raise SystemExit(f"spokefs bench node: {msg} (or --allow-missing-peers)")
            print(f"MISSING {msg}", flush=True)
        tokens = None if args.no_tokens else BenchTokens.make(work / "auth")
        rows: list[dict[str, Any]] = []
        sizes: dict[str, dict[str, int]] = {}
        for name in names:
            p = params[name]
            # the folder's name is the hub's dataset name: bench race's "small" and "shards"
            ds = build_dataset(work / "data", "small" if name == "small" else "shards", p)
            sizes[name] = {"files": len(ds.paths), "bytes": ds.bytes}
            print(f"{name}: {len(ds.paths)} files, {format_size(ds.bytes)}", flush=True)
            with _hub(ds, work, tokens) as hub, \
                    tokens.as_client() if tokens else contextlib.nullcontext():
                served = Served(ds, hub, _Direct(hub.url), None, tokens)  # type: ignore[arg-type]
                for t in tools:
                    if t in missing:
                        continue
                    for r in _run_tool(t, served, work / "run", p):
                        r["dataset"] = name
                        rows.append(r)
                        print(_line(r), flush=True)
        _ratios(rows)
        doc = {"bench": "node", "params": {"readers": args.readers, "datasets": sizes,
                                           "tokens": not args.no_tokens,
                                           "spoke_args": args.spoke_arg,
                                           "mount_args": args.mount_arg},
               "results": rows, "missing": missing, "goals": GOALS,
               "headlines": {k: f.value for k, f in headlines({"results": rows}).items()},
               "machine": machine()}
        write_json(out, doc)
        (out / "table.md").write_text(_table(rows) + "\n")
        print(_table(rows))
        if have_matplotlib():
            _plot(rows, out / "node.png")
        bad = [r for r in rows if r["error"] or r["timed_out"]]
        for r in bad:
            print(f"FAILED {r['tool']} {r['dataset']} {r['state']}: "
                  f"{r['error'] or 'timed out'}", flush=True)
        return 1 if bad else 0
    return 0


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's throughput over the plain read's in the state it is compared with."""
    local = {(r["dataset"], r["state"]): r for r in rows if r["tool"] == "local"}
    for r in rows:
        ref = local.get((r["dataset"], STATES.get(r["state"], r["state"])))
        r["ratio_vs_local"] = (round(r["files_per_s"] / ref["files_per_s"], 3)
                               if ref and ref["files_per_s"] else None)


def headlines(doc: dict[str, Any]) -> dict[str, Figure]:
    by = {(r["tool"], r["dataset"], r["state"]): r for r in doc.get("results", [])}

    def get(tool: str, ds: str, state: str, key: str) -> float | None:
        r = by.get((tool, ds, state))
        return None if r is None or r.get("error") or r.get("timed_out") else r.get(key)

    return {
        "small_cold_ratio": Figure(get("spokefs", "small", "cold", "ratio_vs_local"),
                                   GOALS["small_cold_ratio"]),
        "small_cpu_ms_per_file": Figure(get("spokefs", "small", "cold", "cpu_ms_per_file"),
                                        GOALS["small_cpu_ms_per_file"]),
        "small_warm_ratio": Figure(get("spokefs", "small", "warm", "ratio_vs_local"),
                                   GOALS["small_warm_ratio"]),
        "small_spoke_hot_ratio": Figure(get("spokefs", "small", "spoke_hot",
                                            "ratio_vs_local")),
        "large_cold_ratio": Figure(get("spokefs", "large", "cold", "ratio_vs_local"),
                                   GOALS["large_cold_ratio"]),
        "large_cpu_s_per_gib": Figure(get("spokefs", "large", "cold", "cpu_s_per_gib"),
                                      GOALS["large_cpu_s_per_gib"]),
        "rclone_small_cold_ratio": Figure(get("rclone", "small", "cold", "ratio_vs_local")),
        "rclone_large_cold_ratio": Figure(get("rclone", "large", "cold", "ratio_vs_local")),
    }


def _line(r: dict[str, Any]) -> str:
    procs = " ".join(f"{k} {v:.2f}" for k, v in r["cpu_s"].items())
    return (f"{r['tool']:8} {r['dataset']:6} {r['state']:9} {r['files_per_s']:9.1f} files/s "
            f"{r['gb_per_s']:6.3f} GB/s  CPU {r['cpu_ms_per_file']:.3f} ms/file "
            f"{r['cpu_s_per_gib']:.2f} s/GiB ({procs})"
            + (f"  ERROR {r['error']}" if r["error"] else "")
            + ("  TIMED OUT" if r["timed_out"] else ""))


def _table(rows: list[dict[str, Any]]) -> str:
    from spokefs.tables import table

    body = [[r["dataset"], r["tool"], r["state"], f"{r['files_per_s']:.0f}",
             f"{r['gb_per_s']:.3f}",
             "-" if r.get("ratio_vs_local") is None else f"{r['ratio_vs_local']:.2f}",
             f"{r['cpu_ms_per_file']:.3f}", f"{r['cpu_s_per_gib']:.2f}",
             " ".join(f"{k}={v:.2f}" for k, v in r["cpu_s"].items())] for r in rows]
    return table(body, ["dataset", "tool", "state", "files/s", "GB/s", "÷ plain read",
                        "CPU ms/file", "CPU s/GiB", "CPU-s by process"])


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, max(len(datasets), 1), figsize=(6 * len(datasets), 4),
                             squeeze=False)
    for ax, ds in zip(axes[0], datasets, strict=False):
        mine = [r for r in rows if r["dataset"] == ds]
        labels = [f"{r['tool']}\n{r['state']}" for r in mine]
        ax.bar(range(len(mine)), [r["files_per_s"] for r in mine], color="#4c72b0")
        ax.set_xticks(range(len(mine)), labels, fontsize=7)
        ax.set_ylabel("files/s")
        ax.set_title(f"{ds}: files/s (CPU ms/file above)")
        for i, r in enumerate(mine):
            ax.annotate(f"{r['cpu_ms_per_file']:.2f}", (i, r["files_per_s"]), ha="center",
                        va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
