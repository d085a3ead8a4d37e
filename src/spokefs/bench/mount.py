"""``spokefs bench mount``: reads through the FUSE mount next to reading the spoke's own
cache files directly, in the same run, on the same bytes.

Hub and spoke run as processes on 127.0.0.1; the mount reads through the spoke. After one pass
that fills the spoke's cache, each phase runs twice: with the page cache dropped (cold: every
byte comes from the spoke, and the spoke's files from disk), then again at once (warm: the
kernel's page cache, which the mount keeps across opens). "direct" reads the spoke's block
files (CACHE_DIR/blocks/**) with the same read sizes: the ceiling for this machine.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spokefs.units import parse_size

SEQ_READ = 1 << 20          # sequential phase: 1 MiB reads
RAND_READ = 128 * 1024      # random phase: 128 KiB reads at 4 KiB-aligned offsets
GOALS = {"seq_GBps": 1.0, "rand_128KiB_p99_ms": 3.0}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mount", help="FUSE mount vs the spoke's cache files: GB/s, p50, p99",
        description="Start a hub and a spoke on 127.0.0.1, mount the dataset through the "
        "spoke, fill the cache, then measure sequential 1 MiB reads and random 128 KiB reads "
        "through the mount and directly on the spoke's block files, with the page cache "
        "dropped (needs root; else evicted per file) and warm. Writes DIR/results.json.")
    p.add_argument("--out", required=True, type=Path, help="results folder")
    p.add_argument("--work-dir", type=Path,
                   help="where the dataset, cache and mountpoint go (default OUT/work)")
    p.add_argument("--files", type=int, default=4, help="big files in the dataset (default 4)")
    p.add_argument("--file-size", type=parse_size, default=parse_size("256MiB"),
                   help="size of each file (default 256MiB)")
    p.add_argument("--random-reads", type=int, default=2000,
                   help="random 128 KiB reads per phase (default 2000)")
    p.add_argument("--read-ahead-kb", type=int, default=None,
                   help="the mount's readahead (default: the mount's own default)")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=run)


@dataclass
class Phase:
    seq_GBps: float
    seq_1MiB_p50_ms: float
    seq_1MiB_p99_ms: float
    rand_GBps: float
    rand_128KiB_p50_ms: float
    rand_128KiB_p99_ms: float
    rand_128KiB_max_ms: float

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.__dict__.items()}


def _make_dataset(root: Path, files: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        path = root / f"shard-{i:04d}.bin"
        if path.exists() and path.stat().st_size == size:
            continue  # reuse a dataset from an earlier run in the same work dir
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, 8 << 20)
                f.write(rng.randbytes(n))
                left -= n


def _drop_page_cache(paths: list[Path]) -> str:
    """Drop the page cache (root), else evict these files; the method used."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        _evict(paths)
        return "fadvise_dontneed (not root: the spoke's files stay in the page cache)"


def _sequential(paths: list[Path]) -> tuple[float, list[float]]:
    lat: list[float] = []
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                t = time.perf_counter()
                n = len(os.read(fd, SEQ_READ))
                lat.append(time.perf_counter() - t)
                if not n:
                    break
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9, lat


def _random(paths: list[Path], n: int, seed: int) -> tuple[float, list[float]]:
    rng = random.Random(seed)
    fds = [(os.open(p, os.O_RDONLY), p.stat().st_size) for p in paths]
    plan = []
    for _ in range(n):
        fd, size = fds[rng.randrange(len(fds))]
        plan.append((fd, rng.randrange(max(1, (size - RAND_READ) // 4096)) * 4096))
    lat: list[float] = []
    total = 0
    try:
        t0 = time.perf_counter()
        for fd, off in plan:
            t = time.perf_counter()
            total += len(os.pread(fd, RAND_READ, off))
            lat.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
    finally:
        for fd, _ in fds:
            os.close(fd)
    return total / wall / 1e9, lat


def _summary(seq: tuple[float, list[float]], rnd: tuple[float, list[float]]) -> Phase:
    from spokefs.bench.common import percentile

    sms = [x * 1e3 for x in seq[1]]
    rms = [x * 1e3 for x in rnd[1]]
    return Phase(seq[0], percentile(sms, 50), percentile(sms, 99), rnd[0],
                 percentile(rms, 50), percentile(rms, 99), max(rms))


def _measure(paths: list[Path], evict: list[Path], n_random: int, seed: int,
             drop: bool) -> tuple[dict[str, Phase], str]:
    """Each pattern twice: after emptying the page cache (all of it when ``drop``, else only
    ``evict``), then again at once on a warm page cache."""
    runs: dict[str, list[tuple[float, list[float]]]] = {"seq": [], "rand": []}
    method = ""
    for pattern in ("seq", "rand"):
        method = _drop_page_cache(evict) if drop else _evict(evict)
        for _ in range(2):
            runs[pattern].append(_sequential(paths) if pattern == "seq"
                                 else _random(paths, n_random, seed))
    return {"cold": _summary(runs["seq"][0], runs["rand"][0]),
            "warm": _summary(runs["seq"][1], runs["rand"][1])}, method


def _evict(paths: list[Path]) -> str:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def run(args: argparse.Namespace) -> int:
    from spokefs.bench.common import machine, table, write_json
    from spokefs.bench.procs import Service, hub_args, spoke_args
    from spokefs.mount.process import MountProcess

    out: Path = args.out
    work: Path = args.work_dir or out / "work"
    data, mp = work / "ds", work / "mnt"
    cache = work / "cache"
    mp.mkdir(parents=True, exist_ok=True)
    size = args.files * args.file_size
    print(f"dataset: {args.files} x {args.file_size >> 20} MiB in {data}", flush=True)
    _make_dataset(data, args.files, args.file_size, args.seed)
    load_before = os.getloadavg()

    extra = [] if args.read_ahead_kb is None else ["--read-ahead-kb", str(args.read_ahead_kb)]
    cache_size = str(2 * size + (256 << 20))
    with Service(hub_args(data, work / "hubstate")) as hub, \
            Service(spoke_args(hub.url, cache, cache_size)) as spoke, \
            MountProcess(f"{spoke.url}/ds", mp, *extra) as m:
        print(m.ready_line, flush=True)
        mounted = sorted(p for p in mp.iterdir() if p.is_file())
        t0 = time.perf_counter()
        warm_gbps, _ = _sequential(mounted)
        print(f"filled the spoke's cache through the mount: {size / 2**20:.0f} MiB in "
              f"{time.perf_counter() - t0:.1f}s ({warm_gbps:.2f} GB/s, first read)",
              flush=True)
        blocks = sorted(p for p in (cache / "blocks").rglob("*") if p.is_file())
        cached = sum(p.stat().st_size for p in blocks)
        if cached < size:
            print(f"warning: the spoke holds {cached} of {size} bytes", flush=True)
        # cold: nothing in the page cache (the spoke reads its disk); spoke_hot: only the
        # mount's pages evicted, the spoke's files in memory (a spoke with RAM to spare);
        # warm: the same reads again at once (the mount keeps its pages across opens).
        mount, method = _measure(mounted, mounted + blocks, args.random_reads, args.seed,
                                 drop=True)
        hot, _ = _measure(mounted, mounted, args.random_reads, args.seed, drop=False)
        mount["spoke_hot"] = hot["cold"]
        direct, _ = _measure(blocks, mounted + blocks, args.random_reads, args.seed,
                             drop=True)
        results: dict[str, dict[str, Phase]] = {"mount": mount, "direct": direct}
        read_ahead = m.ready_line.rsplit("read_ahead_kb=", 1)[-1].rstrip(")")

    doc: dict[str, Any] = {
        "benchmark": "mount", "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "config": {"files": args.files, "file_bytes": args.file_size, "dataset_bytes": size,
                   "seq_read_bytes": SEQ_READ, "rand_read_bytes": RAND_READ,
                   "random_reads": args.random_reads, "read_ahead_kb": read_ahead,
                   "page_cache_drop": method, "upstream": "spoke process on 127.0.0.1"},
        "goals": GOALS,
    }
    for name, phases in results.items():
        # Headline figures are the cold ones (every byte through the spoke, from its disk).
        doc[name] = {**phases["cold"].to_json(),
                     **{state: p.to_json() for state, p in phases.items() if state != "cold"}}
    states = ("cold", "spoke_hot", "warm")
    doc["ratio_to_direct"] = {}
    for state in states:
        m, d = results["mount"][state], results["direct"]["warm" if state == "spoke_hot"
                                                            else state]
        doc["ratio_to_direct"][state] = {
            "seq_GBps": round(m.seq_GBps / d.seq_GBps, 3),
            "rand_128KiB_p99_ms": round(m.rand_128KiB_p99_ms / d.rand_128KiB_p99_ms, 3)}
    doc["goals_met"] = {
        state: {"seq_GBps": results["mount"][state].seq_GBps >= GOALS["seq_GBps"],
                "rand_128KiB_p99_ms":
                    results["mount"][state].rand_128KiB_p99_ms <= GOALS["rand_128KiB_p99_ms"]}
        for state in states}
    path = write_json(out, doc)

    rows = []
    for name, state in (("mount", "cold"), ("direct", "cold"), ("mount", "spoke_hot"),
                        ("mount", "warm"), ("direct", "warm")):
        r = results[name][state]
        rows.append([f"{name} ({state})", r.seq_GBps, r.seq_1MiB_p99_ms, r.rand_GBps,
                     r.rand_128KiB_p50_ms, r.rand_128KiB_p99_ms])
    print()
    print(table(rows, ["reader", "seq GB/s", "seq p99 ms", "rand GB/s", "rand p50 ms",
                       "rand p99 ms"]))
    print("\nmount/direct: " + "; ".join(
        f"{state} seq {r['seq_GBps']}x, rand p99 {r['rand_128KiB_p99_ms']}x"
        for state, r in doc["ratio_to_direct"].items()) + " (spoke_hot vs direct warm)")
    for state in states:
        g = doc["goals_met"][state]
        print(f"goals, mount {state}: seq >= {GOALS['seq_GBps']} GB/s "
              f"{'met' if g['seq_GBps'] else 'NOT met'}, random 128 KiB p99 <= "
              f"{GOALS['rand_128KiB_p99_ms']} ms "
              f"{'met' if g['rand_128KiB_p99_ms'] else 'NOT met'}")
    print(f"page cache emptied with: {method}")
    print(f"results: {path}")
    return 0
