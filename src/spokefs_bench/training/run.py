"""Running the training benchmark: datasets, hub, links, scenarios, figures, files.

``run_train(TrainConfig(...))`` is what ``spokefs bench train`` calls; ``run_seed(out)`` is
the reference experiment at small scale (``spokefs bench seed``, and the demo).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from spokefs.errors import ConfigError
from spokefs.procs import Service, hub_args
from spokefs_bench.common import (
    Figure,
    have_matplotlib,
    machine,
    missing_peer,
    table,
    write_json,
)
from spokefs_bench.training import metrics
from spokefs_bench.training.datasets import (
    BuiltDataset,
    DatasetSpec,
    default_cache_dir,
    ensure_dataset,
)
from spokefs_bench.training.loop import LoopConfig, batches_per_epoch, run_loop
from spokefs_bench.training.metrics import Batch
from spokefs_bench.training.plots import plot_bars, plot_timelines
from spokefs_bench.training.scenarios import (
    SCENARIOS,
    Env,
    Scenario,
    http_json,
    spoke_counters,
    wan_bytes,
)

MiB = 1 << 20
LINKS = ("wide", "narrow")
ALL_SCENARIOS = ("local", "local_http", "remote_direct", "remote_spoke",
                 "remote_spoke_hints", "staged", "rclone", "fsspec_cache")
PEERS = ("rclone", "fsspec_cache")
PEER_PACKAGE = {"rclone": "rclone", "fsspec_cache": "fsspec"}  # common.PEER_PACKAGES keys
ORIGINS = ("dir", "s3")
S3_BUCKET = "spokefs-train"  # --origin s3: the dataset under the prefix of its name
# Goals (docs/benchmark.md): reported next to the figures, never tuned for.
GOAL_STEADY_RATIO = 0.99
GOAL_WARMUP_BATCHES = 10
GOAL_NARROW_VS_FLOOR = 1.05


@dataclass
class TrainConfig:
    out: Path
    shapes: tuple[str, ...] = ("files",)
    scenarios: tuple[str, ...] = ALL_SCENARIOS
    samples: int = 800
    sample_size: int = 100_000
    classes: int = 10
    shard_size: int = 64 * MiB
    loop: LoopConfig = field(default_factory=LoopConfig)
    rtt: float = 0.06
    bandwidth: float = 400e6            # the "wide" link: well above the loop's demand
    narrow_bandwidth: float | None = None  # default: half the loop's nominal demand
    link: str = "wide"                  # the link of a scenario named without @LINK
    cache_size: int | None = None       # default: twice the dataset, so nothing is evicted
    spoke_reader: str = "auto"
    stage_inflight: int = 64
    price_per_gb: float = 0.02
    gpu_hour_price: float = 2.0
    data_dir: Path | None = None
    progress: bool = True
    title: str = "spokefs bench train"
    # What the hub serves: "dir" (the dataset's folder) or "s3" (the dataset put in a bucket
    # of a local S3 server, moto, and a hub over it, behind the same links).
    origin: str = "dir"
    # False (the CLI's default): a peer scenario that cannot run here is an error, raised
    # before any work; True: it is skipped and its row says MISSING.
    allow_missing_peers: bool = True

    def nominal_demand(self) -> float | None:
        """Bytes/s the loop consumes when data never waits (unknown with a real model)."""
        if self.loop.model or self.loop.compute_s <= 0:
            return None
        return self.loop.batch_size * self.sample_size / self.loop.compute_s

    def link_rate(self, link: str) -> float:
        if link == "wide":
            return self.bandwidth
        if self.narrow_bandwidth is not None:
            return self.narrow_bandwidth
        demand = self.nominal_demand()
        return demand / 2 if demand else 8e6


def parse_scenario(text: str, default_link: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME@LINK`` -> (name, link); link None for a scenario without one."""
    name, _, link = text.strip().partition("@")
    if name not in SCENARIOS:
        raise ConfigError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    if link and link not in LINKS:
        raise ConfigError(f"unknown link {link!r} in {text!r}; known: {', '.join(LINKS)}")
    if not SCENARIOS[name].uses_link:
        if link:
            raise ConfigError(f"scenario {name} does not use the link; drop @{link}")
        return name, None
    return name, link or default_link


def result_key(shape: str, name: str, link: str | None, shapes: int) -> str:
    key = name if link in (None, "wide") else f"{name}@{link}"
    return f"{shape}/{key}" if shapes > 1 else key


# -- one scenario ----------------------------------------------------------------------------
def run_scenario(env: Env, sc: Scenario, link: str | None, cfg: TrainConfig,
                 key: str) -> tuple[dict[str, Any], list[Batch]]:
    wan = env.links[link] if link else None
    before = wan_bytes(wan) if wan else 0
    with sc.prepare(env, link) as p:
        setup_s = 0.0

        def timed_setup() -> None:
            nonlocal setup_s
            t0 = time.perf_counter()
            assert p.setup is not None
            p.setup()
            setup_s = time.perf_counter() - t0

        total = cfg.loop.epochs * batches_per_epoch(len(env.data.index), cfg.loop.batch_size)
        with tqdm(total=total, desc=f"{key:<24}", unit="batch", disable=not cfg.progress,
                  leave=False, mininterval=0.5) as bar:
            def on_batch(b: Batch) -> None:
                bar.update(1)
                if b.index == 0:
                    bar.set_postfix_str(f"epoch {b.epoch + 1}/{cfg.loop.epochs}")

            out = run_loop(env.data.index, env.data.spec.shape, p.opener, cfg.loop,
                           env.data.spec.classes,
                           setup=timed_setup if p.setup else None,
                           wrap_sampler=p.wrap_sampler, on_batch=on_batch)
        moved = wan_bytes(wan) - before if wan else 0
        hit_ratio = None
        if p.spoke_url:
            hits, misses = spoke_counters(p.spoke_url)
            hit_ratio = hits / (hits + misses) if hits + misses else None
    res: dict[str, Any] = {
        "shape": env.data.spec.shape, "scenario": sc.name, "link": link,
        "link_rtt_s": cfg.rtt if link else None,
        "link_bytes_per_s": cfg.link_rate(link) if link else None,
        "reader": p.reader, "reader_detail": p.opener.describe, "setup_s": setup_s,
        **metrics.summarize(out.timeline),
        "samples_wrong": out.samples_wrong, "bytes_wrong": out.bytes_wrong,
        "wan_bytes": moved, "hit_ratio": hit_ratio,
        "dataset_bytes": env.data.bytes, "started_unix": out.started_unix,
        "notes": p.notes,
    }
    return res, out.timeline


def link_service(upstream: str, rtt: float, rate: float, log_path: Path) -> Service:
    """The emulated link: ``spokefs wan`` in front of ``upstream`` (host:port), a round trip
    of ``rtt`` seconds and a cap of ``rate`` bytes/s (not started)."""
    return Service(["wan", "--listen", "127.0.0.1:0", "--upstream", upstream,
                    "--rtt", repr(rtt), "--bandwidth", repr(rate)], log_path=log_path)


@contextlib.contextmanager
def _shape_env(cfg: TrainConfig, data: BuiltDataset, links: set[str],
               work: Path) -> Iterator[Env]:
    """The hub on the dataset and one ``spokefs wan`` process per link kind in front of it."""
    logs = cfg.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shape = data.spec.shape
    started: list[Any] = []
    try:
        if cfg.origin == "s3":
            hub = _bucket_hub(data, work, logs, started)
        else:
            hub = Service([*hub_args(data.root, data.state_dir), "--name", data.spec.name],
                          log_path=logs / f"{shape}-hub.log")
        started.append(hub.start(timeout=300))
        wans: dict[str, Service] = {}
        for link in sorted(links):
            w = link_service(hub.hostport, cfg.rtt, cfg.link_rate(link),
                             logs / f"{shape}-wan-{link}.log")
            started.append(w.start())
            wans[link] = w
        snap = http_json(f"{hub.url}/v1/datasets/{data.spec.name}/snapshots/latest")["id"]
        cache = cfg.cache_size or 2 * data.bytes + 64 * MiB
        yield Env(data, data.spec.name, snap, hub.url, wans, work / shape, logs, cache,
                  cfg.spoke_reader, cfg.stage_inflight, cfg.loop.epochs)
    finally:
        for s in reversed(started):
            s.stop()


def _bucket_hub(data: BuiltDataset, work: Path, logs: Path, started: list[Any]) -> Service:
    """``--origin s3``: an S3 server (added to ``started``), the dataset put in a bucket of
    it, and a hub over the bucket (not started; a fresh state: digests made as read)."""
    from spokefs_bench.s3server import (
        TEST_ENV,
        S3Server,
        bucket_hub_args,
        upload_tree,
    )

    shape = data.spec.shape
    s3 = S3Server(log_path=logs / f"{shape}-s3.log", keep_output=False)
    started.append(s3.start())
    upload_tree(s3.url, S3_BUCKET, data.root, data.spec.name)
    state = work / f"hubstate-s3-{shape}"
    shutil.rmtree(state, ignore_errors=True)
    return Service(bucket_hub_args(S3_BUCKET, data.spec.name, state, s3.url),
                   log_path=logs / f"{shape}-hub.log", env=TEST_ENV)


# -- the whole run ---------------------------------------------------------------------------
def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """Run every scenario on every shape; write results.json, timeline.csv and the figures
    to ``cfg.out``; print the summary table. Returns the results document."""
    t_begin = time.monotonic()
    planned = [parse_scenario(s, cfg.link) for s in cfg.scenarios]
    for shape in cfg.shapes:
        if shape not in ("files", "shards"):
            raise ConfigError(f"unknown dataset shape {shape!r} (files or shards)")
    if cfg.origin not in ORIGINS:
        raise ConfigError(f"unknown origin {cfg.origin!r} ({', '.join(ORIGINS)})")
    if not cfg.allow_missing_peers:
        missing = {name: why for name in dict.fromkeys(n for n, _ in planned)
                   if name in PEER_PACKAGE and (why := SCENARIOS[name].unavailable())}
        if missing:
            raise ConfigError("a peer this benchmark compares with cannot run here: " + "; ".join(
                f"{name}: {missing_peer(PEER_PACKAGE[name], why)}"
                for name, why in missing.items()) + " (or pass --allow-missing-peers)")
    cfg.out.mkdir(parents=True, exist_ok=True)
    data_dir = cfg.data_dir or default_cache_dir()
    results: dict[str, dict[str, Any]] = {}
    timelines: dict[str, list[Batch]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    datasets: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="spokefs-bench-train-"))
    try:
        for shape in cfg.shapes:
            spec = DatasetSpec(shape, cfg.samples, cfg.sample_size, cfg.classes,
                               cfg.shard_size, cfg.loop.seed)
            data = ensure_dataset(spec, data_dir, cfg.progress)
            datasets[shape] = {"name": spec.name, "path": str(data.root), "files":
                               len(data.index.files), "samples": len(data.index),
                               "bytes": data.bytes, "sample_bytes": data.sample_bytes}
            links = {link for _, link in planned if link}
            with _shape_env(cfg, data, links, work) as env:
                env.work.mkdir(parents=True, exist_ok=True)
                datasets[shape]["snapshot"] = env.snapshot
                for name, link in planned:
                    key = result_key(shape, name, link, len(cfg.shapes))
                    sc = SCENARIOS[name]
                    reason = sc.unavailable()
                    if reason:
                        if name in PEER_PACKAGE:
                            reason = missing_peer(PEER_PACKAGE[name], reason)
                        skipped[key] = reason
                        print(f"{key}: skipped: {reason}")
                        continue
                    try:
                        results[key], timelines[key] = run_scenario(env, sc, link, cfg, key)
                    except Exception as exc:  # one broken peer must not lose the others
                        failed[key] = f"{type(exc).__name__}: {exc}"
                        print(f"{key}: FAILED: {failed[key]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = finish(cfg, results, timelines, skipped, failed, datasets,
                 time.monotonic() - t_begin)
    return doc


def _demand(cfg: TrainConfig, results: dict[str, dict[str, Any]], shape: str) -> float | None:
    """Dataset bytes per epoch / the local epoch time (its last epoch): what the loop reads
    at full speed. Without a local run, the nominal demand."""
    for r in results.values():
        if r["scenario"] == "local" and r["shape"] == shape and r["epoch_s"]:
            per_epoch = r["bytes_read"] / len(r["epoch_s"])
            return per_epoch / r["epoch_s"][-1]
    return cfg.nominal_demand()


def _local_timeline(results: dict[str, dict[str, Any]], timelines: dict[str, list[Batch]],
                    shape: str) -> list[Batch] | None:
    """The co-located (``local``) run's timeline for ``shape``, when it ran."""
    for key, r in results.items():
        if r["scenario"] == "local" and r["shape"] == shape:
            return timelines.get(key)
    return None


def finish(cfg: TrainConfig, results: dict[str, dict[str, Any]],
           timelines: dict[str, list[Batch]], skipped: dict[str, str], failed: dict[str, str],
           datasets: dict[str, Any], runtime_s: float) -> dict[str, Any]:
    for key, r in results.items():
        r["demand_bytes_per_s"] = _demand(cfg, results, r["shape"])
        # Warm-up against local of this same run: a dip both have is not the data path's.
        r.update(metrics.vs_local(timelines[key],
                                  _local_timeline(results, timelines, r["shape"])))
        r.update(metrics.cost(r["wan_bytes"], r["idle_s"], cfg.price_per_gb,
                              cfg.gpu_hour_price))
    params = {
        "shapes": list(cfg.shapes), "scenarios": list(cfg.scenarios),
        "samples": cfg.samples, "sample_size": cfg.sample_size, "classes": cfg.classes,
        "shard_size": cfg.shard_size, **dataclasses.asdict(cfg.loop),
        "accelerator": cfg.loop.describe_accelerator(),
        "rtt_s": cfg.rtt, "link_bytes_per_s": {k: cfg.link_rate(k) for k in LINKS},
        "default_link": cfg.link, "spoke_reader": cfg.spoke_reader,
        "stage_inflight": cfg.stage_inflight, "origin": cfg.origin,
        "price_per_gb": cfg.price_per_gb,
        "gpu_hour_price": cfg.gpu_hour_price, "nominal_demand_bytes_per_s":
        cfg.nominal_demand(), "datasets": datasets, "local_reader":
        "local: the hub's source folder read directly (the data on this host's disk); "
        "local_http: the hub's HTTP on this host, one ranged GET per sample, no link",
        "skipped": skipped, "failed": failed, "runtime_s": runtime_s, "machine": machine(),
        "missing_peers": {k: why for k, why in skipped.items()
                          if k.rsplit("/", 1)[-1].split("@")[0] in PEERS},
        "warmup_margin_au": metrics.LOCAL_MARGIN,
        "definitions": "docs/benchmark.md",
    }
    doc = {"params": params, "results": results, "goals": goals(results)}
    write_json(cfg.out, doc)
    write_timeline(cfg.out / "timeline.csv", timelines)
    figures = []
    if results and have_matplotlib():
        figures.append(str(plot_timelines(cfg.out / "timeline.png", timelines, results,
                                          _title(cfg))))
        figures.append(str(plot_bars(cfg.out / "summary.png", results)))
    params["figures"] = figures
    write_json(cfg.out, doc)
    print(summary(doc))
    return doc


def _title(cfg: TrainConfig) -> str:
    loop = cfg.loop
    return (f"{cfg.title}: {cfg.samples} x ~{cfg.sample_size / 1e3:g} KB samples "
            f"({'/'.join(cfg.shapes)}), batch {loop.batch_size}, {loop.workers} workers, "
            f"{loop.arch if loop.model else f'{loop.compute_s * 1e3:g} ms'} per batch, "
            f"link {cfg.rtt * 1e3:g} ms")


def write_timeline(path: Path, timelines: dict[str, list[Batch]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "epoch", "batch", "t", "data_wait_s", "compute_s", "samples",
                    "bytes"])
        for name, tl in timelines.items():
            for b in tl:
                w.writerow([name, b.epoch, b.index, f"{b.t:.6f}", f"{b.data_wait_s:.6f}",
                            f"{b.compute_s:.6f}", b.samples, b.bytes])
    return path


def goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures the issue asks about, next to their goals (reported, not tuned for)."""
    out: dict[str, Any] = {}
    shapes = sorted({r["shape"] for r in results.values()})
    for shape in shapes:
        rs = {k: r for k, r in results.items() if r["shape"] == shape}
        by = {(r["scenario"], r["link"]): r for r in rs.values()}
        g: dict[str, Any] = {}
        local, spoke = by.get(("local", None)), by.get(("remote_spoke", "wide"))
        if local and spoke and local["samples_per_s_steady"]:
            ratio = spoke["samples_per_s_steady"] / local["samples_per_s_steady"]
            g["remote_spoke_steady_vs_local"] = {"value": ratio, "goal": GOAL_STEADY_RATIO,
                                                 "met": ratio >= GOAL_STEADY_RATIO}
        if spoke and spoke.get("warmed_up_vs_local") is not None:
            w = spoke["warmup_batches_vs_local"]
            g["remote_spoke_warmup_batches_vs_local"] = {
                "value": w, "warmed_up": spoke["warmed_up_vs_local"],
                "goal": GOAL_WARMUP_BATCHES,
                "met": w is not None and w <= GOAL_WARMUP_BATCHES}
        if spoke:  # the absolute figure (rolling AU >= 0.95): kept, no longer the goal's
            w = spoke["warmup_batches"]
            g["remote_spoke_warmup_batches"] = {
                "value": w, "warmed_up": spoke["warmed_up"], "goal": GOAL_WARMUP_BATCHES,
                "met": spoke["warmed_up"] and w <= GOAL_WARMUP_BATCHES,
                "superseded_by": "remote_spoke_warmup_batches_vs_local"}
        for (name, link), r in by.items():
            if link == "narrow" and r["link_bytes_per_s"]:
                floor = r["dataset_bytes"] / r["link_bytes_per_s"]
                ratio = r["first_epoch_s"] / floor
                g[f"{name}@narrow_first_epoch_vs_floor"] = {
                    "value": ratio, "first_epoch_s": r["first_epoch_s"], "floor_s": floor,
                    "goal": GOAL_NARROW_VS_FLOOR, "met": ratio <= GOAL_NARROW_VS_FLOOR}
        peers = {}
        for (name, link), r in by.items():
            if name in (*PEERS, "remote_spoke", "remote_spoke_hints", "staged") \
                    and link == "wide":
                peers[name] = {"first_epoch_s": r["first_epoch_s"],
                               "au_steady": r["au_steady"], "au": r["au"]}
        if peers:
            g["first_epoch_and_au_steady"] = peers
        out[shape] = g
    return out


COLUMNS = ["scenario", "reader", "first_epoch_s", "au", "au_steady", "warmup", "warmup_au95",
           "sps_steady", "stalls", "wan_MB", "hit_ratio", "wrong_B", "cost_$"]
MISSING = "MISSING"  # a peer's row when it could not run (--allow-missing-peers to go on)


def _warmup_cell(r: dict[str, Any]) -> Any:
    """The warm-up against local: batches, ``never``, or ``-`` (no local run)."""
    if r.get("warmed_up_vs_local") is None:
        return "-"
    return r["warmup_batches_vs_local"] if r["warmed_up_vs_local"] else "never"


def summary(doc: dict[str, Any]) -> str:
    rows = []
    for key, r in doc["results"].items():
        warm = r["warmup_batches"] if r["warmed_up"] else "never"
        hr = "-" if r["hit_ratio"] is None else round(r["hit_ratio"], 3)
        rows.append([key, r["reader"], r["first_epoch_s"],
                     round(r["au"], 3), round(r["au_steady"], 3), _warmup_cell(r), warm,
                     r["samples_per_s_steady"], r["stall_batches"],
                     round(r["wan_bytes"] / 1e6, 1), hr, r["bytes_wrong"],
                     f"{r['cost_usd']:.5f}"])
    p = doc["params"]
    missing = p.get("missing_peers", {})
    rows += [[key, MISSING, *["-"] * (len(COLUMNS) - 2)] for key in missing]
    lines = [table(rows, COLUMNS)] if rows else ["(no scenario ran)"]
    for key, why in p["skipped"].items():
        lines.append(f"{'MISSING peer' if key in missing else 'skipped'} {key}: {why}")
    for key, why in p["failed"].items():
        lines.append(f"FAILED {key}: {why}")
    for key, r in doc["results"].items():
        for note in r.get("notes", []):
            lines.append(f"note {key}: {note}")
    for shape, g in doc["goals"].items():
        for name, v in g.items():
            if isinstance(v, dict) and "goal" in v and "superseded_by" not in v:
                value = ("never" if v["value"] is None else v["value"]
                         if isinstance(v["value"], int) else f"{v['value']:.3f}")
                lines.append(f"[{shape}] {name}: {value} (goal {v['goal']}, "
                             f"{'met' if v['met'] else 'NOT met'})")
    if doc["results"]:
        lines.append(f"warmup: the first batch from which every {metrics.WINDOW}-batch window's "
                     f"AU is within {metrics.LOCAL_MARGIN} of local's in this run; warmup_au95: "
                     f"... has AU >= {metrics.STEADY_AU} (docs/benchmark.md)")
    lines.append(f"cost = wan GB x ${p['price_per_gb']}/GB + idle accelerator h x "
                 f"${p['gpu_hour_price']}/h; runtime {p['runtime_s']:.0f} s")
    for fig in p.get("figures", []):
        lines.append(f"figure: {fig}")
    return "\n".join(lines)


def headlines(doc: dict[str, Any]) -> dict[str, Figure]:
    """The figures ``--repeat`` summarises, and what each is compared with: a scenario's first
    epoch against local's (a peer's against remote_spoke's) and each goal's value against its
    goal. Steady pace and AU are summarised but not compared: a cached path is meant to equal
    local there (a spread over that gap is the expected result; the goal covers the spoke)."""
    out: dict[str, Figure] = {}
    res = doc.get("results", {})
    for key, r in res.items():
        prefix = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
        local = prefix + "local" if key != prefix + "local" and prefix + "local" in res \
            else None
        peer = r["scenario"] in PEERS and prefix + "remote_spoke" in res
        out[f"{key}.warmup_batches_vs_local"] = Figure(
            r.get("warmup_batches_vs_local"),
            GOAL_WARMUP_BATCHES if r["scenario"] == "remote_spoke" else None)
        out[f"{key}.warmup_batches_au95"] = Figure(
            r["warmup_batches"] if r["warmed_up"] else None)
        out[f"{key}.samples_per_s_steady"] = Figure(r["samples_per_s_steady"])
        out[f"{key}.first_epoch_s"] = Figure(
            r["first_epoch_s"], f"{prefix}remote_spoke.first_epoch_s" if peer
            else local and f"{local}.first_epoch_s")
        out[f"{key}.au_steady"] = Figure(r["au_steady"])
    for shape, g in doc.get("goals", {}).items():
        for name, v in g.items():
            if isinstance(v, dict) and "goal" in v and "superseded_by" not in v:
                out[f"goal {shape} {name}"] = Figure(v["value"], v["goal"])
    return out


# -- the reference experiment ----------------------------------------------------------------
SEED_SCENARIOS = (*ALL_SCENARIOS, "remote_spoke@narrow")


def seed_config(out: Path, quick: bool = False, progress: bool = True,
                origin: str = "dir", allow_missing_peers: bool = True) -> TrainConfig:
    """The reference experiment at small scale: ~100 KB files in class folders, a 60 ms
    link, 3 epochs, a loop paced by its emulated accelerator at 16 samples per 100 ms
    (160 samples/s, 16 MB/s; the reference reports 115-117 samples/s). Full: 800 files and
    every scenario (about 4 minutes on 2 cores); ``quick``: 320 files, no local_http (about
    2 minutes)."""
    scenarios = tuple(s for s in SEED_SCENARIOS if not (quick and s == "local_http"))
    return TrainConfig(out=out, shapes=("files",), scenarios=scenarios,
                       samples=320 if quick else 800, sample_size=100_000,
                       loop=LoopConfig(epochs=3, batch_size=16, workers=4, compute_s=0.1),
                       rtt=0.06, bandwidth=400e6, progress=progress, origin=origin,
                       allow_missing_peers=allow_missing_peers,
                       title="spokefs bench seed" + (" (quick)" if quick else "")
                       + (" (origin s3)" if origin == "s3" else ""))


def run_seed(out: Path, quick: bool = True, progress: bool = True,
             origin: str = "dir", allow_missing_peers: bool = True) -> dict[str, Any]:
    """Run the reference experiment (quick: about 2 minutes on 2 cores), print the table
    and the figure paths, and return the results document (``results.json``'s content:
    ``{"params", "results", "goals"}``)."""
    return run_train(seed_config(Path(out), quick, progress, origin, allow_missing_peers))
