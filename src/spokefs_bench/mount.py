"""``spokefs bench mount``: reads through the FUSE mount next to the same reads of the same
bytes from local files ("direct"), in one run.

Hub, spoke and mount run as processes on 127.0.0.1 over one dataset with two folders:
``large/`` (big files) and ``small/`` (many 128 KiB files in 100 folders). After one pass
that fills the spoke's cache through the mount, three patterns run in each state:

- ``seq``: 1 MiB reads through every large file (GB/s, latency p50/p99);
- ``rand``: random 128 KiB reads at 4 KiB-aligned offsets of the large files (p50/p99/max);
- ``small``: reader threads reading every small file whole, once (files/s).

States: ``cold`` (the kernel's page cache dropped: every byte comes from the spoke's files
on disk), ``spoke_hot`` (only the mount's pages dropped: a spoke with RAM to spare),
``warm`` (each pattern again at once after its cold run: the kernel keeps the mount's pages
across opens).
"direct" reads the dataset's own files with the same code, cold and warm. Each mount phase
also records the CPU the mount and the spoke spent (from /proc): per GiB, per file.

``--variants`` runs the mount phases once per way of reading: ``sc`` (the default mount:
the short circuit reads the spoke's cache files) and ``http`` (``--no-short-circuit``: every
byte through the spoke over HTTP), for an A/B in one run.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spokefs.units import parse_size

SEQ_READ = 1 << 20          # sequential phase: 1 MiB reads
RAND_READ = 128 * 1024      # random phase: 128 KiB reads at 4 KiB-aligned offsets
GOALS = {"seq_GBps": 1.0, "rand_128KiB_p99_ms": 3.0}
RATIO_GOALS = {"seq_GBps": 0.9, "small_files_per_s": 0.7}  # mount / direct, every state
STATES = ("cold", "spoke_hot", "warm")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mount", help="FUSE mount vs local files: GB/s, p99, small files/s, CPU",
        description="Start a hub and a spoke on 127.0.0.1, mount the dataset through the "
        "spoke, fill the cache, then measure sequential 1 MiB reads, random 128 KiB reads "
        "and whole small files through the mount and directly on local copies of the same "
        "files, with the page cache dropped (needs root; else evicted per file), the "
        "spoke's files hot, and warm. Writes DIR/results.json.")
    p.add_argument("--out", required=True, type=Path, help="results folder")
    p.add_argument("--work-dir", type=Path,
                   help="where the dataset, cache and mountpoint go (default OUT/work)")
    p.add_argument("--files", type=int, default=4, help="big files in the dataset (default 4)")
    p.add_argument("--file-size", type=parse_size, default=parse_size("256MiB"),
                   help="size of each big file (default 256MiB)")
    p.add_argument("--small-files", type=int, default=20_000,
                   help="small files (default 20000; 0 skips the phase)")
    p.add_argument("--small-size", type=parse_size, default=128 * 1024,
                   help="size of each small file (default 128KiB)")
    p.add_argument("--readers", type=int, default=8,
                   help="threads reading small files (default 8)")
    p.add_argument("--random-reads", type=int, default=2000,
                   help="random 128 KiB reads per phase (default 2000)")
    p.add_argument("--read-ahead-kb", type=int, default=None,
                   help="the mount's readahead (default: the mount's own default)")
    p.add_argument("--variants", default="sc,http",
                   help="ways the mount reads, comma-separated: sc (short circuit, the "
                   "default mount), http (--no-short-circuit); default sc,http")
    p.add_argument("--spoke-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `spokefs spoke serve`, e.g. --spoke-arg=--workers "
                   "--spoke-arg=4 (repeatable)")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=run)
    from spokefs_bench.common import add_repeat

    add_repeat(p, headlines)


def headlines(doc: dict[str, Any]) -> dict[str, Any]:
    """``--repeat``'s figures: per reader and state, seq GB/s and rand p99 (against their goal
    for the mount) and small files/s (the mount's against direct's)."""
    from spokefs_bench.common import Figure

    out = {}
    for name in ("mount", "mount_http", "direct"):
        for state, r in doc.get(name, {}).items():
            k, mine = f"{name}/{state}", name != "direct"
            for f in ("seq_GBps", "rand_128KiB_p99_ms"):
                out[f"{k}.{f}"] = Figure(r[f], GOALS[f] if mine else None)
            out[f"{k}.small_files_per_s"] = Figure(
                r["small_files_per_s"], f"direct/{state}.small_files_per_s" if mine else None)
    return out


@dataclass
class Phase:
    seq_GBps: float
    seq_1MiB_p50_ms: float
    seq_1MiB_p99_ms: float
    rand_GBps: float
    rand_128KiB_p50_ms: float
    rand_128KiB_p99_ms: float
    rand_128KiB_max_ms: float
    small_files_per_s: float | None
    cpu: dict[str, float]  # process -> CPU seconds per pattern, per GiB, per file

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: (round(v, 4) if isinstance(v, float) else v)
                               for k, v in self.__dict__.items() if k != "cpu"}
        out.update({k: round(v, 4) for k, v in self.cpu.items()})
        return out


# -- datasets --------------------------------------------------------------------------------
def _make_large(root: Path, files: int, size: int, seed: int) -> list[Path]:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(files):
        path = root / f"shard-{i:04d}.bin"
        out.append(path)
        if path.exists() and path.stat().st_size == size:
            continue  # reuse a dataset from an earlier run in the same work dir
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, 8 << 20)
                f.write(rng.randbytes(n))
                left -= n
    return out


def _make_small(root: Path, files: int, size: int, seed: int) -> list[Path]:
    from spokefs_bench.dataplane import make_small

    ds = make_small(root, files, size, 100, seed)
    return [root / p for p in ds.paths]


# -- page cache ------------------------------------------------------------------------------
def _drop_page_cache(paths: list[Path]) -> str:
    """Drop the page cache (root), else evict these files; the method used."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        _evict(paths)
        return "fadvise_dontneed (not root: the spoke's files stay in the page cache)"


def _evict(paths: list[Path]) -> str:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


# -- the patterns ----------------------------------------------------------------------------
def _sequential(paths: list[Path]) -> tuple[float, list[float], int]:
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
    return total / (time.perf_counter() - t0) / 1e9, lat, total


def _random(paths: list[Path], n: int, seed: int) -> tuple[float, list[float], int]:
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
    return total / wall / 1e9, lat, total


def _small(paths: list[Path], readers: int) -> tuple[float, int]:
    """Files per second for ``readers`` threads reading every file whole, once."""
    todo: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
    for p in paths:
        todo.put(p)
    for _ in range(readers):
        todo.put(None)
    done = [0]
    lock = threading.Lock()

    def reader() -> None:
        n = 0
        while (p := todo.get()) is not None:
            fd = os.open(p, os.O_RDONLY)
            try:
                while os.read(fd, 1 << 20):
                    pass
            finally:
                os.close(fd)
            n += 1
        with lock:
            done[0] += n

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / (time.perf_counter() - t0), done[0]


class CpuMeter:
    """CPU seconds of some processes (and their children) across a pattern."""

    def __init__(self, pids: dict[str, int]) -> None:
        from spokefs_bench.dataplane import tree_cpu_s

        self.pids = pids
        self.read = tree_cpu_s
        self.start: dict[str, float] = {}

    def __enter__(self) -> CpuMeter:
        self.start = {k: self.read(p) for k, p in self.pids.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        self.used = {k: self.read(p) - self.start[k] for k, p in self.pids.items()}


def _states(large: list[Path], small: list[Path], args: argparse.Namespace,
            pids: dict[str, int], prepare: Any) -> tuple[Phase, Phase]:
    """Each pattern after ``prepare()`` (which empties caches, or not), then at once again
    (warm): (the prepared state, warm)."""
    from spokefs_bench.common import percentile

    runs: dict[str, list[Any]] = {"seq": [], "rand": [], "small": []}
    cpu: list[dict[str, float]] = [{}, {}]
    prepare()
    for k in range(2):
        with CpuMeter(pids) as m:
            runs["seq"].append(_sequential(large))
        nbytes = runs["seq"][-1][2]
        for name, v in m.used.items():
            cpu[k][f"{name}_cpu_s_per_GiB_seq"] = v / (nbytes / 2**30) if nbytes else 0.0
    prepare()
    for _ in range(2):
        runs["rand"].append(_random(large, args.random_reads, args.seed))
    if small:
        prepare()
        for k in range(2):
            with CpuMeter(pids) as m:
                runs["small"].append(_small(small, args.readers))
            n = runs["small"][-1][1]
            for name, v in m.used.items():
                cpu[k][f"{name}_cpu_ms_per_file"] = 1000 * v / n if n else 0.0
                cpu[k][f"{name}_cpu_s_per_GiB_small"] = (
                    v / (n * args.small_size / 2**30) if n else 0.0)
    phases = []
    for k in range(2):
        seq, rnd = runs["seq"][k], runs["rand"][k]
        sms = [x * 1e3 for x in seq[1]]
        rms = [x * 1e3 for x in rnd[1]]
        phases.append(Phase(seq[0], percentile(sms, 50), percentile(sms, 99), rnd[0],
                            percentile(rms, 50), percentile(rms, 99), max(rms),
                            runs["small"][k][0] if small else None, cpu[k]))
    return phases[0], phases[1]


# -- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from spokefs.cache.inspect import blocks_on_disk
    from spokefs.mount.process import MountProcess
    from spokefs.procs import Service, hub_args, spoke_args
    from spokefs_bench.common import machine, table, write_json

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - {"sc", "http"}:
        raise SystemExit(f"--variants takes sc and/or http, not {args.variants!r}")
    out: Path = args.out
    work: Path = args.work_dir or out / "work"
    data, mp, cache = work / "ds", work / "mnt", work / "cache"
    mp.mkdir(parents=True, exist_ok=True)
    big = args.files * args.file_size
    print(f"dataset: {args.files} x {args.file_size >> 20} MiB and {args.small_files} x "
          f"{args.small_size >> 10} KiB in {data}", flush=True)
    local_large = _make_large(data / "large", args.files, args.file_size, args.seed)
    local_small = (_make_small(data / "small", args.small_files, args.small_size, args.seed)
                   if args.small_files else [])
    load_before = os.getloadavg()
    extra = [] if args.read_ahead_kb is None else ["--read-ahead-kb", str(args.read_ahead_kb)]
    cache_size = str(2 * (big + args.small_files * args.small_size) + (256 << 20))
    results: dict[str, dict[str, Phase]] = {}
    method = ""
    read_ahead = ""

    def mounted(paths: list[Path]) -> list[Path]:
        return [mp / p.relative_to(data) for p in paths]

    with Service(hub_args(data, work / "hubstate")) as hub, \
            Service(spoke_args(hub.url, cache, cache_size, 0, *args.spoke_arg)) as spoke:
        assert spoke.proc is not None
        for v in variants:
            flags = [*extra, *(["--no-short-circuit"] if v == "http" else [])]
            with MountProcess(f"{spoke.url}/ds", mp, *flags) as m:
                assert m.proc is not None
                print(m.ready_line, flush=True)
                read_ahead = m.ready_line.rsplit("read_ahead_kb=", 1)[-1].rstrip(")")
                large, small = mounted(local_large), mounted(local_small)
                if v == variants[0]:  # fill the spoke's cache through the mount
                    t0 = time.perf_counter()
                    _sequential(large)
                    if small:
                        _small(small, args.readers)
                    print(f"filled the spoke's cache through the mount in "
                          f"{time.perf_counter() - t0:.1f}s", flush=True)
                segs = sorted({b.path for b in blocks_on_disk(cache)})
                pids = {"mount": m.proc.pid, "spoke": spoke.proc.pid}
                name = "mount" if v == "sc" else "mount_http"
                every = [*large, *small, *segs]
                mine = [*large, *small]
                phases: dict[str, Phase] = {}
                phases["cold"], phases["warm"] = _states(
                    large, small, args, pids, lambda e=every: _drop_page_cache(e))
                method = _drop_page_cache(every)
                phases["spoke_hot"], _ = _states(large, small, args, pids,
                                                 lambda m=mine: _evict(m))
                results[name] = phases
                print(f"  {name}: " + "; ".join(
                    f"{s} {p.seq_GBps:.2f} GB/s, p99 {p.rand_128KiB_p99_ms:.2f} ms, "
                    f"{p.small_files_per_s or 0:.0f} files/s" for s, p in phases.items()),
                    flush=True)
        local = [*local_large, *local_small]
        cold, warm = _states(local_large, local_small, args, {},
                             lambda: _drop_page_cache(local))
        # Local files have no spoke: for spoke_hot, warm local reads are the peer.
        results["direct"] = {"cold": cold, "spoke_hot": warm, "warm": warm}

    doc: dict[str, Any] = {
        "benchmark": "mount", "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "config": {"files": args.files, "file_bytes": args.file_size, "dataset_bytes": big,
                   "small_files": args.small_files, "small_bytes": args.small_size,
                   "readers": args.readers, "seq_read_bytes": SEQ_READ,
                   "rand_read_bytes": RAND_READ, "random_reads": args.random_reads,
                   "read_ahead_kb": read_ahead, "page_cache_drop": method,
                   "variants": variants, "upstream": "spoke process on 127.0.0.1",
                   "spoke_args": args.spoke_arg},
        "goals": {**GOALS, **{f"{k} mount/direct": v for k, v in RATIO_GOALS.items()}},
    }
    for name, phases in results.items():
        doc[name] = {state: p.to_json() for state, p in phases.items()}
    doc["ratio_to_direct"] = {}
    for name in (n for n in results if n != "direct"):
        doc["ratio_to_direct"][name] = {}
        for state in STATES:
            m, d = results[name][state], results["direct"][state]
            doc["ratio_to_direct"][name][state] = {
                "seq_GBps": round(m.seq_GBps / d.seq_GBps, 3),
                "rand_128KiB_p99_ms": round(m.rand_128KiB_p99_ms / d.rand_128KiB_p99_ms, 3),
                "small_files_per_s": round(m.small_files_per_s / d.small_files_per_s, 3)
                if m.small_files_per_s and d.small_files_per_s else None}
    path = write_json(out, doc)

    rows = []
    for name, phases in results.items():
        for state in STATES if name != "direct" else ("cold", "warm"):
            r = phases[state]
            rows.append([f"{name} ({state})", r.seq_GBps, r.seq_1MiB_p99_ms, r.rand_GBps,
                         r.rand_128KiB_p50_ms, r.rand_128KiB_p99_ms,
                         r.small_files_per_s or "-",
                         r.cpu.get("mount_cpu_s_per_GiB_seq", "-"),
                         r.cpu.get("spoke_cpu_s_per_GiB_seq", "-"),
                         r.cpu.get("mount_cpu_ms_per_file", "-"),
                         r.cpu.get("spoke_cpu_ms_per_file", "-")])
    print()
    print(table(rows, ["reader", "seq GB/s", "seq p99 ms", "rand GB/s", "rand p50 ms",
                       "rand p99 ms", "small files/s", "mount CPU-s/GiB", "spoke CPU-s/GiB",
                       "mount CPU-ms/file", "spoke CPU-ms/file"]))
    for name, by_state in doc["ratio_to_direct"].items():
        print(f"\n{name}/direct: " + "; ".join(
            f"{state} seq {r['seq_GBps']}x, rand p99 {r['rand_128KiB_p99_ms']}x, small "
            f"{r['small_files_per_s']}x" for state, r in by_state.items()))
    print(f"page cache emptied with: {method}")
    print(f"results: {path}")
    return 0
