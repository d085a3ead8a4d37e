"""``spokefs bench race``: spokefs against its peers on their own ground, in one run.

Two datasets (``shards``: a few big files; ``small``: thousands of small files in folders) are
served by a hub behind ``spokefs wan`` (60 ms, 200 MB/s by default). For each dataset and for
1 and 8 reader threads, every tool reads two epochs (cold, then warm): each file once, whole,
in a fresh random order (the same order for every tool). Tools:

- ``local``: the source folder (its pages evicted with fadvise before the cold epoch);
- ``spokefs``: ``spokefs mount`` on a spoke (a fresh cache per case), no hints;
- ``spokefs_hints``: the same, each epoch's order announced first (``SpokeControl.announce``);
- ``rclone``: ``rclone mount :http: --vfs-cache-mode full --read-only`` (fresh cache dir);
- ``fsspec_simplecache``: fsspec's ``simplecache::http://...`` (fresh cache dir);
- ``http_direct``: ranged GETs through the link on kept-alive connections, no cache.

With ``--origin s3`` the datasets are put in a bucket of an S3 server (moto, in a child
process) and served by a hub over that bucket (``spokefs hub serve s3://...``), behind the
same link: every tool reads through the same link as before, the bucket hub making each
block with a conditional ranged GET (docs/s3.md); ``local`` still reads the source folder.

Per tool also: a cold ``os.walk`` + ``stat`` of every file of ``small``. The link's counters
(bytes both ways, new connections) are reset before and read after every epoch; the CPU
seconds of every process involved are read from /proc. The floor of a cold epoch is what
the link allows: dataset bytes / bandwidth + one round trip.

A peer that is not installed (rclone, fsspec) is an error before anything runs, naming what
to install; with ``--allow-missing-peers`` it is skipped with a note and a MISSING row. Every
epoch has a deadline: a tool that
passes it is recorded as timed out (seconds = the deadline, ``files_done``) and its warm epoch
is not run. Nothing here drops the machine's page cache (other work shares the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from spokefs.units import format_size, parse_duration, parse_rate, parse_size
from spokefs_bench.common import (
    BenchTokens,
    Figure,
    add_allow_missing_peers,
    add_repeat,
    missing_peer,
)

TOOLS = ["local", "spokefs", "spokefs_hints", "rclone", "fsspec_simplecache", "http_direct"]
DATASETS = ["shards", "small"]
MOUNT_TOOLS = {"spokefs", "spokefs_hints", "rclone"}
PEERS = {"rclone": "rclone", "fsspec_simplecache": "fsspec"}  # tool -> common.PEER_PACKAGES
# Cases that pay a round trip (or more) per file with one reader: minutes each at full size.
SLOW = {("rclone", "small", 1), ("fsspec_simplecache", "small", 1), ("http_direct", "small", 1)}
SLOW_WALKS = {"fsspec_simplecache", "http_direct"}  # one HEAD per file, one at a time
READ_CHUNK = 1 << 20        # reader threads read 1 MiB at a time
HTTP_CHUNK = 8 << 20        # http_direct: ranged GETs of at most 8 MiB
JOB = "race"
GOALS = {  # (dataset, readers) -> cold epoch seconds / floor at most
    ("small", 1): 1.5, ("small", 8): 1.3, ("shards", 1): 1.1, ("shards", 8): 1.05}
WARM_GOAL = 3.0             # warm epoch through a mount / local warm epoch, at most
BYTES_GOAL = 1.02           # link bytes of a cold epoch / dataset bytes, at most
ORIGINS = ("dir", "s3")
S3_BUCKET = "spokefs-race"  # --origin s3: each dataset under the prefix of its name


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "race", help="spokefs vs rclone, fsspec and plain HTTP over one emulated link",
        description="Build a shards dataset and a small-files dataset, serve them from a hub "
        "behind `spokefs wan`, and read each epoch (cold, warm; 1 and 8 readers) with every "
        "tool: local, spokefs, spokefs_hints, rclone, fsspec_simplecache, http_direct. Also "
        "times a cold walk + stat of the small dataset per tool. Writes DIR/results.json, "
        "DIR/table.md and DIR/race.png.")
    p.add_argument("--out", required=True, type=Path, help="results folder")
    p.add_argument("--work-dir", type=Path,
                   help="datasets, caches and mountpoints (default OUT/work; datasets are "
                   "reused when their parameters match)")
    p.add_argument("--quick", action="store_true",
                   help="small datasets (shards 8 x 4MiB, small 120 x 64KiB in 4 folders) "
                   "and a 60 s epoch deadline: a run of a couple of minutes")
    p.add_argument("--rtt", type=parse_duration, default=0.060, help="link round trip (60ms)")
    p.add_argument("--bandwidth", type=parse_rate, default=200e6,
                   help="link bandwidth per direction (200MB/s)")
    p.add_argument("--shards", type=int, help="files in `shards` (128)")
    p.add_argument("--shard-size", type=parse_size, help="size of each shard (8MiB)")
    p.add_argument("--small-files", type=int, help="files in `small` (4000)")
    p.add_argument("--small-size", type=parse_size, help="size of each small file (128KiB)")
    p.add_argument("--small-dirs", type=int, help="folders `small` spreads over (40)")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma list (shards,small)")
    p.add_argument("--readers", default="1,8", help="reader thread counts, comma list (1,8)")
    p.add_argument("--tools", default=",".join(TOOLS),
                   help=f"comma list of tools (default all: {','.join(TOOLS)})")
    p.add_argument("--skip-slow", action="store_true",
                   help="leave out the cases that pay a round trip per file with one reader "
                   "(rclone, fsspec and http_direct on small with 1 reader; the fsspec and "
                   "http_direct walks): minutes each at full size")
    p.add_argument("--no-walk", action="store_true", help="skip the walk + stat runs")
    p.add_argument("--timeout", type=parse_duration,
                   help="deadline of one epoch or walk (300s; --quick: 60s)")
    p.add_argument("--spoke-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `spokefs spoke serve` (repeatable), e.g. "
                   "--spoke-arg=--max-inflight=128")
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `spokefs mount` (repeatable)")
    p.add_argument("--verify", action="store_true",
                   help="check every file's bytes (sha1) against the source; costs CPU")
    p.add_argument("--seed", type=int, default=1, help="seed of the data and the orders")
    p.add_argument("--origin", choices=ORIGINS, default="dir",
                   help="what the hub serves: dir (the datasets' folders; the default) or s3 "
                   "(the datasets put in a bucket of a local S3 server, moto, and a hub over "
                   "the bucket; the same link in front)")
    p.add_argument("--s3-endpoint", metavar="URL",
                   help="--origin s3 on an S3-compatible store of your own (MinIO, Ceph RGW, "
                   "https://s3.REGION.amazonaws.com) instead of moto: the datasets are put "
                   "there with the credentials AWS tools find (environment, profile, role)")
    p.add_argument("--s3-bucket", default=S3_BUCKET, metavar="NAME",
                   help=f"the bucket --origin s3 uses (default {S3_BUCKET}; made if missing)")
    p.add_argument("--no-tokens", action="store_true",
                   help="hub and spoke without --auth (default: with tokens, as deployed; "
                   "every tool presents one)")
    add_allow_missing_peers(p)
    p.set_defaults(func=run)
    add_repeat(p, headlines)


# -- parameters and datasets ------------------------------------------------------------------

@dataclass
class Params:
    rtt: float
    bandwidth: float
    shards: int
    shard_size: int
    small_files: int
    small_size: int
    small_dirs: int
    datasets: list[str]
    readers: list[int]
    tools: list[str]
    timeout: float
    skip_slow: bool
    walk: bool
    verify: bool
    seed: int
    spoke_args: list[str]
    mount_args: list[str]
    tokens: bool = True
    origin: str = "dir"
    s3_endpoint: str | None = None  # --origin s3: a store of the user's, not moto
    s3_bucket: str = S3_BUCKET

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Params:
        quick = a.quick
        tools = [t for t in a.tools.split(",") if t]
        datasets = [d for d in a.datasets.split(",") if d]
        for t in tools:
            if t not in TOOLS:
                raise SystemExit(f"spokefs bench race: unknown tool {t!r} (known: {TOOLS})")
        for d in datasets:
            if d not in DATASETS:
                raise SystemExit(f"spokefs bench race: unknown dataset {d!r} ({DATASETS})")

        def pick(value: Any, full: Any, small: Any) -> Any:
            return value if value is not None else (small if quick else full)

        if a.s3_endpoint and a.origin != "s3":
            raise SystemExit("spokefs bench race: --s3-endpoint is for --origin s3")
        return cls(rtt=a.rtt, bandwidth=a.bandwidth,
                   shards=pick(a.shards, 128, 8), shard_size=pick(a.shard_size, 8 << 20, 4 << 20),
                   small_files=pick(a.small_files, 4000, 120),
                   small_size=pick(a.small_size, 128 << 10, 64 << 10),
                   small_dirs=pick(a.small_dirs, 40, 4), datasets=datasets,
                   readers=[int(r) for r in a.readers.split(",") if r],
                   tools=tools, timeout=pick(a.timeout, 300.0, 60.0), skip_slow=a.skip_slow,
                   walk=not a.no_walk, verify=a.verify, seed=a.seed,
                   spoke_args=list(a.spoke_arg), mount_args=list(a.mount_arg),
                   tokens=not a.no_tokens, origin=a.origin,
                   s3_endpoint=a.s3_endpoint, s3_bucket=a.s3_bucket)


@dataclass
class Dataset:
    name: str
    root: Path
    paths: list[str]                 # relative, sorted
    sizes: list[int]
    digests: dict[str, str] = field(default_factory=dict)  # with --verify

    @property
    def bytes(self) -> int:
        return sum(self.sizes)


def build_dataset(root: Path, name: str, p: Params) -> Dataset:
    """Write the dataset (unique random bytes per file; equal files would share a version),
    or reuse it when a stamp says it was built with the same parameters."""
    if name == "shards":
        layout = [(f"shard-{i:05d}.tar", p.shard_size) for i in range(p.shards)]
    else:
        layout = [(f"d{i % p.small_dirs:03d}/f{i:06d}.bin", p.small_size)
                  for i in range(p.small_files)]
    d = root / name
    stamp = d.parent / f".{name}.stamp"
    want = json.dumps({"layout": [len(layout), layout[0][1] if layout else 0,
                                  p.small_dirs if name == "small" else 0], "seed": p.seed})
    if not (stamp.exists() and stamp.read_text() == want and d.is_dir()):
        if d.exists():
            shutil.rmtree(d)
        rng = random.Random(f"{p.seed}:{name}")
        for rel, size in layout:
            path = d / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rng.randbytes(size))
        stamp.write_text(want)
    paths = sorted(rel for rel, _ in layout)
    sizes = [(d / rel).stat().st_size for rel in paths]
    ds = Dataset(name, d, paths, sizes)
    if p.verify:
        ds.digests = {rel: hashlib.sha1((d / rel).read_bytes()).hexdigest() for rel in paths}
    return ds


def epoch_order(ds: Dataset, readers: int, epoch: int, seed: int) -> list[int]:
    order = list(range(len(ds.paths)))
    random.Random(f"{seed}:{ds.name}:{readers}:{epoch}").shuffle(order)
    return order


def floor_seconds(ds: Dataset, p: Params) -> float:
    return ds.bytes / p.bandwidth + p.rtt


# -- processes, the link, CPU --------------------------------------------------------------------

def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Link:
    """The wan's control port: counters for bytes and connections."""

    def __init__(self, control: str) -> None:
        self.control = control.rstrip("/")

    def _call(self, method: str, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.control + path, method=method,
                                     data=b"{}" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return dict(json.loads(resp.read()))

    def reset(self) -> dict[str, Any]:
        return self._call("POST", "/reset-counters")

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/status")


@dataclass(frozen=True)
class OwnStore:
    """``--s3-endpoint``: an S3-compatible store the user runs (no process of ours)."""

    url: str
    pid: int | None = None


@dataclass
class Served:
    """One dataset served: hub -> wan."""

    dataset: Dataset
    hub: Any
    wan: Any
    link: Link
    tokens: BenchTokens | None = None  # hub (and spoke) run with --auth
    s3: Any = None  # --origin s3: the S3 server behind the hub

    @property
    def auth(self) -> dict[str, str]:  # what every tool sends: its token
        return self.tokens.headers() if self.tokens else {}

    @property
    def url(self) -> str:           # plain reads by path through the link
        return f"{self.wan.url}/{self.dataset.name}/"


# -- tools -----------------------------------------------------------------------------------

# (file index, buffer, sink) -> bytes read; ``sink``, when given, sees every chunk (--verify)
Sink = Callable[[memoryview], None] | None
ReadOne = Callable[[int, bytearray, Sink], int]


class Tool:
    """One way of reading a served dataset. ``start`` makes it cold; ``reader`` gives each
    reader thread its read function; ``walk`` lists and stats everything."""

    name = ""
    root: Path | None = None

    def __init__(self, served: Served, work: Path, p: Params) -> None:
        self.served = served
        self.ds = served.dataset
        self.work = work
        self.p = p

    @staticmethod
    def missing() -> str | None:
        """Why this tool cannot run here (not installed), or None."""
        return None

    def start(self) -> None: ...

    def before_epoch(self, epoch: int, order: list[int]) -> None: ...

    def pids(self) -> dict[str, int | None]:
        return {}

    def diagnostics(self) -> dict[str, Any]:
        return {}

    def stop(self) -> None: ...

    def reader(self) -> tuple[ReadOne, Callable[[], None]]:
        """A read function for one thread and its cleanup."""
        assert self.root is not None
        root, paths = self.root, self.ds.paths

        def read(i: int, buf: bytearray, sink: Sink) -> int:
            fd = os.open(root / paths[i], os.O_RDONLY)
            try:
                n = 0
                while got := os.readv(fd, [buf]):
                    n += got
                    if sink is not None:
                        sink(memoryview(buf)[:got])
                return n
            finally:
                os.close(fd)

        return read, lambda: None

    def walk(self) -> int:
        assert self.root is not None
        n = 0
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                os.stat(os.path.join(dirpath, f))
                n += 1
        return n


class Local(Tool):
    name = "local"

    def start(self) -> None:
        self.root = self.ds.root
        for rel in self.ds.paths:  # cold: only our files leave the page cache
            fd = os.open(self.ds.root / rel, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class SpokefsMount(Tool):
    name = "spokefs"
    hints = False

    @staticmethod
    def missing() -> str | None:
        from spokefs.mount.process import fuse_unusable

        return fuse_unusable()

    def start(self) -> None:
        from spokefs.mount.process import MountProcess, unmount
        from spokefs.procs import Service, spoke_args

        cache = self.work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        size = f"{2 * self.ds.bytes + (256 << 20)}"
        tokens = self.served.tokens.spoke_args() if self.served.tokens else []
        self.spoke = Service(spoke_args(self.served.wan.url, cache, size, 0, *tokens,
                                        *self.p.spoke_args)).start()
        mp = self.work / "mnt"
        mp.mkdir(parents=True, exist_ok=True)
        unmount(mp)  # left by an earlier run that died
        self.mount = MountProcess(f"{self.spoke.url}/{self.ds.name}", mp,
                                  *self.p.mount_args).start()
        self.root = mp

    def before_epoch(self, epoch: int, order: list[int]) -> None:
        if self.hints:
            from spokefs.client.control import SpokeControl

            ctl = SpokeControl(f"{self.spoke.url}/{self.ds.name}", job=JOB)
            ctl.announce(epoch, paths=[self.ds.paths[i] for i in order])

    def pids(self) -> dict[str, int | None]:
        return {"spoke": self.spoke.proc.pid if self.spoke.proc else None,
                "mount": self.mount.pid}

    def diagnostics(self) -> dict[str, Any]:
        return spoke_diagnostics(self.spoke.url)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.mount.stop()
        with contextlib.suppress(Exception):
            self.spoke.stop()
        shutil.rmtree(self.work / "cache", ignore_errors=True)


class SpokefsHints(SpokefsMount):
    name = "spokefs_hints"
    hints = True


class Rclone(Tool):
    name = "rclone"

    @staticmethod
    def missing() -> str | None:
        from spokefs.mount.process import fuse_unusable

        if shutil.which("rclone") is None:
            return "rclone is not installed"
        return fuse_unusable(need_pyfuse3=False)

    def start(self) -> None:
        from spokefs.mount.process import unmount, wait_mounted

        cache = self.work / "rclone-cache"
        shutil.rmtree(cache, ignore_errors=True)
        mp = self.work / "mnt"
        mp.mkdir(parents=True, exist_ok=True)
        unmount(mp)  # left by an earlier run that died
        self.log = (self.work / "rclone.log").open("wb")
        self.proc = subprocess.Popen(
            ["rclone", "mount", ":http:", str(mp), "--http-url", self.served.url,
             "--vfs-cache-mode", "full", "--read-only", "--cache-dir", str(cache),
             "--config", str(self.work / "rclone.conf"),
             *(f"--http-headers={k},{v}" for k, v in self.served.auth.items())],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_mounted(mp, self.proc, 30.0)
        self.root = mp

    def pids(self) -> dict[str, int | None]:
        return {"rclone": self.proc.pid}

    def stop(self) -> None:
        from spokefs.mount.process import unmount

        assert self.root is not None
        with contextlib.suppress(OSError):  # stop the process whatever the unmount says
            unmount(self.root)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.work / "rclone-cache", ignore_errors=True)


class FsspecSimplecache(Tool):
    name = "fsspec_simplecache"

    @staticmethod
    def missing() -> str | None:
        try:
            import aiohttp  # noqa: F401
            import fsspec  # noqa: F401
        except ImportError as exc:
            return f"fsspec with aiohttp is not importable ({exc})"
        return None

    def start(self) -> None:
        import fsspec

        cache = self.work / "fsspec-cache"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        # skip_instance_cache: a fresh filesystem (and cache) per case, never a reused one
        auth = {"headers": self.served.auth}
        self.fs = fsspec.filesystem("simplecache", target_protocol="http",
                                    target_options=auth, cache_storage=str(cache),
                                    skip_instance_cache=True)
        self.http = fsspec.filesystem("http", skip_instance_cache=True, **auth)

    def reader(self) -> tuple[ReadOne, Callable[[], None]]:
        base, paths = self.served.url, self.ds.paths

        def read(i: int, buf: bytearray, sink: Sink) -> int:
            n = 0
            with self.fs.open(base + quote(paths[i]), "rb") as f:
                while got := f.readinto(buf):
                    n += got
                    if sink is not None:
                        sink(memoryview(buf)[:got])
            return n

        return read, lambda: None

    def walk(self) -> int:
        n = 0
        for dirpath, _, files in self.http.walk(self.served.url, detail=False):
            for f in files:
                self.http.info(urljoin(dirpath.rstrip("/") + "/", f))
                n += 1
        return n

    def stop(self) -> None:
        shutil.rmtree(self.work / "fsspec-cache", ignore_errors=True)


class HttpDirect(Tool):
    name = "http_direct"

    def start(self) -> None:
        u = urlsplit(self.served.wan.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.p.timeout)

    def reader(self) -> tuple[ReadOne, Callable[[], None]]:
        conn = self._conn()
        prefix = f"/{self.ds.name}/"
        paths, sizes, auth = self.ds.paths, self.ds.sizes, self.served.auth
        view = memoryview(bytearray(0))

        def read(i: int, buf: bytearray, sink: Sink) -> int:
            nonlocal view
            size, done = sizes[i], 0
            if len(view) < min(size, HTTP_CHUNK):
                view = memoryview(bytearray(min(size, HTTP_CHUNK)))
            while done < size:
                end = min(size, done + HTTP_CHUNK)
                conn.request("GET", prefix + quote(paths[i]),
                             headers={"Range": f"bytes={done}-{end - 1}", **auth})
                resp = conn.getresponse()
                if resp.status not in (200, 206):
                    raise OSError(f"GET {paths[i]}: HTTP {resp.status}")
                got = 0
                while got < end - done and (k := resp.readinto(view[got:end - done])):
                    got += k
                resp.read()
                if got != end - done:
                    raise OSError(f"GET {paths[i]}: {got} of {end - done} bytes")
                if sink is not None:
                    sink(view[:got])
                done = end
            return done

        return read, conn.close

    def walk(self) -> int:
        conn = self._conn()
        n = 0
        try:
            todo = [f"/{self.ds.name}/"]
            while todo:
                folder = todo.pop()
                conn.request("GET", folder, headers=self.served.auth)
                body = conn.getresponse().read().decode()
                for href in re.findall(r'<a href="([^"]+)"', body):
                    if href.startswith("..") or href.startswith("/"):
                        continue
                    if href.endswith("/"):
                        todo.append(folder + href)
                    else:
                        conn.request("HEAD", folder + href, headers=self.served.auth)
                        resp = conn.getresponse()
                        resp.read()
                        int(resp.headers["Content-Length"])
                        n += 1
        finally:
            conn.close()
        return n


TOOL_CLASSES: dict[str, type[Tool]] = {c.name: c for c in (
    Local, SpokefsMount, SpokefsHints, Rclone, FsspecSimplecache, HttpDirect)}


def spoke_diagnostics(url: str) -> dict[str, Any]:
    """What the spoke saw: fetch latency histogram, bytes by reason, hits, planner stats."""
    from spokefs.wire.auth import bearer, client_token

    out: dict[str, Any] = {}
    auth = bearer(client_token())  # the bench's token, when the spoke runs with --auth

    def get(path: str) -> bytes:
        req = urllib.request.Request(url + path, headers=auth)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return bytes(resp.read())

    try:
        text = get("/metrics").decode()
        status = json.loads(get("/v1/status"))
    except OSError as exc:
        return {"error": str(exc)}
    buckets: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r'(\w+)(?:\{([^}]*)\})? ([0-9.e+-]+|NaN)$', line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "spokefs_fetch_seconds_bucket":
            buckets[labels.split('"')[1]] = value
        elif name in ("spokefs_fetch_seconds_sum", "spokefs_fetch_seconds_count",
                      "spokefs_cache_hits_total", "spokefs_cache_misses_total",
                      "spokefs_passthrough_bytes_total"):
            out[name] = value
        elif name == "spokefs_upstream_bytes_total":
            out[f"upstream_bytes_{labels.split(chr(34))[1]}"] = value
    count = out.get("spokefs_fetch_seconds_count", 0)
    if count:
        out["fetch_mean_s"] = out["spokefs_fetch_seconds_sum"] / count
        for q in (0.5, 0.9, 0.99):
            out[f"fetch_p{int(q * 100)}_le_s"] = next(
                (float(le) for le, c in buckets.items() if le != "+Inf" and c >= q * count),
                float("inf"))
    out["prefetch"] = status.get("prefetch")
    return out


# -- running an epoch --------------------------------------------------------------------------

@dataclass
class EpochResult:
    seconds: float
    files_done: int
    bytes_read: int
    timed_out: bool
    error: str | None = None


def run_epoch(tool: Tool, order: list[int], readers: int, timeout: float) -> EpochResult:
    """Every file in ``order`` read once, whole, by ``readers`` threads taking the next
    file as they finish one; stops taking new files at the deadline."""
    lock = threading.Lock()
    it = iter(order)
    done = [0, 0]  # files, bytes
    errors: list[str] = []
    stop = threading.Event()
    expect = tool.ds.sizes
    digests = tool.ds.digests if tool.p.verify else None

    def work() -> None:
        read, close = tool.reader()
        buf = bytearray(READ_CHUNK)
        try:
            while not stop.is_set():
                with lock:
                    i = next(it, None)
                if i is None:
                    return
                h = hashlib.sha1() if digests is not None else None
                n = read(i, buf, h.update if h is not None else None)
                if n != expect[i]:
                    raise OSError(f"{tool.ds.paths[i]}: read {n} of {expect[i]} bytes")
                if h is not None and digests is not None and (
                        h.hexdigest() != digests[tool.ds.paths[i]]):
                    raise OSError(f"{tool.ds.paths[i]}: bytes differ from the source")
                with lock:
                    done[0] += 1
                    done[1] += n
        except Exception as exc:  # recorded, and the epoch ends
            errors.append(f"{type(exc).__name__}: {exc}")
            stop.set()
        finally:
            close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    end = t0 + timeout
    for t in threads:
        t.join(max(0.0, end - time.perf_counter()))
    seconds = time.perf_counter() - t0
    timed_out = any(t.is_alive() for t in threads)
    stop.set()
    return EpochResult(min(seconds, timeout) if timed_out else seconds, done[0], done[1],
                       timed_out, errors[0] if errors else None)


# -- the race -----------------------------------------------------------------------------------

@dataclass
class Race:
    p: Params
    work: Path
    served: dict[str, Served] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    setups: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # peers that could not run: why

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    @contextlib.contextmanager
    def serve(self, datasets: list[Dataset]) -> Iterator[None]:
        from spokefs.procs import Service, hub_args

        started: list[Any] = []
        tokens = BenchTokens.make(self.work / "auth") if self.p.tokens else None
        s3 = None
        try:
            if self.p.origin == "s3" and self.p.s3_endpoint:
                s3 = OwnStore(self.p.s3_endpoint)  # its CPU is not ours to count
            elif self.p.origin == "s3":
                from spokefs_bench.s3server import S3Server

                # Its request lines go to a file, not to memory: a run makes many.
                s3 = S3Server(log_path=self.work / "s3.log", keep_output=False)
                started.append(s3.start())
            for ds in datasets:
                auth = tokens.hub_args() if tokens else []
                if s3 is not None:
                    hub = self._bucket_hub(s3, ds, auth)
                else:
                    hub = Service(hub_args(ds.root, self.work / f"hubstate-{ds.name}") + auth)
                started.append(hub.start(timeout=600))
                wan = Service(["wan", "--upstream", hub.hostport, "--rtt", f"{self.p.rtt}s",
                               "--bandwidth", f"{self.p.bandwidth}B/s"])
                started.append(wan.start())
                self.served[ds.name] = Served(ds, hub, wan, Link(wan.control), tokens, s3)
            # The mounts and hint clients the tools start present the token (SPOKEFS_TOKEN).
            with tokens.as_client() if tokens else contextlib.nullcontext():
                yield
        finally:
            for s in reversed(started):
                s.stop()

    def _bucket_hub(self, s3: Any, ds: Dataset, auth: list[str]) -> Any:
        """``ds`` put in the bucket under the prefix of its name, and a hub over it (a fresh
        state: block digests are made as the first cold epoch reads the blocks)."""
        from spokefs.procs import Service
        from spokefs_bench.s3server import TEST_ENV, bucket_hub_args, upload_tree

        bucket, own = self.p.s3_bucket, isinstance(s3, OwnStore)
        t0 = time.perf_counter()
        put = upload_tree(s3.url, bucket, ds.root, ds.name, test_keys=not own)
        self.log(f"{ds.name}: {format_size(put)} put in s3://{bucket}/{ds.name}/ in "
                 f"{time.perf_counter() - t0:.1f} s")
        state = self.work / f"hubstate-s3-{ds.name}"
        shutil.rmtree(state, ignore_errors=True)
        return Service(bucket_hub_args(bucket, ds.name, state, s3.url) + auth,
                       env=None if own else TEST_ENV)

    def _procs(self, served: Served, tool: Tool) -> dict[str, int | None]:
        pids: dict[str, int | None] = {
            "hub": served.hub.proc.pid if served.hub.proc else None,
            "wan": served.wan.proc.pid if served.wan.proc else None}
        if served.s3 is not None and served.s3.pid is not None:  # moto: ours to count
            pids["s3"] = served.s3.pid
        pids.update(tool.pids())
        return pids

    def measure(self, served: Served, tool: Tool, fn: Callable[[], EpochResult]
                ) -> dict[str, Any]:
        """Run ``fn`` between link counter reads; CPU seconds of every process; load."""
        pids = self._procs(served, tool)
        served.link.reset()
        cpu0 = {k: _cpu_seconds(v) for k, v in pids.items()}
        self0 = _self_cpu()
        r = fn()
        st = served.link.status()
        cpu = {k: round(_cpu_seconds(v) - cpu0[k], 2) for k, v in pids.items()}
        cpu["bench"] = round(_self_cpu() - self0, 2)
        return {"seconds": round(r.seconds, 6), "link_bytes": st["bytes_up"] + st["bytes_down"],
                "link_bytes_down": st["bytes_down"], "link_connections": st["connections"],
                "timed_out": r.timed_out, "files_done": r.files_done, "bytes_read": r.bytes_read,
                "error": r.error, "cpu_s": cpu, "load_avg": round(os.getloadavg()[0], 2)}

    def case(self, ds: Dataset, readers: int, name: str) -> None:
        served = self.served[ds.name]
        work = self.work / "run" / f"{name}-{ds.name}-{readers}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        tool = TOOL_CLASSES[name](served, work, self.p)
        base = {"tool": name, "dataset": ds.name, "readers": readers}
        t0 = time.perf_counter()
        served.link.reset()
        try:
            tool.start()
            st = served.link.status()
            self.setups.append({**base, "seconds": round(time.perf_counter() - t0, 3),
                                "link_bytes": st["bytes_up"] + st["bytes_down"],
                                "link_connections": st["connections"]})
            cold_ok = True
            for epoch, label in enumerate(("cold", "warm")):
                if not cold_ok:
                    self.notes.append(f"{name} {ds.name} {readers} readers: warm epoch not run "
                                      "(the cold one did not finish)")
                    break
                order = epoch_order(ds, readers, epoch, self.p.seed)

                def fn(epoch: int = epoch, order: list[int] = order) -> EpochResult:
                    # Announcing is part of the epoch (a sampler's first step), and so are
                    # the bytes it sets moving.
                    t = time.perf_counter()
                    tool.before_epoch(epoch, order)
                    announce = time.perf_counter() - t
                    r = run_epoch(tool, order, readers, self.p.timeout)
                    r.seconds += announce
                    return r

                row = {**base, "epoch": label, **self.measure(served, tool, fn)}
                self.results.append(row)
                self.log(_row_line(row, ds, self.p))
                cold_ok = not row["timed_out"] and row["error"] is None
                diag = tool.diagnostics()
                if diag:
                    self.diagnostics.append({**base, "epoch": label, **diag})
        finally:
            tool.stop()
            shutil.rmtree(work, ignore_errors=True)

    def walk(self, ds: Dataset, name: str) -> None:
        served = self.served[ds.name]
        work = self.work / "run" / f"walk-{name}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        tool = TOOL_CLASSES[name](served, work, self.p)
        try:
            served.link.reset()
            t0 = time.perf_counter()
            tool.start()  # a mount's start loads the listing (spokefs: the manifest)
            setup_s = time.perf_counter() - t0
            st = served.link.status()
            setup = {"setup_s": round(setup_s, 3),
                     "setup_link_bytes": st["bytes_up"] + st["bytes_down"],
                     "setup_link_connections": st["connections"]}

            def fn() -> EpochResult:
                box: list[Any] = []

                def go() -> None:
                    try:
                        box.append(tool.walk())
                    except Exception as exc:
                        box.append(exc)

                t = threading.Thread(target=go, daemon=True)
                t0 = time.perf_counter()
                t.start()
                t.join(self.p.timeout)
                secs = time.perf_counter() - t0
                if t.is_alive():
                    return EpochResult(self.p.timeout, 0, 0, True)
                got = box[0]
                if isinstance(got, Exception):
                    return EpochResult(secs, 0, 0, False, f"{type(got).__name__}: {got}")
                err = None if got == len(ds.paths) else f"saw {got} of {len(ds.paths)} files"
                return EpochResult(secs, got, 0, False, err)

            row = {"tool": name, "dataset": ds.name, "readers": 1, "epoch": "walk",
                   **self.measure(served, tool, fn), **setup}
            self.results.append(row)
            self.log(_row_line(row, ds, self.p))
        finally:
            tool.stop()
            shutil.rmtree(work, ignore_errors=True)

    def run_all(self) -> None:
        p = self.p
        datasets = [build_dataset(self.work / "data", n, p) for n in p.datasets]
        tools = []
        for name in p.tools:
            why = TOOL_CLASSES[name].missing()
            if why and name in PEERS:
                why = missing_peer(PEERS[name], why)
                self.missing[name] = why
            if why:
                self.notes.append(f"{name} skipped: {why}")
                self.log(f"skipping {name}: {why}")
            else:
                tools.append(name)
        with self.serve(datasets):
            for ds in datasets:
                for readers in p.readers:
                    for name in tools:
                        if p.skip_slow and (name, ds.name, readers) in SLOW:
                            self.notes.append(f"{name} {ds.name} {readers} reader(s): left out "
                                              "(--skip-slow)")
                            continue
                        self.case(ds, readers, name)
                if ds.name == "small" and p.walk:
                    for name in tools:
                        if name == "spokefs_hints":
                            continue  # the same mount as spokefs: hints do not list files
                        if p.skip_slow and name in SLOW_WALKS:
                            self.notes.append(f"{name} walk: left out (--skip-slow)")
                            continue
                        self.walk(ds, name)
        self.datasets = datasets


def _row_line(row: dict[str, Any], ds: Dataset, p: Params) -> str:
    fl = floor_seconds(ds, p)
    extra = " TIMED OUT" if row["timed_out"] else ""
    if row["error"]:
        extra += f" ERROR {row['error']}"
    return (f"{row['tool']:>18} {row['dataset']:>6} {row['readers']} {row['epoch']:>4}: "
            f"{row['seconds']:8.2f} s  {row['seconds'] / fl:6.2f}x floor  link "
            f"{row['link_bytes'] / ds.bytes:5.3f}x data, {row['link_connections']} conns, "
            f"load {row['load_avg']}{extra}")


# -- report ------------------------------------------------------------------------------------

def summarize(doc: dict[str, Any]) -> tuple[list[list[Any]], list[str], list[dict[str, Any]]]:
    """Table rows (with ratios to the floor and to local) and the goals, met or not."""
    floors = doc["floors"]
    sizes = doc["params"]["dataset_bytes"]
    res = doc["results"]
    local = {(r["dataset"], r["readers"], r["epoch"]): r["seconds"] for r in res
             if r["tool"] == "local" and not r["timed_out"]}
    rows = []
    for r in res:
        fl = floors[r["dataset"]]
        loc = local.get((r["dataset"], r["readers"], r["epoch"]))
        status = "timeout" if r["timed_out"] else ("error" if r["error"] else "")
        rows.append([r["tool"], r["dataset"], r["readers"], r["epoch"], r["seconds"],
                     round(r["seconds"] / fl, 2) if r["epoch"] != "walk" else "",
                     round(r["seconds"] / loc, 2) if loc and r["epoch"] != "walk" else "",
                     round(r["link_bytes"] / sizes[r["dataset"]], 4), r["link_connections"],
                     r["load_avg"], status])
    header = ["tool", "dataset", "readers", "epoch", "seconds", "x floor", "x local",
              "link/data", "conns", "load", "status"]
    goals = []
    for r in res:
        if not r["tool"].startswith("spokefs"):
            continue
        key = (r["dataset"], r["readers"])
        ok = not r["timed_out"] and not r["error"]
        if r["epoch"] == "cold" and key in GOALS:
            ratio = r["seconds"] / floors[r["dataset"]]
            goals.append({"goal": f"{r['tool']} {r['dataset']} {r['readers']}r cold <= "
                          f"{GOALS[key]}x floor", "value": round(ratio, 3),
                          "target": GOALS[key], "met": ok and ratio <= GOALS[key]})
            b = r["link_bytes"] / sizes[r["dataset"]]
            goals.append({"goal": f"{r['tool']} {r['dataset']} {r['readers']}r cold link bytes "
                          f"<= {BYTES_GOAL}x data", "value": round(b, 4),
                          "target": BYTES_GOAL, "met": ok and b <= BYTES_GOAL})
        elif r["epoch"] == "warm":
            loc = local.get((r["dataset"], r["readers"], "warm"))
            if loc:
                ratio = r["seconds"] / loc
                goals.append({"goal": f"{r['tool']} {r['dataset']} {r['readers']}r warm <= "
                              f"{WARM_GOAL}x local", "value": round(ratio, 2),
                              "target": WARM_GOAL, "met": ok and ratio <= WARM_GOAL})
            b = r["link_bytes"] / sizes[r["dataset"]]
            goals.append({"goal": f"{r['tool']} {r['dataset']} {r['readers']}r warm link bytes "
                          "~0 (<= 1%)", "value": round(b, 4), "target": 0.01,
                          "met": ok and b <= 0.01})
        elif r["epoch"] == "walk":
            rts = r["seconds"] / doc["params"]["rtt_s"]
            goals.append({"goal": f"{r['tool']} walk+stat of small: a handful of round trips "
                          "(<= 5)", "value": round(rts, 1), "target": 5,
                          "met": ok and rts <= 5})
    for tool in doc.get("missing_peers", {}):
        rows.append([tool, "MISSING", *[""] * (len(header) - 2)])
    return rows, header, goals


def headlines(doc: dict[str, Any]) -> dict[str, Figure]:
    """The figures ``--repeat`` summarises: each epoch's and walk's seconds (a peer's against
    spokefs's on the same case; None when it timed out or failed), and each goal's value
    against its target."""
    out: dict[str, Figure] = {}
    for r in doc.get("results", []):
        case = f"{r['dataset']}/{r['readers']}r/{r['epoch']}"
        ok = not r["timed_out"] and not r["error"]
        out[f"{r['tool']}/{case}.seconds"] = Figure(
            r["seconds"] if ok else None,
            f"spokefs/{case}.seconds" if r["tool"] in PEERS else None)
    for g in doc.get("goals", []):
        out[f"goal {g['goal']}"] = Figure(g["value"], g.get("target"))
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in doc["results"] if r["epoch"] in ("cold", "warm")]
    tools = [t for t in TOOLS if any(r["tool"] == t for r in res)]
    groups = sorted({(r["dataset"], r["readers"]) for r in res})
    local = {(r["dataset"], r["readers"], r["epoch"]): r["seconds"] for r in res
             if r["tool"] == "local"}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / max(1, len(tools))
    for ax, epoch in zip(axes, ("cold", "warm"), strict=True):
        for k, tool in enumerate(tools):
            xs, ys, hatches = [], [], []
            for g, (ds, readers) in enumerate(groups):
                r = next((r for r in res if (r["tool"], r["dataset"], r["readers"],
                                             r["epoch"]) == (tool, ds, readers, epoch)), None)
                if r is None:
                    continue
                base = (doc["floors"][ds] if epoch == "cold"
                        else local.get((ds, readers, "warm")) or float("nan"))
                xs.append(g + k * width)
                ys.append(r["seconds"] / base)
                hatches.append("//" if r["timed_out"] else "")
            bars = ax.bar(xs, ys, width, label=tool)
            for b, h in zip(bars, hatches, strict=True):
                b.set_hatch(h)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{ds}\n{r} reader{'s' if r > 1 else ''}" for ds, r in groups])
        ax.set_ylabel("seconds / link floor" if epoch == "cold" else "seconds / local warm")
        ax.set_title(f"{epoch} epoch (hatched: timed out, a lower bound)")
    axes[0].legend(fontsize=8)
    p = doc["params"]
    fig.suptitle(f"spokefs bench race: {p['rtt_s'] * 1e3:.0f} ms, "
                 f"{p['bandwidth_Bps'] / 1e6:.0f} MB/s link; load avg {doc['load_avg']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def code_version() -> dict[str, Any]:
    """Which spokefs the services ran (they import the same one as this process)."""
    import spokefs

    where = Path(spokefs.__file__).parent
    out: dict[str, Any] = {"path": str(where)}
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            out["commit"] = head.stdout.strip()
            out["uncommitted"] = [line[3:] for line in dirty.stdout.splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def run(args: argparse.Namespace) -> int:
    from spokefs_bench.common import have_matplotlib, machine, table, write_json

    p = Params.from_args(args)
    out: Path = args.out
    work = (args.work_dir or out / "work").absolute()
    work.mkdir(parents=True, exist_ok=True)
    race = Race(p, work)
    missing = {t: missing_peer(PEERS[t], why) for t in p.tools
               if t in PEERS and (why := TOOL_CLASSES[t].missing())}
    if missing and not args.allow_missing_peers:
        for t, why in missing.items():
            print(f"spokefs bench race: peer {t} cannot run: {why}", file=sys.stderr)
        print("spokefs bench race: not racing without the peers (--allow-missing-peers to "
              "run without them; their rows say MISSING)", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    t0 = time.time()
    race.log(f"race: tools {','.join(p.tools)}; datasets {','.join(p.datasets)}; readers "
             f"{p.readers}; link {p.rtt * 1e3:.0f} ms, {p.bandwidth / 1e6:.0f} MB/s; "
             f"origin {p.origin}; load avg {load0[0]:.2f}")
    try:
        race.run_all()
    except KeyboardInterrupt:
        race.notes.append("interrupted: partial results")
    datasets = getattr(race, "datasets", [])
    doc: dict[str, Any] = {
        "params": {"rtt_s": p.rtt, "bandwidth_Bps": p.bandwidth, "shards": p.shards,
                   "shard_size": p.shard_size, "small_files": p.small_files,
                   "small_size": p.small_size, "small_dirs": p.small_dirs,
                   "readers": p.readers, "tools": p.tools, "timeout_s": p.timeout,
                   "skip_slow": p.skip_slow, "seed": p.seed, "spoke_args": p.spoke_args,
                   "mount_args": p.mount_args, "tokens": p.tokens, "origin": p.origin,
                   "s3_endpoint": p.s3_endpoint,
                   "dataset_bytes": {d.name: d.bytes for d in datasets},
                   "dataset_files": {d.name: len(d.paths) for d in datasets}},
        "results": race.results,
        "floors": {d.name: round(floor_seconds(d, p), 3) for d in datasets},
        "setup": race.setups,
        "diagnostics": race.diagnostics,
        "notes": race.notes,
        "missing_peers": race.missing,
        "machine": machine(),
        "code": code_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "load_avg_start": [round(x, 2) for x in load0],
        "wall_s": round(time.time() - t0, 1),
    }
    if datasets:
        rows, header, goals = summarize(doc)
        doc["goals"] = goals
        text = table(rows, header)
        write_json(out, doc)
        floors = ", ".join(f"{k} {v:.2f} s ({format_size(doc['params']['dataset_bytes'][k])})"
                           for k, v in doc["floors"].items())
        md = [f"origin {p.origin}; link {p.rtt * 1e3:.0f} ms / {p.bandwidth / 1e6:.0f} MB/s; "
              f"floors: {floors}; "
              f"load avg {doc['load_avg_start']} -> {doc['load_avg']}", "", text, ""]
        md += [f"{'MET ' if g['met'] else 'MISS'} {g['goal']}: {g['value']}" for g in goals]
        md += [""] + [f"note: {n}" for n in race.notes]
        (out / "table.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
        try:
            if have_matplotlib():
                plot(doc, out / "race.png")
        except Exception as exc:  # the numbers matter more than the picture
            print(f"no plot: {exc}")
    else:
        write_json(out, doc)
    return 0
