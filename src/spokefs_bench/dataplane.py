"""``spokefs bench dataplane``: what the spoke itself costs to fill and serve, on loopback.

A hub and a spoke run as processes on 127.0.0.1 with no link emulator between them, so the
figures are the spoke's own cost per block and per byte, not the link's. Two datasets are made
once in the work folder and reused: ``small`` (many 128 KiB files in folders) and ``large``
(8 MiB files). For each, with a fresh spoke each time:

- ``demand``: reader threads read every file once through the spoke (cold: every block a
  miss, or a block the spoke's prediction fetched just ahead of the reader);
- ``warm``: ``spokefs warm --wait`` fills the cache with no reader;
- ``hit``: the same reads again, every block resident;
- ``hub``: the same reads straight from the hub: the reference.

Per phase: wall seconds, blocks/s, GB/s, CPU seconds of the spoke (all its processes) and of
the hub from /proc (user + system), and the spoke's event-loop lag while it ran (p50/p99 from
``spokefs_event_loop_lag_seconds``). The demand fill runs once per ``--workers`` count.
"""

from __future__ import annotations

import argparse
import http.client
import os
import queue
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from spokefs.integrity import DEFAULT_BLOCK_SIZE, block_count
from spokefs.procs import Service, hub_args, spoke_args
from spokefs.units import format_size, parse_size
from spokefs_bench.common import Figure, add_repeat, have_matplotlib, machine, table, write_json

GOALS = {  # issue 10's goals on a 2-core machine
    "small fill_blocks_per_s >= 5000": ("small", "fill_blocks_per_s", 5000, ">="),
    "small blocks_per_spoke_cpu_s >= 5000": ("small", "blocks_per_spoke_cpu_s", 5000, ">="),
    "large fill_GBps >= 1.0": ("large", "fill_GBps", 1.0, ">="),
    "large spoke_cpu_s_per_GiB <= 1.0": ("large", "spoke_cpu_s_per_GiB", 1.0, "<="),
    "small loop_lag_p99_ms <= 5": ("small", "loop_lag_p99_ms", 5.0, "<="),
    "large loop_lag_p99_ms <= 5": ("large", "loop_lag_p99_ms", 5.0, "<="),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dataplane", help="the spoke's own cost to fill and serve (loopback, no link)",
        description="Hub and spoke on 127.0.0.1 with no link between them: cold fill by "
        "demand and by warm-up, warm reads, and the same reads from the hub, on a dataset of "
        "small files and one of large files. Writes DIR/results.json, a table and a chart.")
    p.add_argument("--out", required=True, type=Path, help="results folder")
    p.add_argument("--work-dir", type=Path,
                   help="where datasets and caches go (default: a temporary folder; give one "
                   "to reuse the datasets between runs)")
    p.add_argument("--datasets", default="small,large", help="which: small,large")
    p.add_argument("--small-files", type=int, default=20_000, help="default 20000")
    p.add_argument("--small-size", type=parse_size, default=128 * 1024, help="default 128KiB")
    p.add_argument("--small-dirs", type=int, default=100, help="default 100")
    p.add_argument("--large-bytes", type=parse_size, default=2 << 30, help="default 2GiB")
    p.add_argument("--large-file-size", type=parse_size, default=8 << 20, help="default 8MiB")
    p.add_argument("--readers", type=int, default=8, help="reader threads (default 8)")
    p.add_argument("--workers", default="1,2",
                   help="spoke worker counts for the demand fill (default 1,2); the first "
                   "row of results is the spoke's default count")
    p.add_argument("--order", choices=("shuffled", "sorted"), default="shuffled",
                   help="the order readers take files in (default shuffled, like an epoch)")
    p.add_argument("--spoke-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `spokefs spoke serve` (repeatable)")
    p.add_argument("--compare", type=Path, metavar="SRC",
                   help="also run every spoke phase with the spokefs source tree in SRC (a "
                   "checkout of another commit), right after this one: an A/B in one run")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=run)
    add_repeat(p, headlines)


HEADLINES = ("fill_blocks_per_s", "fill_GBps", "spoke_cpu_s_per_GiB", "blocks_per_spoke_cpu_s",
             "loop_lag_p99_ms")


def headlines(doc: dict[str, Any]) -> dict[str, Figure]:
    """The figures ``--repeat`` summarises: each dataset's fill figures (against their goal
    where there is one) and the hit rate."""
    targets = {(ds, key): target for ds, key, target, _ in GOALS.values()}
    out: dict[str, Figure] = {}
    for name, r in doc.get("results", {}).items():
        for key in HEADLINES:
            out[f"{name}.{key}"] = Figure(r.get(key), targets.get((name, key)))
        hit = next((p for p in r.get("phases", []) if p["phase"] == "hit"
                    and p["variant"] == "this"), None)
        if hit:
            out[f"{name}.hit_blocks_per_s"] = Figure(hit["blocks_per_s"])
    return out


# -- datasets --------------------------------------------------------------------------------
@dataclass
class Dataset:
    name: str
    root: Path
    paths: list[str]
    sizes: list[int]

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def blocks(self, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
        return sum(block_count(s, block_size) for s in self.sizes)


def _filler(seed: int) -> Callable[[int, int], bytes]:
    """Bytes for file ``i`` of ``size``: random-looking, every 4 KiB page unique (stamped with
    the file and page), so no two blocks share a digest and the spoke cannot dedupe them."""
    pool = random.Random(seed).randbytes(1 << 20)

    def make(i: int, size: int) -> bytes:
        out = bytearray(size)
        for page in range(0, size, 4096):
            start = (i * 7919 + page * 31) % ((1 << 20) - 4096)
            n = min(4096, size - page)
            out[page:page + n] = pool[start:start + n]
            stamp = f"{i:010d}:{page:012d}".encode()[:n]
            out[page:page + len(stamp)] = stamp
        return bytes(out)

    return make


def make_small(root: Path, files: int, size: int, dirs: int, seed: int) -> Dataset:
    make = _filler(seed)
    paths = [f"d{i % dirs:03d}/f{i:06d}.bin" for i in range(files)]
    for i, p in enumerate(paths):
        path = root / p
        if path.exists() and path.stat().st_size == size:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(make(i, size))
    return Dataset("small", root, sorted(paths), [size] * files)


def make_large(root: Path, total: int, file_size: int, seed: int) -> Dataset:
    make = _filler(seed + 1)
    n = max(1, total // file_size)
    paths = [f"shard-{i:05d}.bin" for i in range(n)]
    for i, p in enumerate(paths):
        path = root / p
        if path.exists() and path.stat().st_size == file_size:
            continue
        root.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for off in range(0, file_size, 1 << 20):
                f.write(make(i * 100_000 + off // (1 << 20), min(1 << 20, file_size - off)))
    return Dataset("large", root, paths, [file_size] * n)


# -- measuring -------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants, from /proc."""
    user, system = tree_cpu(pid)
    return user + system


def tree_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its live descendants, from /proc."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        stats[int(d)] = fields
        children.setdefault(int(fields[1]), []).append(int(d))
    user = system = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        f = stats.get(p)
        if f is not None:
            user += int(f[11]) / _TICK
            system += int(f[12]) / _TICK
        todo.extend(children.get(p, []))
    return user, system


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$')


def scrape(base: str) -> dict[str, float]:
    conn = http.client.HTTPConnection(base.split("://", 1)[1], timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            key = m.group(1) + (m.group(2) or "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def lag_quantile(before: dict[str, float], after: dict[str, float], q: float) -> float | None:
    """The q-quantile (0..1) of loop lag between two scrapes, interpolated in its bucket as
    Prometheus' histogram_quantile does; None when the spoke has no such histogram."""
    name = "spokefs_event_loop_lag_seconds_bucket"
    buckets = []
    for key, v in after.items():
        if key.startswith(name + "{"):
            le = re.search(r'le="([^"]+)"', key)
            if le:
                buckets.append((float(le.group(1)), v - before.get(key, 0.0)))
    if not buckets:
        return None
    buckets.sort()
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-9)
        prev_le, prev_n = le, n
    return prev_le


@dataclass
class ReadResult:
    seconds: float
    files: int
    bytes: int
    errors: list[str] = field(default_factory=list)


class _Getter:
    """A minimal kept-alive HTTP/1.1 GET over a plain socket, the body read into a reused
    buffer. The measuring instrument, so it costs little: http.client spent ~0.2 ms of CPU
    per 128 KiB file here, as much as the spoke it measures."""

    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self.sock: socket.socket | None = None
        self.head = bytearray(64 * 1024)
        self.body = memoryview(bytearray(16 << 20))

    def get(self, path: str) -> tuple[int, int]:
        """(status, body bytes) of GET path."""
        if self.sock is None:
            self.sock = socket.create_connection(self.addr, timeout=120)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s = self.sock
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {self.addr[0]}\r\n\r\n".encode())
        got = 0
        view = memoryview(self.head)
        while (end := self.head.find(b"\r\n\r\n", 0, got)) < 0:
            n = s.recv_into(view[got:])
            if not n:
                raise ConnectionError("server closed the connection")
            got += n
        head = bytes(self.head[:end]).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        m = re.search(r"(?im)^content-length:\s*(\d+)", head)
        if m is None:
            raise ConnectionError(f"no Content-Length in {head[:200]!r}")
        length = int(m.group(1))
        have = got - end - 4
        body = min(have, length)
        while body < length:
            n = s.recv_into(self.body[:min(len(self.body), length - body)])
            if not n:
                raise ConnectionError("body cut short")
            body += n
        return status, body

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def read_files(base: str, dataset: str, paths: list[str], sizes: dict[str, int],
               readers: int) -> ReadResult:
    """``readers`` threads GET every path once (kept-alive connections, bodies read into a
    reused buffer); the wall time and what arrived."""
    todo: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    for p in paths:
        todo.put(p)
    for _ in range(readers):
        todo.put(None)
    host, port = base.split("://", 1)[1].rsplit(":", 1)
    done = [0, 0]
    errors: list[str] = []
    lock = threading.Lock()

    def reader() -> None:
        conn = _Getter(host, int(port))
        files = nbytes = 0
        try:
            while (path := todo.get()) is not None:
                status, got = conn.get(f"/{dataset}/{quote(path)}")
                if status != 200 or got != sizes[path]:
                    with lock:
                        errors.append(f"{path}: HTTP {status}, {got} bytes")
                    conn.close()
                    continue
                files += 1
                nbytes += got
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()
            with lock:
                done[0] += files
                done[1] += nbytes

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ReadResult(time.perf_counter() - t0, done[0], done[1], errors)


# -- phases ----------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    variant: str
    workers: int | None
    seconds: float
    blocks: int
    bytes: int
    spoke_cpu_s: float | None
    spoke_sys_s: float | None   # of which in the kernel (socket and page-cache copies)
    hub_cpu_s: float
    reader_cpu_s: float
    loop_lag_p50_ms: float | None
    loop_lag_p99_ms: float | None
    upstream_bytes: float | None
    errors: list[str]
    upstream: dict[str, float] | None = None  # requests and blocks, demand and prefetch

    def figures(self) -> dict[str, Any]:
        gib = self.bytes / 2**30
        cpu = self.spoke_cpu_s
        return {
            "phase": self.name, "variant": self.variant, "workers": self.workers,
            "seconds": round(self.seconds, 3),
            "blocks": self.blocks, "bytes": self.bytes,
            "blocks_per_s": round(self.blocks / self.seconds, 1),
            "GBps": round(self.bytes / self.seconds / 1e9, 3),
            "spoke_cpu_s": cpu, "spoke_sys_s": self.spoke_sys_s,
            "hub_cpu_s": round(self.hub_cpu_s, 2),
            "reader_cpu_s": round(self.reader_cpu_s, 2),
            "spoke_cpu_s_per_GiB": round(cpu / gib, 3) if cpu is not None and gib else None,
            "blocks_per_spoke_cpu_s": round(self.blocks / cpu, 1) if cpu else None,
            "hub_cpu_ms_per_block": round(1000 * self.hub_cpu_s / self.blocks, 3)
            if self.blocks else None,
            "loop_lag_p50_ms": self.loop_lag_p50_ms, "loop_lag_p99_ms": self.loop_lag_p99_ms,
            "upstream_bytes": self.upstream_bytes, "upstream_requests": self.upstream,
            "errors": self.errors[:5],
            "load_avg": round(os.getloadavg()[0], 2),
        }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 3)


@dataclass(frozen=True)
class Variant:
    """Which spoke runs: this one, or another source tree (``--compare``) for an A/B in
    one run, on the same datasets, hub and machine state."""

    name: str
    source: Path | None = None

    @property
    def env(self) -> dict[str, str] | None:
        return None if self.source is None else {"PYTHONPATH": str(self.source / "src")}

    def supports_workers(self) -> bool:
        out = subprocess.run([sys.executable, "-m", "spokefs.cli", "spoke", "serve", "--help"],
                             capture_output=True, text=True,
                             env={**os.environ, **(self.env or {})}).stdout
        return "--workers" in out


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, hub: Service) -> None:
        self.args = args
        self.work = work
        self.hub = hub
        self.runs = 0
        self._workers: dict[Variant, bool] = {}

    def spoke(self, ds: Dataset, workers: int | None, variant: Variant) -> Service:
        self.runs += 1
        cache = self.work / f"cache-{ds.name}-{self.runs}"
        extra = list(self.args.spoke_arg)
        if variant not in self._workers:
            self._workers[variant] = variant.supports_workers()
        if workers is not None and self._workers[variant]:
            extra += ["--workers", str(workers)]
        size = str(2 * ds.bytes + (256 << 20))
        return Service(spoke_args(self.hub.url, cache, size, 0, *extra), env=variant.env)

    def measure(self, name: str, ds: Dataset, workers: int | None, spoke: Service | None,
                action: Callable[[], ReadResult], variant: str = "this") -> Phase:
        assert self.hub.proc is not None
        spid = spoke.proc.pid if spoke is not None and spoke.proc is not None else None
        before = scrape(spoke.url) if spoke is not None else {}
        s0 = tree_cpu(spid) if spid else None
        h0 = tree_cpu_s(self.hub.proc.pid)
        r0 = time.process_time()
        result = action()
        r1 = time.process_time()
        h1 = tree_cpu_s(self.hub.proc.pid)
        s1 = tree_cpu(spid) if spid else None
        after = scrape(spoke.url) if spoke is not None else {}
        def delta(name: str) -> float:
            return sum(v for k, v in after.items() if k.startswith(name)) - sum(
                v for k, v in before.items() if k.startswith(name))

        up = requests = None
        if spoke is not None:
            up = delta("spokefs_upstream_bytes_total")
            requests = {f"{k}_{kind}": delta(f'spokefs_upstream_{k}_total{{kind="{kind}"}}')
                        for k in ("requests", "blocks") for kind in ("demand", "prefetch")
                        if f'spokefs_upstream_{k}_total{{kind="{kind}"}}' in after}
        spoke_sys = round(s1[1] - s0[1], 2) if s0 is not None and s1 is not None else None
        phase = Phase(name, variant, workers, result.seconds, ds.blocks(), result.bytes,
                      round(sum(s1) - sum(s0), 2) if s0 is not None and s1 is not None else None,
                      spoke_sys, h1 - h0, r1 - r0, _ms(lag_quantile(before, after, 0.5)),
                      _ms(lag_quantile(before, after, 0.99)), up, result.errors, requests)
        f = phase.figures()
        print(f"  {ds.name:5s} {name:7s} {variant:5s} workers={workers or '-'}: "
              f"{f['seconds']:7.2f} s "
              f"{f['blocks_per_s']:9.0f} blocks/s {f['GBps']:6.3f} GB/s  spoke "
              f"{f['spoke_cpu_s']} CPU-s ({f['spoke_sys_s']} sys)  hub {f['hub_cpu_s']} CPU-s"
              f"  lag p99 "
              f"{f['loop_lag_p99_ms']} ms{'  ERRORS' if result.errors else ''}", flush=True)
        return phase

    def reads(self, base: str, ds: Dataset) -> Callable[[], ReadResult]:
        paths = list(ds.paths)
        if self.args.order == "shuffled":
            random.Random(self.args.seed).shuffle(paths)
        sizes = dict(zip(ds.paths, ds.sizes, strict=True))
        return lambda: read_files(base, ds.name, paths, sizes, self.args.readers)

    def run_dataset(self, ds: Dataset, worker_counts: list[int], variants: list[Variant]
                    ) -> dict[str, Any]:
        from spokefs.client.control import SpokeControl

        phases: list[Phase] = []
        for w in worker_counts:
            for v in variants:  # interleaved: what the machine does meanwhile hits both
                with self.spoke(ds, w, v) as s:
                    phases.append(self.measure("demand", ds, w, s, self.reads(s.url, ds),
                                               v.name))
        for v in variants:
            with self.spoke(ds, worker_counts[0], v) as s:

                def warm(url: str = s.url) -> ReadResult:
                    ctl = SpokeControl(f"{url}/{ds.name}", deadline=600)
                    t0 = time.perf_counter()
                    ctl.warm(prefix="", wait=True, progress=False, timeout=3600, poll=0.05)
                    return ReadResult(time.perf_counter() - t0, len(ds.paths), ds.bytes)

                phases.append(self.measure("warm", ds, worker_counts[0], s, warm, v.name))
                phases.append(self.measure("hit", ds, worker_counts[0], s,
                                           self.reads(s.url, ds), v.name))
        phases.append(self.measure("hub", ds, None, None, self.reads(self.hub.url, ds)))
        floor = page_cache_floor(self.work, min(ds.bytes, 1 << 30), ds.sizes[0])
        print(f"  {ds.name:5s} floor: writing the same bytes to a new file costs "
              f"{floor:.2f} CPU-s per GiB here (the kernel's page-cache copy)", flush=True)
        mine = [p for p in phases if p.variant == "this"]
        demand = [p for p in mine if p.name == "demand"]
        head = demand[0].figures()
        out: dict[str, Any] = {
            "files": len(ds.paths), "bytes": ds.bytes, "blocks": ds.blocks(),
            "fill_blocks_per_s": head["blocks_per_s"], "fill_GBps": head["GBps"],
            "spoke_cpu_s_per_GiB": head["spoke_cpu_s_per_GiB"],
            "blocks_per_spoke_cpu_s": head["blocks_per_spoke_cpu_s"],
            "loop_lag_p99_ms": head["loop_lag_p99_ms"],
            "page_cache_write_cpu_s_per_GiB": round(floor, 3),
            "workers": [{k: p.figures()[k] for k in (
                "workers", "blocks_per_s", "GBps", "spoke_cpu_s_per_GiB",
                "blocks_per_spoke_cpu_s", "loop_lag_p99_ms", "seconds", "spoke_cpu_s")}
                for p in demand],
            "phases": [p.figures() for p in phases],
        }
        if len(variants) > 1:
            other = [p for p in phases if p.variant != "this"]
            out["compare"] = {"source": str(variants[1].source),
                              "phases": [p.figures() for p in other]}
        return out


def page_cache_floor(work: Path, nbytes: int, block: int) -> float:
    """CPU seconds per GiB to write ``nbytes`` to a new file in ``block``-sized writes: what
    any cache pays the kernel to keep bytes, whatever its own cost (on a VM whose memory is
    backed lazily it is high: every new page-cache page is a first touch)."""
    path = work / "floor.tmp"
    data = memoryview(random.Random(3).randbytes(min(block, 16 << 20)))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        c0 = time.process_time()
        for off in range(0, nbytes, len(data)):
            os.pwrite(fd, data, off)
        cpu = time.process_time() - c0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return cpu / (nbytes / 2**30)


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    if not names or set(names) - {"small", "large"}:
        raise SystemExit(f"--datasets takes small and/or large, not {args.datasets!r}")
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    if not workers or min(workers) < 1:
        raise SystemExit(f"--workers takes counts >= 1, not {args.workers!r}")
    tmp = None
    if args.work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="spokefs-bench-dataplane-")
        work = Path(tmp.name)
    else:
        work = args.work_dir
        work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, names, workers, work)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args: argparse.Namespace, names: list[str], workers: list[int], work: Path) -> int:
    import shutil

    datasets: dict[str, Dataset] = {}
    t0 = time.perf_counter()
    if "small" in names:
        datasets["small"] = make_small(work / "data" / "small", args.small_files,
                                       args.small_size, args.small_dirs, args.seed)
    if "large" in names:
        datasets["large"] = make_large(work / "data" / "large", args.large_bytes,
                                       args.large_file_size, args.seed)
    print(f"dataplane: datasets ready in {time.perf_counter() - t0:.1f} s: "
          + ", ".join(f"{d.name} {len(d.paths)} files {format_size(d.bytes)}"
                      for d in datasets.values())
          + f"; load avg {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores", flush=True)
    variants = [Variant("this")]
    if args.compare is not None:
        variants.append(Variant("other", args.compare.resolve()))
        print(f"dataplane: each spoke phase runs twice, this spoke then the one in "
              f"{args.compare} (\"other\")", flush=True)
    if not variants[0].supports_workers():
        print("dataplane: this spoke has no --workers; measuring its one process", flush=True)
        workers = workers[:1]
    results: dict[str, Any] = {}
    for ds in datasets.values():
        for old in work.glob(f"cache-{ds.name}-*"):
            shutil.rmtree(old, ignore_errors=True)
        hub = Service(hub_args(ds.root, work / f"hubstate-{ds.name}"))
        with hub:
            bench = Bench(args, work, hub)
            results[ds.name] = bench.run_dataset(ds, workers, variants)
        for old in work.glob(f"cache-{ds.name}-*"):
            shutil.rmtree(old, ignore_errors=True)
    goals = []
    for label, (ds, key, target, op) in GOALS.items():
        value = results.get(ds, {}).get(key)
        if value is None:
            continue
        goals.append({"goal": label, "value": value, "target": target,
                      "met": value >= target if op == ">=" else value <= target})
    doc = {"params": {"datasets": names, "small_files": args.small_files,
                      "small_size": args.small_size, "small_dirs": args.small_dirs,
                      "large_bytes": args.large_bytes, "large_file_size": args.large_file_size,
                      "readers": args.readers, "workers": workers, "order": args.order,
                      "compare": str(args.compare) if args.compare else None,
                      "spoke_args": args.spoke_arg, "machine": machine()},
           "results": results, "goals": goals}
    path = write_json(args.out, doc)
    rows = [[name, p["phase"], p["variant"], p["workers"] or "-", p["seconds"],
             p["blocks_per_s"], p["GBps"], p["spoke_cpu_s"], p["spoke_sys_s"],
             p["spoke_cpu_s_per_GiB"], p["blocks_per_spoke_cpu_s"], p["hub_cpu_s"],
             p["loop_lag_p50_ms"], p["loop_lag_p99_ms"]]
            for name, r in results.items() for p in r["phases"]]
    text = table(rows, ["dataset", "phase", "spoke", "workers", "s", "blocks/s", "GB/s",
                        "spoke CPU-s", "of it sys", "spoke CPU-s/GiB", "blocks/spoke CPU-s",
                        "hub CPU-s", "lag p50 ms", "lag p99 ms"])
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    for g in goals:
        print(f"{'MET ' if g['met'] else 'MISS'} {g['goal']}: {g['value']}")
    _plot(results, args.out / "dataplane.png")
    print(f"wrote {path} and {args.out / 'dataplane.png'}")
    return 0


def _plot(results: dict[str, Any], path: Path) -> None:
    if not have_matplotlib():
        return
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2 * len(results), figsize=(5 * 2 * len(results), 4))
    axes = list(axes) if len(results) * 2 > 1 else [axes]
    for k, (name, r) in enumerate(results.items()):
        labels = [p["phase"] + (f" {p['workers']}w" if p["phase"] == "demand" else "")
                  + ("" if p["variant"] == "this" or p["phase"] == "hub" else "\n(other)")
                  for p in r["phases"]]
        colors = ["#4477aa" if p["variant"] == "this" else "#bbbbbb" for p in r["phases"]]
        ax = axes[2 * k]
        ax.bar(labels, [p["GBps"] for p in r["phases"]], color=colors)
        ax.set_title(f"{name}: GB/s")
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax = axes[2 * k + 1]
        vals = [p["spoke_cpu_s_per_GiB"] or 0 for p in r["phases"]]
        sys_vals = [(p["spoke_sys_s"] or 0) / (p["bytes"] / 2**30) for p in r["phases"]]
        ax.bar(labels, vals, color=["#cc6677" if c == "#4477aa" else "#dddddd" for c in colors])
        ax.bar(labels, sys_vals, color="none", edgecolor="black", hatch="//",
               label="of it in the kernel")
        ax.axhline(r.get("page_cache_write_cpu_s_per_GiB", 0), color="black", linestyle=":",
                   label="page-cache write floor")
        ax.set_title(f"{name}: spoke CPU-s per GiB")
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
