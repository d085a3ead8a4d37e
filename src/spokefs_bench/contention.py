"""``spokefs bench contention``: two training jobs on two datasets through one spoke.

Job A trains on a small dataset, job B on a larger one, both with the training benchmark's
loop (``spokefs_bench.training``: a real DataLoader, the accelerator a fixed sleep per
batch), each in a process of its own, through one spoke behind one emulated link. The
spoke's cache holds --cache-ratio (60%) of both datasets together: A fits in it with room
to spare, B does not fit in what A leaves (B scans its whole dataset, shuffled, each epoch).
Phases, each on a fresh, cold spoke:

  alone            A alone, then B alone (no dataset rules)
  cold             both at once, one epoch each: the link bytes of two cold jobs
  together         both at once, several epochs, no dataset rules (the baseline)
  together_shares  both at once, A's dataset with a reserved share (min_share: A's size
                   plus --share-margin, in the spoke's --dataset-config)

Per job: samples/s and accelerator utilisation over the epochs after the first, the
spoke's hit ratio for the job's dataset over the same reads (its per-dataset counts in
/v1/status), and the bytes over the link (the phase's link bytes split by what the hub sent
for each dataset, from its audit log). Every sample is checked against its source digest.
Goals (reported, never tuned for): with shares, A's hit ratio and samples/s >= 0.95 x A
alone; the cold phase's link bytes <= 1.02 x the bytes both jobs read. Writes
DIR/results.json, DIR/timeline.csv and DIR/contention.png, and prints a table. Definitions:
docs/benchmark.md ("Two jobs on one spoke").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spokefs.errors import ConfigError
from spokefs.units import parse_duration, parse_rate, parse_size
from spokefs.wan.cli import _arg
from spokefs_bench.common import Figure, add_repeat, have_matplotlib, machine, table, write_json

if TYPE_CHECKING:
    from spokefs.procs import Service
    from spokefs_bench.training.datasets import BuiltDataset, Index
    from spokefs_bench.training.loop import LoopConfig
    from spokefs_bench.training.metrics import Batch
    from spokefs_bench.training.openers import Opener

JOBS = ("A", "B")
PHASES = ("alone", "together", "together_shares")  # results.json's "results"
DATASETS = {"A": "job-a", "B": "job-b"}            # their names on the hub
GOAL_SHARES_VS_ALONE = 0.95  # A's hit ratio and samples/s with shares, over A alone
GOAL_COLD_LINK = 1.02        # link bytes of two cold jobs over the bytes they read
SETTLE_S = 0.3  # after a phase: replica workers report counts every 50 ms, audit lines land


@dataclass(frozen=True)
class ContentionConfig:
    out: Path
    samples: int = 1000             # both datasets together
    a_fraction: float = 0.3         # of the samples, in A's dataset
    sample_size: int = 100_000
    classes: int = 10
    epochs: int = 6                 # job A's
    epochs_b: int | None = None     # job B's (default: enough to outlast A)
    batch_size: int = 16
    workers: int = 4
    compute_s: float = 0.1
    seed: int = 0
    cache_ratio: float = 0.6        # cache = this x (A + B)
    share_margin: float = 0.1       # A's min_share = A x (1 + margin) / cache
    rtt: float = 0.06
    bandwidth: float = 400e6
    reader: str = "http"            # "http" (ranged GETs to the spoke) or "mount"
    policy: str | None = None       # the spoke's --policy (None: its default)
    spoke_workers: int | None = None
    data_dir: Path | None = None

    def split(self) -> tuple[int, int]:
        """(samples of A, samples of B)."""
        a = max(1, round(self.samples * self.a_fraction))
        return a, self.samples - a

    def b_epochs(self) -> int:
        """B's epochs: given, or enough that B is still reading when A ends (A's epochs
        times A's share of B's samples, plus one), so every epoch of A has B beside it."""
        if self.epochs_b:
            return self.epochs_b
        a, b = self.split()
        return max(2, math.ceil(self.epochs * a / b) + 1)

    def check(self) -> None:
        if self.split()[1] < 1 or not 0 < self.a_fraction < 1:
            raise ConfigError("--a-fraction must leave samples to both datasets (0 < f < 1)")
        if self.epochs < 2 or self.b_epochs() < 2:
            raise ConfigError("--epochs and --epochs-b must be at least 2 (the figures are "
                              "the epochs after the first)")
        if not 0 < self.cache_ratio <= 1:
            raise ConfigError("--cache-ratio must be in (0, 1]")
        if self.share_margin < 0:
            raise ConfigError("--share-margin must be >= 0")
        if self.reader not in ("http", "mount"):
            raise ConfigError(f"unknown --reader {self.reader!r} (http or mount)")

    def loop(self, epochs: int) -> LoopConfig:
        from spokefs_bench.training.loop import LoopConfig

        return LoopConfig(epochs=epochs, batch_size=self.batch_size, workers=self.workers,
                          compute_s=self.compute_s, seed=self.seed)


# -- the command -----------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("contention", help="two training jobs through one spoke, with and "
                       "without reserved shares", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--samples", type=int, default=1000,
                   help="samples of both datasets together (default 1000)")
    p.add_argument("--a-fraction", type=float, default=0.3, metavar="F",
                   help="share of the samples in job A's dataset (default 0.3)")
    p.add_argument("--sample-size", type=_arg(parse_size), default=100_000, metavar="SIZE",
                   help="mean sample size, uniform within +-25%% (default 100KB)")
    p.add_argument("--classes", type=int, default=10, help="class folders (default 10)")
    p.add_argument("--epochs", type=int, default=6, help="job A's epochs (default 6)")
    p.add_argument("--epochs-b", type=int, default=None, metavar="N",
                   help="job B's epochs (default: enough that B outlasts A, at least 2)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch (default 16)")
    p.add_argument("--workers", type=int, default=4,
                   help="DataLoader workers per job (default 4)")
    p.add_argument("--compute", type=_arg(parse_duration), default=0.1, metavar="DURATION",
                   help="emulated accelerator time per batch (default 100ms)")
    p.add_argument("--seed", type=int, default=0, help="data and shuffle seed (default 0)")
    p.add_argument("--cache-ratio", type=float, default=0.6, metavar="F",
                   help="the spoke's cache over both datasets' bytes (default 0.6)")
    p.add_argument("--share-margin", type=float, default=0.1, metavar="F",
                   help="A's reserved share: A's bytes x (1 + F) over the cache (default 0.1)")
    p.add_argument("--rtt", type=_arg(parse_duration), default=0.06, metavar="DURATION",
                   help="link round trip (default 60ms)")
    p.add_argument("--bandwidth", type=_arg(parse_rate), default=400e6, metavar="RATE",
                   help="the link's cap (default 400MB/s)")
    p.add_argument("--reader", choices=("http", "mount"), default="http",
                   help="how the jobs read the spoke: a ranged GET per sample (the default: "
                   "every read reaches the spoke's cache) or spokefs mount (the kernel's "
                   "page cache then answers repeated reads on this one host)")
    p.add_argument("--policy", default=None,
                   help="the spoke's eviction --policy (default: the spoke's default)")
    p.add_argument("--spoke-workers", type=int, default=None, metavar="N",
                   help="the spoke's --workers (default: the spoke's default)")
    p.add_argument("--data-dir", type=Path,
                   help="where built datasets are kept for reuse (default: "
                   "$TMPDIR/spokefs-bench-train)")
    p.set_defaults(func=_run)
    add_repeat(p, headlines)


def _run(args: argparse.Namespace) -> int:
    cfg = ContentionConfig(
        out=args.out, samples=args.samples, a_fraction=args.a_fraction,
        sample_size=args.sample_size, classes=args.classes, epochs=args.epochs,
        epochs_b=args.epochs_b, batch_size=args.batch_size, workers=args.workers,
        compute_s=args.compute, seed=args.seed, cache_ratio=args.cache_ratio,
        share_margin=args.share_margin, rtt=args.rtt, bandwidth=args.bandwidth,
        reader=args.reader, policy=args.policy, spoke_workers=args.spoke_workers,
        data_dir=args.data_dir)
    doc = run_contention(cfg)
    wrong = sum(r["bytes_wrong"] for phase in doc["results"].values() for r in phase.values())
    wrong += sum(r["bytes_wrong"] for r in doc["cold"]["jobs"].values())
    return 1 if wrong else 0


# -- the jobs' processes ---------------------------------------------------------------------
@dataclass(frozen=True)
class JobRun:
    """One job's run in one phase: what its process trains on and reads through."""

    job: str
    dataset: str
    index: Index
    classes: int
    loop: LoopConfig
    opener: Opener
    spoke_url: str


def spoke_hits_misses(spoke_url: str, dataset: str) -> tuple[int, int]:
    """The spoke's (hits, misses) of ``dataset``'s blocks so far (``/v1/status``
    ``datasets.hits_misses``; every worker's reads, the replicas' as last reported)."""
    from spokefs_bench.training.scenarios import http_json

    hm = http_json(spoke_url.rstrip("/") + "/v1/status")["datasets"]["hits_misses"]
    hits, misses = hm.get(dataset, (0, 0))
    return int(hits), int(misses)


def _job_main(conn: Connection) -> None:
    """A job's process: one loop per ``JobRun`` it is sent (None: exit). It says "ready"
    once its DataLoader workers exist and starts its clock on "go"; it answers the run's
    timeline, or the error."""
    while True:
        run = conn.recv()
        if run is None:
            return
        try:
            conn.send(("result", _run_job(run, conn)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _run_job(run: JobRun, conn: Connection) -> dict[str, Any]:
    from spokefs_bench.training.loop import run_loop

    mark: dict[str, Any] = {}

    def ready() -> None:
        conn.send(("ready", None))
        if conn.recv() != "go":
            raise RuntimeError("the phase was called off before it started")

    def on_batch(b: Batch) -> None:
        # The first batch of the second epoch is here: every read of the first epoch is
        # done (batches arrive in order), so the counts from now on are the later epochs'.
        if b.epoch == 1 and b.index == 0:
            mark.update(hits_misses=spoke_hits_misses(run.spoke_url, run.dataset),
                        unix=time.time(), t=b.t)

    out = run_loop(run.index, "files", run.opener, run.loop, run.classes,
                   on_batch=on_batch, ready=ready)
    return {"timeline": out.timeline, "samples_wrong": out.samples_wrong,
            "bytes_wrong": out.bytes_wrong, "started_unix": out.started_unix,
            "mark": mark or None}


class JobProcess:
    """A job's process (spawned: it imports torch once, for every phase), run by messages."""

    def __init__(self, job: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.job = job
        self.conn, child = ctx.Pipe()
        # Not a daemon: its DataLoader forks workers of its own.
        self.proc = ctx.Process(target=_job_main, args=(child,), name=f"contention-job-{job}")
        self.proc.start()
        child.close()

    def send(self, msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, expect: str, timeout: float) -> Any:
        end = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"job {self.job}'s process exited "
                                   f"(status {self.proc.exitcode})")
            if time.monotonic() > end:
                raise RuntimeError(f"job {self.job}: no {expect!r} within {timeout:g}s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"job {self.job} failed:\n{payload}")
        if kind != expect:
            raise RuntimeError(f"job {self.job}: {kind!r} where {expect!r} was due")
        return payload

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(15)
        self.conn.close()


# -- figures (sans-I/O) ----------------------------------------------------------------------
def after_first_epoch(timeline: Sequence[Batch]) -> dict[str, float | None]:
    """Samples/s and AU over the epochs after the first (from the end of the first epoch's
    last batch to the end of the run); None for a run of one epoch."""
    from spokefs_bench.training.metrics import epoch_spans

    spans = epoch_spans(timeline)
    if len(spans) < 2:
        return {"samples_per_s": None, "au": None, "wall_s": None}
    start = spans[1][0]
    wall = timeline[-1].t - timeline[start - 1].t
    rest = timeline[start:]
    if wall <= 0:
        return {"samples_per_s": None, "au": None, "wall_s": None}
    return {"samples_per_s": sum(b.samples for b in rest) / wall,
            "au": min(1.0, sum(b.compute_s for b in rest) / wall), "wall_s": wall}


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def attribute(link_bytes: int, hub_bytes: dict[str, int], dataset: str) -> int:
    """The share of the phase's link bytes (both ways, headers included) that is
    ``dataset``'s: the link bytes x its share of the bytes the hub sent."""
    total = sum(hub_bytes.values())
    return round(link_bytes * hub_bytes.get(dataset, 0) / total) if total else 0


def hub_bytes_by_dataset(audit: Path, since: float, until: float) -> dict[str, int]:
    """Bytes the hub sent per dataset between two Unix times, from its audit log (one JSON
    line per read; the 64 MiB rotation is far off at these sizes)."""
    out: dict[str, int] = {}
    if not audit.exists():
        return out
    for line in audit.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == "read" and doc.get("bytes") and \
                since <= float(doc.get("ts", 0)) <= until:
            out[doc["dataset"]] = out.get(doc["dataset"], 0) + int(doc["bytes"])
    return out


def job_figures(run: dict[str, Any], final: tuple[int, int], data: BuiltDataset,
                dataset: str, wan_bytes: int, hub_bytes: int,
                steady_hub_bytes: int | None) -> dict[str, Any]:
    """One job's row: the steady figures (after the first epoch), the whole run's, the
    spoke's counts for its dataset, the link bytes that were its (``steady_hub_bytes``: what
    the hub sent for its dataset after the job's mark, None without one)."""
    from spokefs_bench.training import metrics

    tl = run["timeline"]
    s = metrics.summarize(tl)
    steady = after_first_epoch(tl)
    spans = metrics.epoch_spans(tl)
    steady_read = sum(b.bytes for b in tl[spans[1][0]:]) if len(spans) > 1 else 0
    hits, misses = final
    mark = run["mark"]
    h = m = None
    if mark is not None:
        h, m = hits - mark["hits_misses"][0], misses - mark["hits_misses"][1]
    return {
        "samples_per_s": steady["samples_per_s"], "au": steady["au"],
        "hit_ratio": ratio(h, (h or 0) + (m or 0)) if h is not None else None,
        "wan_bytes": wan_bytes, "hub_bytes": hub_bytes,
        "steady_bytes_read": steady_read, "steady_hub_bytes": steady_hub_bytes,
        "steady_refetch_ratio": ratio(steady_hub_bytes, steady_read),
        "steady_hits": h, "steady_misses": m, "hits": hits, "misses": misses,
        "hit_ratio_all": ratio(hits, hits + misses),
        "steady_wall_s": steady["wall_s"],
        "au_all": s["au"], "samples_per_s_last_epoch": s["samples_per_s_steady"],
        "au_last_epoch": s["au_steady"], "first_epoch_s": s["first_epoch_s"],
        "epoch_s": s["epoch_s"], "wall_s": s["wall_s"], "stall_batches": s["stall_batches"],
        "epochs": len(s["epoch_s"]), "batches": s["batches"], "samples": s["samples"],
        "bytes_read": s["bytes_read"], "samples_wrong": run["samples_wrong"],
        "bytes_wrong": run["bytes_wrong"], "dataset": dataset,
        "dataset_bytes": data.bytes, "dataset_samples": len(data.index),
        "started_unix": run["started_unix"],
    }



def goals(results: dict[str, dict[str, dict[str, Any]]],
          cold: dict[str, Any]) -> dict[str, Any]:
    """The figures the issue asks about, next to their goals (reported, never tuned for)."""
    alone = results["alone"]["A"]
    g: dict[str, Any] = {}
    for key in ("hit_ratio", "samples_per_s"):
        shared = results["together_shares"]["A"][key]
        v = ratio(shared, alone[key])
        g[f"shares_A_{key}_vs_alone"] = {
            "value": v, "together_shares": shared, "alone": alone[key],
            "goal": GOAL_SHARES_VS_ALONE, "met": v is not None and v >= GOAL_SHARES_VS_ALONE}
    for key in ("hit_ratio", "samples_per_s"):
        plain = results["together"]["A"][key]
        g[f"no_shares_A_{key}_vs_alone"] = {
            "value": ratio(plain, alone[key]), "together": plain, "alone": alone[key],
            "goal": None, "baseline": True}
    v = ratio(cold["link_bytes"], cold["read_once_bytes"])
    g["cold_link_bytes_vs_read_once"] = {
        "value": v, "link_bytes": cold["link_bytes"], "read_once_bytes": cold["read_once_bytes"],
        "goal": GOAL_COLD_LINK, "met": v is not None and v <= GOAL_COLD_LINK}
    return g


def headlines(doc: dict[str, Any]) -> dict[str, Figure]:
    """What ``--repeat`` summarises: each goal's value against its goal, and A's and B's
    steady samples/s and hit ratio per phase."""
    out: dict[str, Figure] = {}
    for phase, jobs in doc.get("results", {}).items():
        for job, r in jobs.items():
            out[f"{phase}.{job}.samples_per_s"] = Figure(r["samples_per_s"])
            out[f"{phase}.{job}.hit_ratio"] = Figure(r["hit_ratio"])
    for name, v in doc.get("goals", {}).items():
        out[f"goal {name}"] = Figure(v["value"], v.get("goal"))
    return out


# -- the run ---------------------------------------------------------------------------------
@dataclass
class Setup:
    """What every phase shares: the datasets, the hub (with its audit log), the link."""

    data: dict[str, BuiltDataset]
    snapshots: dict[str, str]
    link: Service
    audit: Path
    work: Path
    logs: Path
    cache_size: int
    min_share: float


def _rules(cfg: ContentionConfig, min_share: float) -> str:
    """The spoke's dataset rules for ``together_shares``: A's reservation."""
    return f'[datasets.{DATASETS["A"]}]\nmin_share = {min_share!r}\n'


@contextlib.contextmanager
def _readers(cfg: ContentionConfig, st: Setup, spoke: Service, jobs: Sequence[str],
             tag: str) -> Iterator[dict[str, Opener]]:
    """Each job's opener on the spoke: HTTP, or a ``spokefs mount`` of its dataset."""
    from spokefs_bench.common import spokefs_mount
    from spokefs_bench.training.openers import FileOpener, HttpOpener

    with contextlib.ExitStack() as stack:
        out: dict[str, Opener] = {}
        for job in jobs:
            ds, snap = DATASETS[job], st.snapshots[job]
            if cfg.reader == "http":
                out[job] = HttpOpener(spoke.url, ds, snap, "ranged GET per sample -> spoke")
                continue
            mp = st.work / f"{tag}-{job}-mnt"
            stack.enter_context(spokefs_mount(f"{spoke.url}/{ds}@{snap}", mp,
                                              st.logs / f"{tag}-{job}-mount.log"))
            out[job] = FileOpener(mp, "spokefs mount (FUSE) -> spoke")
        yield out


def _phase(cfg: ContentionConfig, st: Setup, procs: dict[str, JobProcess], tag: str,
           epochs: dict[str, int], rules: str | None) -> dict[str, Any]:
    """One phase on a fresh spoke: the jobs in ``epochs`` start together; their figures,
    the phase's link bytes and the spoke's view of the shares."""
    from spokefs_bench.training.scenarios import cold_spoke, http_json, wan_bytes

    extra: list[str] = []
    if rules is not None:
        path = st.work / f"{tag}-datasets.toml"
        path.write_text(rules)
        extra += ["--dataset-config", str(path)]
    if cfg.policy:
        extra += ["--policy", cfg.policy]
    if cfg.spoke_workers:
        extra += ["--workers", str(cfg.spoke_workers)]
    jobs = list(epochs)
    print(f"{tag}: job{'s' if len(jobs) > 1 else ''} {' and '.join(jobs)} "
          f"({', '.join(f'{j}: {epochs[j]} epochs' for j in jobs)})", flush=True)
    with cold_spoke(st.link.url, st.work / f"{tag}-cache", st.cache_size,
                    st.logs / f"{tag}-spoke.log", *extra) as spoke, \
            _readers(cfg, st, spoke, jobs, tag) as openers:
        for j in jobs:
            procs[j].send(JobRun(j, DATASETS[j], st.data[j].index, cfg.classes,
                                 cfg.loop(epochs[j]), openers[j], spoke.url))
        for j in jobs:
            procs[j].recv("ready", 600)
        before, t0 = wan_bytes(st.link), time.time()
        for j in jobs:
            procs[j].send("go")
        runs = {j: procs[j].recv("result", 6 * 3600) for j in jobs}
        time.sleep(SETTLE_S)
        link_bytes, t1 = wan_bytes(st.link) - before, time.time()
        status = http_json(spoke.url + "/v1/status")
        upstream = _upstream_bytes(spoke.url)
    hub = hub_bytes_by_dataset(st.audit, t0, t1 + 1)
    hm = status["datasets"]["hits_misses"]
    figures = {}
    for j in jobs:
        ds = DATASETS[j]
        hits, misses = hm.get(ds, (0, 0))
        mark = runs[j]["mark"]
        steady_hub = (hub_bytes_by_dataset(st.audit, mark["unix"], t1 + 1).get(ds, 0)
                      if mark else None)
        figures[j] = job_figures(runs[j], (int(hits), int(misses)), st.data[j], ds,
                                 attribute(link_bytes, hub, ds), hub.get(ds, 0), steady_hub)
    info = {"link_bytes": link_bytes, "hub_bytes": hub, "wall_s": round(t1 - t0, 3),
            "spoke_hits": status["hits"], "spoke_misses": status["misses"],
            "upstream_bytes_by_reason": upstream,
            "cache": status["cache"], "shares": status["datasets"].get("shares"),
            "dataset_rules": rules}
    for j, r in figures.items():
        hr = "-" if r["hit_ratio"] is None else f"{r['hit_ratio']:.3f}"
        sps = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:.1f}"
        print(f"  {j}: {sps} samples/s, hit ratio {hr} (after the first epoch), "
              f"link {r['wan_bytes'] / 1e6:.1f} MB, first epoch {r['first_epoch_s']:.1f} s",
              flush=True)
    return {"jobs": figures, "info": info, "timelines": {j: runs[j]["timeline"] for j in jobs}}


def _upstream_bytes(spoke_url: str) -> dict[str, float]:
    """The spoke's ``spokefs_upstream_bytes_total`` by reason (demand, prefetch, ...) and
    its pass-through bytes, from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(spoke_url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("spokefs_upstream_bytes_total{"):
            out[name.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
        elif name == "spokefs_passthrough_bytes_total":
            out["passthrough"] = float(value)
    return out


@contextlib.contextmanager
def _setup(cfg: ContentionConfig, work: Path) -> Iterator[Setup]:
    """The two datasets (built once, reused), the hub serving both (audit log on) and the
    link in front of it."""
    from spokefs.procs import Service
    from spokefs_bench.training.datasets import DatasetSpec, default_cache_dir, ensure_dataset
    from spokefs_bench.training.run import link_service
    from spokefs_bench.training.scenarios import http_json

    logs = cfg.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    n = dict(zip(JOBS, cfg.split(), strict=True))
    data_dir = cfg.data_dir or default_cache_dir()
    data = {j: ensure_dataset(DatasetSpec("files", n[j], cfg.sample_size, cfg.classes,
                                          seed=cfg.seed + k), data_dir, progress=False)
            for k, j in enumerate(JOBS)}
    total = sum(d.bytes for d in data.values())
    cache_size = int(cfg.cache_ratio * total)
    min_share = data["A"].bytes * (1 + cfg.share_margin) / cache_size
    if min_share > 1:
        raise ConfigError(f"dataset A ({data['A'].bytes} bytes) and its margin do not fit the "
                          f"cache ({cache_size} bytes): lower --a-fraction or --share-margin, "
                          "or raise --cache-ratio")
    audit = work / "hub-audit.jsonl"
    hub = Service(["hub", "serve", "--port", "0", "--state-dir", str(work / "hubstate"),
                   "--audit-log", str(audit),
                   *(a for j in JOBS for a in ("--dataset", f"{DATASETS[j]}={data[j].root}"))],
                  log_path=logs / "hub.log")
    with contextlib.ExitStack() as stack:
        stack.enter_context(hub.start(timeout=600))
        link = stack.enter_context(link_service(hub.hostport, cfg.rtt, cfg.bandwidth,
                                                logs / "wan.log").start())
        snaps = {j: http_json(f"{hub.url}/v1/datasets/{DATASETS[j]}/snapshots/latest")["id"]
                 for j in JOBS}
        yield Setup(data, snaps, link, audit, work, logs, cache_size, min_share)


def run_contention(cfg: ContentionConfig) -> dict[str, Any]:
    """Every phase; results.json, timeline.csv and contention.png in ``cfg.out``; the table
    printed. Returns the results document."""
    from spokefs_bench.training.run import write_timeline

    cfg.check()
    t_begin = time.monotonic()
    cfg.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="spokefs-bench-contention-"))
    procs: dict[str, JobProcess] = {}
    phases: dict[str, dict[str, Any]] = {}
    try:
        with _setup(cfg, work) as st:
            procs = {j: JobProcess(j) for j in JOBS}
            both = {"A": cfg.epochs, "B": cfg.b_epochs()}
            phases["alone/A"] = _phase(cfg, st, procs, "alone-A", {"A": cfg.epochs}, None)
            phases["alone/B"] = _phase(cfg, st, procs, "alone-B", {"B": cfg.b_epochs()}, None)
            phases["cold"] = _phase(cfg, st, procs, "cold", {"A": 1, "B": 1}, None)
            phases["together"] = _phase(cfg, st, procs, "together", both, None)
            phases["together_shares"] = _phase(cfg, st, procs, "together_shares", both,
                                               _rules(cfg, st.min_share))
            data, cache_size, min_share = st.data, st.cache_size, st.min_share
    finally:
        for p in procs.values():
            p.close()
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "alone": {"A": phases["alone/A"]["jobs"]["A"], "B": phases["alone/B"]["jobs"]["B"]},
        "together": phases["together"]["jobs"],
        "together_shares": phases["together_shares"]["jobs"],
    }
    cold_jobs = phases["cold"]["jobs"]
    cold = {"link_bytes": phases["cold"]["info"]["link_bytes"],
            "read_once_bytes": sum(r["bytes_read"] for r in cold_jobs.values()),
            "jobs": {j: {k: r[k] for k in ("first_epoch_s", "wan_bytes", "hub_bytes",
                                           "bytes_read", "hit_ratio_all", "samples_wrong",
                                           "bytes_wrong")} for j, r in cold_jobs.items()}}
    a_bytes, b_bytes = data["A"].bytes, data["B"].bytes
    min_bytes = int(min_share * cache_size)
    params = {
        **{k: (str(v) if isinstance(v, Path) else v)
           for k, v in dataclasses.asdict(cfg).items()},
        "epochs_a": cfg.epochs, "epochs_b": cfg.b_epochs(),
        "datasets": {j: {"name": DATASETS[j], "path": str(d.root), "samples": len(d.index),
                         "bytes": d.bytes} for j, d in data.items()},
        "cache_size": cache_size, "min_share_a": min_share, "reserved_bytes_a": min_bytes,
        "accelerator": cfg.loop(cfg.epochs).describe_accelerator(),
        "steady": "the epochs after each job's first (hit ratio: the reads after its second "
                  "epoch's first batch arrived)",
        "checks": {"a_fits_its_share": a_bytes <= min_bytes,
                   "b_larger_than_its_part": b_bytes > cache_size - min_bytes,
                   "b_larger_than_the_cache": b_bytes > cache_size},
        "phases": {k: v["info"] for k, v in phases.items()},
        "runtime_s": round(time.monotonic() - t_begin, 1), "machine": machine(),
        "definitions": "docs/benchmark.md (\"Two jobs on one spoke\")",
    }
    doc = {"params": params, "results": results, "cold": cold, "goals": goals(results, cold)}
    # "alone/A", "alone/B", "cold/A", ..., "together_shares/B"
    timelines = {phase if phase.startswith("alone/") else f"{phase}/{j}": tl
                 for phase, v in phases.items() for j, tl in v["timelines"].items()}
    write_timeline(cfg.out / "timeline.csv", timelines)
    figures = []
    if have_matplotlib():
        figures.append(str(plot(cfg.out / "contention.png", doc, timelines)))
    params["figures"] = figures
    write_json(cfg.out, doc)
    print(summary(doc))
    return doc


# -- table and plot --------------------------------------------------------------------------
COLUMNS = ["phase", "job", "samples/s", "AU", "hit ratio", "refetch", "link MB",
           "first epoch s", "epochs", "samples/s all", "wrong B"]


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def summary(doc: dict[str, Any]) -> str:
    rows = []
    for phase, jobs in doc["results"].items():
        for job, r in jobs.items():
            all_sps = r["samples"] / r["wall_s"] if r["wall_s"] else None
            rows.append([phase, job, _f(r["samples_per_s"], ".1f"), _f(r["au"], ".3f"),
                         _f(r["hit_ratio"], ".3f"), _f(r["steady_refetch_ratio"], ".3f"),
                         f"{r['wan_bytes'] / 1e6:.1f}",
                         f"{r['first_epoch_s']:.1f}", r["epochs"], _f(all_sps, ".1f"),
                         r["bytes_wrong"]])
    p = doc["params"]
    lines = [table(rows, COLUMNS),
             "samples/s, AU, hit ratio: the epochs after each job's first (steady); hit ratio: "
             "the spoke's hits / (hits + misses) of the job's dataset's blocks (a block the "
             "spoke prefetched in time is a hit); refetch: what the hub sent for the dataset "
             "then, over the bytes the job read; link MB: the phase's link bytes split by "
             "what the hub sent per dataset",
             f"datasets: A {p['datasets']['A']['bytes'] / 1e6:.1f} MB, B "
             f"{p['datasets']['B']['bytes'] / 1e6:.1f} MB; cache {p['cache_size'] / 1e6:.1f} "
             f"MB; A's reserved share {p['min_share_a']:.3f} "
             f"({p['reserved_bytes_a'] / 1e6:.1f} MB) in together_shares; reader {p['reader']}"]
    c = doc["cold"]
    lines.append(f"cold: both jobs' first epochs at once moved {c['link_bytes'] / 1e6:.2f} MB "
                 f"over the link for {c['read_once_bytes'] / 1e6:.2f} MB read")
    for name, v in doc["goals"].items():
        value = "-" if v["value"] is None else f"{v['value']:.3f}"
        verdict = ("baseline" if v.get("baseline") else
                   f"goal {'>=' if 'vs_alone' in name else '<='} {v['goal']}, "
                   f"{'met' if v['met'] else 'NOT met'}")
        lines.append(f"{name}: {value} ({verdict})")
    for check, ok in p["checks"].items():
        if not ok:
            lines.append(f"WARNING setup: {check} does not hold at these sizes")
    lines.append(f"runtime {p['runtime_s']:.0f} s")
    for fig in p.get("figures", []):
        lines.append(f"figure: {fig}")
    return "\n".join(lines)


def plot(path: Path, doc: dict[str, Any], timelines: dict[str, list[Batch]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spokefs_bench.training.plots import smoothed

    res = doc["results"]
    fig = plt.figure(figsize=(14, 8.5))
    grid = fig.add_gridspec(2, 12)
    panels = [("samples_per_s", "samples/s (steady)", 1.0), ("hit_ratio", "hit ratio (steady)",
                                                              1.0),
              ("au", "accelerator utilisation (steady)", 1.0), ("wan_bytes", "link MB", 1e-6)]
    colors = {"A": "tab:blue", "B": "tab:orange"}
    x = range(len(PHASES))
    for k, (key, title, scale) in enumerate(panels):
        ax = fig.add_subplot(grid[0, 3 * k:3 * k + 3])
        for i, job in enumerate(JOBS):
            vals = [(res[ph][job][key] or 0.0) * scale for ph in PHASES]
            ax.bar([v + (i - 0.5) * 0.38 for v in x], vals, 0.38, color=colors[job],
                   label=f"job {job}")
        alone = res["alone"]["A"][key]
        if key in ("samples_per_s", "hit_ratio") and alone:
            ax.axhline(GOAL_SHARES_VS_ALONE * alone * scale, color="k", ls="--", lw=0.8,
                       label=f"{GOAL_SHARES_VS_ALONE} x A alone")
        ax.set_xticks(list(x), list(PHASES), fontsize=8, rotation=15)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if k == 0:
            ax.legend(fontsize=7, loc="lower left")
    for k, phase in enumerate(("alone", "together", "together_shares")):
        ax = fig.add_subplot(grid[1, 4 * k:4 * k + 4])
        for job in JOBS:
            tl = timelines.get(f"alone/{job}" if phase == "alone" else f"{phase}/{job}")
            if not tl:
                continue
            rate, _ = smoothed(tl)
            ax.plot([b.t for b in tl], rate, color=colors[job], lw=1.2, label=f"job {job}")
            ends = [tl[i].t for i in range(len(tl) - 1) if tl[i + 1].epoch != tl[i].epoch]
            for t in ends:
                ax.axvline(t, color=colors[job], ls=":", lw=0.7)
        ax.set_title(f"{phase}: samples/s over time (dotted: epoch ends)"
                     + (" (each job alone)" if phase == "alone" else ""), fontsize=9)
        ax.set_xlabel("seconds from the job's start")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    p = doc["params"]
    fig.suptitle(f"spokefs bench contention: A {p['datasets']['A']['bytes'] / 1e6:.0f} MB, "
                 f"B {p['datasets']['B']['bytes'] / 1e6:.0f} MB, cache "
                 f"{p['cache_size'] / 1e6:.0f} MB, A's share {p['min_share_a']:.2f}, batch "
                 f"{p['batch_size']}, {p['compute_s'] * 1e3:g} ms per batch, link "
                 f"{p['rtt'] * 1e3:g} ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
