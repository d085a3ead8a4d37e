"""``spokefs bench chaos``: break the link, the processes and the disk under real readers, and
check what the readers see.

Each case starts its own processes in a fresh folder (a hub, the ``spokefs wan`` link
emulator, spokes, a mount), injects one failure while several readers read, and compares
every byte read with the source. A case gives one row: what was injected, the outcome, bytes
verified, bytes wrong (must be 0) and the time to recover: from the end of the fault (link
restored, process restarted, corruption in place) to the first correct read that needed the
healed part.

The same functions are the CI tests (tests/test_chaos.py runs ``Scale.ci()``: seconds each)
and this benchmark (``Scale.bench()``: more data, more readers, background readers as load,
``--repeat`` rounds). docs/reliability.md says, per failure, what a reader sees and which
setting bounds it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
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
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import urllib3

import spokefs
from spokefs.cache.inspect import blocks_on_disk, cached_versions, store_check
from spokefs.manifest import Manifest
from spokefs.procs import Service
from spokefs.wan import WanLinkThread
from spokefs_bench.common import BenchTokens, machine, table, write_json

DATASET = "ds"


# -- scale -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scale:
    """How big each case is: data, readers, deadlines, fault lengths, background load."""

    name: str
    small_files: int          # class folders of small files
    small_size: int           # bytes, about (each file differs)
    shards: tuple[int, ...]   # multi-block files
    block_size: str           # the hub's block size for the dataset
    readers: int              # reader threads per case
    load: int                 # background reader threads during each case (bench)
    rtt: str                  # the emulated link
    bandwidth: str
    deadline: float           # spoke deadline where the fault must stay shorter
    short_deadline: float     # spoke / mount deadline where the fault must outlast it
    cut_s: float              # how long a short cut or an outage lasts
    slack: float              # allowed lateness of a bounded wait (a loaded machine)
    wan_process: bool = True  # the link in its own process (else a thread in this one)

    @classmethod
    def ci(cls) -> Scale:
        return cls("ci", small_files=24, small_size=200_000, shards=(9_000_000, 5_000_000),
                   block_size="1MiB", readers=4, load=0, rtt="20ms", bandwidth="400MB/s",
                   deadline=10.0, short_deadline=2.0, cut_s=2.5, slack=2.0,
                   wan_process=False)

    @classmethod
    def bench(cls) -> Scale:
        return cls("bench", small_files=400, small_size=256_000,
                   shards=(40_000_000, 24_000_000, 24_000_000, 9_000_000), block_size="4MiB",
                   readers=8, load=4, rtt="60ms", bandwidth="200MB/s", deadline=20.0,
                   short_deadline=3.0, cut_s=5.0, slack=3.0)


# -- outcome of a case -----------------------------------------------------------------------
class Skip(Exception):
    """The case cannot run here (no FUSE, not root, ...); the message says why."""


class CaseFailed(Exception):
    """A bounded wait ran out: the system did not do what the case needs within the bound."""


@dataclass
class Result:
    case: str
    injected: str = ""
    outcome: str = "ok"             # "ok", "FAILED", "skipped: why"
    bytes_verified: int = 0
    bytes_wrong: int = 0
    recover_s: float | None = None
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    logs: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok" or self.outcome.startswith("skipped")

    @property
    def skipped(self) -> bool:
        return self.outcome.startswith("skipped")

    def explain(self) -> str:
        lines = [f"{self.case}: {self.outcome} ({self.injected})"]
        lines += [f"  - {f}" for f in self.failures]
        lines.append(f"  details: {json.dumps(self.details, default=str)}")
        if self.logs:
            lines.append(self.logs)
        return "\n".join(lines)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("logs")
        return d


class Tally:
    """Every byte a reader got, compared with the source (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.verified = 0
        self.wrong = 0
        self.reads = 0
        self.wrong_reads: list[str] = []

    def compare(self, what: str, got: bytes, want: bytes) -> bool:
        with self._lock:
            self.reads += 1
            if got == want:
                self.verified += len(got)
                return True
            self.wrong += max(len(got), 1)
            self.wrong_reads.append(f"{what}: {len(got)} bytes, want {len(want)}")
            return False


# -- the dataset and its expected bytes ------------------------------------------------------
class Dataset:
    """A synthetic dataset on disk, and the bytes each snapshot should give."""

    def __init__(self, root: Path, scale: Scale, seed: int = 1) -> None:
        self.root = root
        self.files: dict[str, bytes] = {}
        rng = random.Random(seed)
        for i in range(scale.small_files):
            size = scale.small_size + rng.randrange(-scale.small_size // 4,
                                                    scale.small_size // 4 + 1)
            self.write(f"class{i % 4}/img{i:04d}.jpg", rng.randbytes(size))
        for i, size in enumerate(scale.shards):
            self.write(f"shards/shard-{i:03d}.tar", rng.randbytes(size))
        self.write("empty.txt", b"")
        self.snapshots: dict[str, dict[str, bytes]] = {}

    def write(self, rel: str, data: bytes, in_place: bool = False) -> None:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if in_place and p.exists():
            with open(p, "r+b") as f:  # same inode: only size and mtime tell the change
                f.write(data)
                f.truncate(len(data))
        else:
            tmp = p.with_name(f".{p.name}.tmp")
            tmp.write_bytes(data)
            tmp.replace(p)
        self.files[rel] = data

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink()
        del self.files[rel]

    def pin(self, snap: str) -> dict[str, bytes]:
        """Remember the current content as snapshot ``snap`` (bytes objects are shared)."""
        self.snapshots[snap] = dict(self.files)
        return self.snapshots[snap]

    @property
    def total(self) -> int:
        return sum(len(b) for b in self.files.values())


# -- processes -------------------------------------------------------------------------------
class Wan:
    """The emulated link (docs/wan.md), driven through its control port: a ``spokefs wan``
    process, or (CI, to save a process start) a ``WanLinkThread`` in this process."""

    def __init__(self, url: str, control: str, http: urllib3.PoolManager) -> None:
        self.url = url
        self.control = control
        self.http = http

    def _post(self, what: str, doc: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.http.request("POST", f"{self.control}/{what}",
                              body=json.dumps(doc or {}).encode(), timeout=10)
        if r.status != 200:
            raise CaseFailed(f"wan /{what} answered {r.status}: {r.data[:200]!r}")
        return dict(json.loads(r.data))

    def cut(self, reset_after: float) -> dict[str, Any]:
        return self._post("cut", {"reset_after": reset_after})

    def restore(self) -> dict[str, Any]:
        return self._post("restore")

    def set(self, **changes: Any) -> dict[str, Any]:
        return self._post("set", changes)

    def status(self) -> dict[str, Any]:
        r = self.http.request("GET", f"{self.control}/status", timeout=10)
        return dict(json.loads(r.data))


class Proc(Service):
    """A service with a name for its log file and for failure reports."""

    def __init__(self, name: str, args: list[str], log_path: Path | None) -> None:
        super().__init__(args, log_path=log_path)
        self.name = name


class Lab:
    """The processes of one case; everything started here is stopped by ``close``."""

    def __init__(self, root: Path, logs: Path | None = None, tokens: bool = True) -> None:
        self.root = root
        self.logs = logs
        self.services: list[Proc] = []
        self.cleanups: list[Callable[[], None]] = []
        # With tokens (the default), hub and spoke run with --auth, as deployed: every
        # request here, and every client and mount a case starts, presents a token.
        self.tokens = BenchTokens.make(root / "auth") if tokens else None
        self.auth = self.tokens.headers() if self.tokens else {}
        self.http = urllib3.PoolManager(maxsize=64, retries=False, headers=self.auth,
                                        timeout=urllib3.Timeout(connect=5, read=120))

    def start(self, name: str, args: list[str]) -> Proc:
        log_path = None
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            log_path = self.logs / f"{name}.log"
        s = Proc(name, args, log_path)
        self.services.append(s)
        s.start()
        return s

    def hub(self, ds: Dataset, scale: Scale, port: int = 0, name: str = "hub") -> Proc:
        return self.start(name, ["hub", "serve", str(ds.root), "--name", DATASET, "--port",
                                 str(port), "--state-dir", str(self.root / "hubstate"),
                                 "--block-size", scale.block_size,
                                 *(self.tokens.hub_args() if self.tokens else [])])

    def spoke(self, upstream: str, cache: str, *extra: str, port: int = 0,
              size: str = "1GiB", name: str = "spoke") -> Proc:
        return self.start(name, ["spoke", "serve", "--upstream", upstream, "--cache-dir",
                                 str(self.root / cache), "--cache-size", size, "--port",
                                 str(port), "--no-fsync",
                                 *(self.tokens.spoke_args() if self.tokens else []), *extra])

    def restart(self, s: Proc) -> Proc:
        """Start ``s``'s command again on the port it had (after a kill)."""
        args = list(s.args[3:])
        args[args.index("--port") + 1] = str(s.port)
        return self.start(s.name, args)

    def wan(self, target: Proc, scale: Scale) -> Wan:
        if scale.wan_process:
            s = self.start("wan", ["wan", "--listen", "127.0.0.1:0", "--upstream",
                                   target.hostport, "--rtt", scale.rtt, "--bandwidth",
                                   scale.bandwidth])
            return Wan(s.url, s.control, self.http)
        link = WanLinkThread(target.hostport, rtt=scale.rtt, bandwidth=scale.bandwidth,
                             control="127.0.0.1:0").start()
        self.cleanups.append(link.stop)
        return Wan(f"http://127.0.0.1:{link.port}", f"http://127.0.0.1:{link.control_port}",
                   self.http)

    def close(self) -> None:
        for fn in reversed(self.cleanups):
            with contextlib.suppress(Exception):
                fn()
        live = [s for s in self.services if s.proc is not None and s.proc.poll() is None]
        for s in live:  # all at once: each takes a moment to shut down
            with contextlib.suppress(OSError):
                s.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        for s in live:
            s.stop()  # waits for the exit, kills what does not stop

    def output(self, lines: int = 15) -> str:
        out = []
        for s in self.services:
            tail = "".join(s.output[-lines:]).rstrip()
            if tail:
                out.append(f"--- {s.name} ({' '.join(s.args[3:6])}):\n{tail}")
        return "\n".join(out)

    # -- reading ---------------------------------------------------------------------------
    def get(self, url: str, timeout: float = 120.0, **headers: str
            ) -> urllib3.BaseHTTPResponse:
        return self.http.request("GET", url, headers={**self.auth, **headers}, redirect=False,
                                 timeout=urllib3.Timeout(connect=5, read=timeout))

    def post(self, url: str, doc: dict[str, Any]) -> dict[str, Any]:
        r = self.http.request("POST", url, body=json.dumps(doc).encode(),
                              headers={**self.auth, "Content-Type": "application/json"},
                              timeout=60)
        if r.status >= 300:
            raise CaseFailed(f"POST {url} answered {r.status}: {r.data[:300]!r}")
        return dict(json.loads(r.data))

    def json(self, url: str) -> dict[str, Any]:
        r = self.get(url, timeout=30)
        if r.status != 200:
            raise CaseFailed(f"GET {url} answered {r.status}: {r.data[:300]!r}")
        return dict(json.loads(r.data))

    def metric(self, base: str, name: str, labels: str = "") -> float:
        text = self.get(f"{base}/metrics", timeout=30).data.decode()
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", line)
            if m and labels in (m.group(1) or ""):
                total += float(m.group(2))
        return total

    def latest(self, base: str) -> str:
        return str(self.json(f"{base}/v1/datasets/{DATASET}")["latest"])


# -- helpers ---------------------------------------------------------------------------------
def wait_until(cond: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.05) -> float:
    """Poll ``cond`` until it is true; seconds taken, or CaseFailed naming ``what``."""
    t0 = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - t0
        except (urllib3.exceptions.HTTPError, OSError, ValueError):
            pass  # a service on its way up
        if time.monotonic() - t0 > timeout:
            raise CaseFailed(f"{what}: not within {timeout:g}s")
        time.sleep(interval)


@dataclass
class Read:
    path: str
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""
    status: int = 0


class HttpError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


class Epoch:
    """Readers going through ``paths`` in a random order, each file read whole and compared.

    ``read(path) -> bytes`` does one read; ``on_error(path, exc)`` decides whether an error is
    allowed (return True) or a failure. Runs in the background; ``join`` waits for the end.
    """

    def __init__(self, read: Callable[[str], bytes], paths: list[str], expected: dict[str, bytes],
                 tally: Tally, workers: int, seed: int = 0,
                 on_error: Callable[[str, BaseException], bool] | None = None) -> None:
        self.read_fn = read
        self.paths = list(paths)
        random.Random(seed).shuffle(self.paths)
        self.expected = expected
        self.tally = tally
        self.on_error = on_error or (lambda p, e: False)
        self.records: list[Read] = []
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reader")
        self._futures = [self._pool.submit(self._one, p) for p in self.paths]

    def _one(self, path: str) -> None:
        rec = Read(path, time.monotonic())
        try:
            data = self.read_fn(path)
            rec.ok = self.tally.compare(path, data, self.expected[path])
            if not rec.ok:
                rec.error = "wrong bytes"
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            rec.status = getattr(exc, "status", 0)
            if not self.on_error(path, exc):
                with self._lock:
                    self.failures.append(f"read of {path} failed: {rec.error[:300]}")
        rec.end = time.monotonic()
        with self._lock:
            self.records.append(rec)

    @property
    def done_count(self) -> int:
        return len(self.records)

    def join(self, timeout: float) -> bool:
        _, pending = wait_futures(self._futures, timeout=timeout)
        self._pool.shutdown(wait=not pending, cancel_futures=True)
        if pending:
            self.failures.append(f"{len(pending)} of {len(self.paths)} reads not done after "
                                 f"{timeout:g}s (a hang)")
        return not pending


class Load:
    """Background readers (the bench's load): random ranges of a pinned snapshot, every byte
    compared; errors are counted, not judged (the case judges what its readers see)."""

    def __init__(self, lab: Lab, base: str, snap: str, expected: dict[str, bytes],
                 tally: Tally, threads: int) -> None:
        self.lab, self.base, self.snap, self.expected = lab, base, snap, expected
        self.tally = tally
        self.errors = 0
        self.reads = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        paths = [p for p, b in self.expected.items() if b]
        while not self._stop.is_set():
            path = rng.choice(paths)
            want = self.expected[path]
            a = rng.randrange(len(want))
            b = min(len(want), a + rng.randrange(1, 1 << 20))
            ok = False
            try:
                r = self.lab.get(f"{self.base}/{DATASET}@{self.snap}/{path}", timeout=120,
                                 Range=f"bytes={a}-{b - 1}")
                if r.status == 206:
                    self.tally.compare(f"load {path}", r.data, want[a:b])
                    ok = True
            except (urllib3.exceptions.HTTPError, OSError):
                pass
            with self._lock:
                self.reads += 1
                self.errors += not ok
            if not ok:
                self._stop.wait(0.2)  # an outage: do not spin


class Case:
    """What a case function gets: its lab, scale, tally and a place to record checks."""

    def __init__(self, name: str, lab: Lab, scale: Scale) -> None:
        self.name = name
        self.lab = lab
        self.scale = scale
        self.tally = Tally()
        self.result = Result(name)
        self.loads: list[Load] = []

    def check(self, cond: object, message: str) -> bool:
        if not cond:
            self.result.failures.append(message)
        return bool(cond)

    def detail(self, **kv: Any) -> None:
        self.result.details.update(kv)

    def load(self, base: str, snap: str, expected: dict[str, bytes]
             ) -> contextlib.AbstractContextManager[Any]:
        """Background readers while the fault is injected (bench only)."""
        if self.scale.load <= 0:
            return contextlib.nullcontext()
        ld = Load(self.lab, base, snap, expected, self.tally, self.scale.load)
        self.loads.append(ld)
        return ld

    def http_reader(self, base: str, snap: str) -> Callable[[str], bytes]:
        def read(path: str) -> bytes:
            r = self.lab.get(f"{base}/{DATASET}@{snap}/{path}")
            if r.status != 200:
                raise HttpError(r.status, r.data)
            return bytes(r.data)
        return read

    def client_reader(self, base: str, snap: str, deadline: float) -> Callable[[str], bytes]:
        """Reads with ``spokefs.open``: the client library retries until its deadline."""
        def read(path: str) -> bytes:
            with spokefs.open(f"{base}/{DATASET}@{snap}/{path}", deadline=deadline) as f:
                return f.read()
        return read

    def epoch_failures(self, ep: Epoch) -> None:
        for f in ep.failures[:10]:
            self.check(False, f)
        if len(ep.failures) > 10:
            self.check(False, f"... and {len(ep.failures) - 10} more failed reads")


def read_all(c: Case, base: str, snap: str, expected: dict[str, bytes],
             paths: list[str] | None = None, workers: int | None = None,
             timeout: float = 120.0) -> Epoch:
    ep = Epoch(c.http_reader(base, snap), paths if paths is not None else list(expected),
               expected, c.tally, workers or c.scale.readers)
    ep.join(timeout)
    c.epoch_failures(ep)
    return ep


def settle_index(lab: Lab, url: str, cache_dir: Path) -> None:
    """Wait until the spoke's committed index lists every block it holds (it commits in
    batches, every 50 ms)."""
    wait_until(lambda: len(blocks_on_disk(cache_dir)) == lab.json(
        f"{url}/v1/status")["cache"]["blocks"], 10, "the spoke's index to be committed")


def _split(paths: list[str], seed: int = 7) -> tuple[list[str], list[str]]:
    """(to cache first, to leave uncached): every other file of a shuffled list."""
    ps = [p for p in sorted(paths)]
    random.Random(seed).shuffle(ps)
    return sorted(ps[::2]), sorted(ps[1::2])


def _timed_read(c: Case, base: str, snap: str, path: str, want: bytes, timeout: float = 120
                ) -> tuple[float, int, bytes]:
    t0 = time.monotonic()
    r = c.lab.get(f"{base}/{DATASET}@{snap}/{path}", timeout=timeout)
    elapsed = time.monotonic() - t0
    if r.status == 200:
        c.tally.compare(path, r.data, want)
    return elapsed, r.status, r.data


def _read_stream(lab: Lab, url: str, timeout: float) -> tuple[bytes, str]:
    """Read a body as it comes: (bytes received, "complete" | "cut" | "hung" | "HTTP n")."""
    r = lab.http.request("GET", url, preload_content=False,
                         timeout=urllib3.Timeout(connect=5, read=timeout))
    if r.status >= 300:
        r.read()
        r.release_conn()
        return b"", f"HTTP {r.status}"
    got = bytearray()
    try:
        for chunk in r.stream(1 << 20):
            got += chunk
        return bytes(got), "complete"
    except urllib3.exceptions.ReadTimeoutError:
        return bytes(got), "hung"
    except urllib3.exceptions.HTTPError:
        return bytes(got), "cut"
    finally:
        r.release_conn()


# == the cases ===============================================================================
def case_link_cut(c: Case) -> None:
    """The link is cut mid-epoch for less than the deadline, then restored."""
    s, lab = c.scale, c.lab
    c.result.injected = f"link cut {s.cut_s:g}s mid-epoch (< spoke deadline {s.deadline:g}s)"
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    wan = lab.wan(hub, s)
    sp = lab.spoke(wan.url, "cache", "--deadline", f"{s.deadline}s", "--no-prefetch")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    cached, uncached = _split(list(exp))
    read_all(c, sp.url, snap, exp, cached)
    with c.load(sp.url, snap, exp):
        errors0 = lab.metric(sp.url, "spokefs_upstream_errors_total")
        wan.cut(reset_after=s.cut_s / 2)
        t_cut = time.monotonic()
        # Cached reads go on at local speed while the link is down.
        slowest = 0.0
        nbytes = 0
        t0 = time.monotonic()
        for p in cached:
            elapsed, status, data = _timed_read(c, sp.url, snap, p, exp[p], timeout=30)
            c.check(status == 200, f"cached {p} during the cut: HTTP {status}")
            slowest = max(slowest, elapsed)
            nbytes += len(data)
        cached_s = time.monotonic() - t0
        c.check(slowest < 1.0, f"a cached read took {slowest:.2f}s during the cut")
        # The epoch: every file, several readers; uncached reads wait for the link.
        ep = Epoch(c.http_reader(sp.url, snap), list(exp), exp, c.tally, s.readers, seed=3)
        inflight = 0.0
        while time.monotonic() < t_cut + s.cut_s:
            inflight = max(inflight, lab.metric(sp.url, "spokefs_upstream_inflight"))
            time.sleep(0.1)
        mid = wan.status()
        errors = lab.metric(sp.url, "spokefs_upstream_errors_total") - errors0
        wan.restore()
        t_restore = time.monotonic()
        ep.join(60 + s.deadline)
    c.epoch_failures(ep)
    waited = [r for r in ep.records if r.path in uncached and r.start < t_restore and r.ok]
    c.check(waited, "no uncached read was waiting when the link came back")
    after = [r.end - t_restore for r in waited]
    if after:
        c.result.recover_s = round(min(after), 3)
        c.check(min(after) >= 0, "an uncached read finished while the link was cut")
        # Backoff is capped at 2 s: a waiting read retries within that of the restore.
        c.check(min(after) < 2.5 + s.slack, f"first read after the restore took {min(after):.2f}s")
    # No retry loop without backoff: attempts per waiting fetch per second of cut, bounded.
    fetches = max(inflight, 1.0)
    rate = errors / fetches / s.cut_s
    c.check(rate < 6, f"{errors:g} failed upstream attempts for {fetches:g} waiting fetches in "
            f"{s.cut_s:g}s: {rate:.1f}/s each (backoff missing?)")
    c.detail(cached_read_mb_s=round(nbytes / cached_s / 1e6, 1), slowest_cached_read_s=round(
        slowest, 3), waiting_fetches=fetches, failed_attempts_during_cut=errors,
        refused_connections=mid["refused"], reset_connections=mid["resets"],
        epoch_s=round(max(r.end for r in ep.records) - min(r.start for r in ep.records), 2))


def case_long_cut(c: Case) -> None:
    """The link is cut (connections stall, as in a silent partition) for longer than the
    deadline while prefetches hold every upstream slot; a reader of an uncached file must get
    a clear 503 at the deadline, and reads work again when the link returns."""
    s, lab = c.scale, c.lab
    dl = s.short_deadline
    c.result.injected = f"link cut > spoke deadline {dl:g}s, stalled, slots all busy"
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    wan = lab.wan(hub, s)
    sp = lab.spoke(wan.url, "cache", "--deadline", f"{dl}s", "--max-inflight", "1")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    small = sorted(p for p in exp if p.startswith("class"))
    first, victim = small[0], small[-1]
    _timed_read(c, sp.url, snap, first, exp[first])
    full = wan.status()["bandwidth"]
    with c.load(sp.url, snap, exp):
        # A background fill on a slow link holds every upstream slot when the link is cut;
        # its connections stall, nothing fails (no reset), nothing moves.
        wan.set(bandwidth=1_000_000)
        lab.post(f"{sp.url}/v1/datasets/{DATASET}/warm", {"snapshot": snap, "prefix": "shards"})
        wait_until(lambda: lab.metric(sp.url, "spokefs_upstream_inflight") >= 1, 10,
                   "the warm-up's fetches to take every upstream slot")
        wan.cut(reset_after=3600)
        t0 = time.monotonic()
        r = lab.get(f"{sp.url}/{DATASET}@{snap}/{victim}", timeout=dl * 4 + 60)
        elapsed = time.monotonic() - t0
        c.check(r.status == 503, f"uncached read during a long cut: HTTP {r.status}, want 503")
        err: dict[str, Any] = {}
        with contextlib.suppress(ValueError, KeyError):
            err = json.loads(r.data)["error"]
        c.check(err.get("code") == "upstream_unavailable" and err.get("cause")
                and wan.url.split("//", 1)[1] not in r.data.decode(errors="replace"),
                f"503 body lacks code/cause or names the upstream: {r.data[:300]!r}")
        c.check(elapsed <= dl + s.slack, f"503 after {elapsed:.2f}s, deadline {dl:g}s")
        # The client library says the same, as an exception.
        t1 = time.monotonic()
        try:
            c.client_reader(sp.url, snap, 30)(victim)
            c.check(False, "spokefs.open read an uncached file during the cut")
        except spokefs.UpstreamUnavailable as exc:
            # It says what was unavailable; the spoke's upstream address stays in its log.
            c.check("unavailable" in str(exc) or "upstream" in str(exc),
                    f"UpstreamUnavailable does not say what failed: {exc}")
        client_s = time.monotonic() - t1
        c.check(client_s <= dl + s.slack, f"spokefs.open failed after {client_s:.2f}s")
        # The spoke itself is healthy: status, cached data.
        c.check(lab.get(f"{sp.url}/v1/status").status == 200, "spoke status failed")
        cached_s, status, _ = _timed_read(c, sp.url, snap, first, exp[first], timeout=30)
        c.check(status == 200 and cached_s < 1.0,
                f"cached read during the cut: HTTP {status} in {cached_s:.2f}s")
        wan.restore()
        wan.set(bandwidth=full)
        t_restore = time.monotonic()

        def served() -> bool:
            r = lab.get(f"{sp.url}/{DATASET}@{snap}/{victim}", timeout=60)
            return r.status == 200 and c.tally.compare(victim, r.data, exp[victim])

        wait_until(served, 30, "the uncached file after the link came back", interval=0.1)
        c.result.recover_s = round(time.monotonic() - t_restore, 3)
        # A sample: one upstream slot (--max-inflight 1) makes a full pass slow.
        read_all(c, sp.url, snap, exp, random.Random(2).sample(small, min(len(small), 20)))
    c.detail(error_after_s=round(elapsed, 2), client_error_after_s=round(client_s, 2),
             cause=str(err.get("cause", ""))[:120])


def case_degraded(c: Case) -> None:
    """Bandwidth down to 1% with jitter: slower, but no errors and no retry storm."""
    s, lab = c.scale, c.lab
    c.result.injected = f"bandwidth {s.bandwidth} -> 1%, jitter 20ms"
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    wan = lab.wan(hub, s)
    sp = lab.spoke(wan.url, "cache", "--deadline", f"{max(s.deadline, 30)}s")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    full = wan.status()["bandwidth"]
    bs = int(lab.json(f"{sp.url}/v1/datasets/{DATASET}")["block_size"])
    blocks = sum(-(-len(b) // bs) for b in exp.values())
    with c.load(sp.url, snap, exp):
        wan.set(bandwidth=full / 100, jitter="20ms")
        st0 = wan.status()
        hub_req0 = lab.metric(hub.url, "spokefs_requests_total", 'route="object"')
        errors0 = lab.metric(sp.url, "spokefs_upstream_errors_total")
        # About 8 s of reading at the degraded rate (all small files at CI scale).
        small, budget = [], full / 100 * 8
        for p in sorted(p for p in exp if p.startswith("class")):
            if budget < len(exp[p]):
                break
            small.append(p)
            budget -= len(exp[p])
        t0 = time.monotonic()
        ep = Epoch(c.http_reader(sp.url, snap), small, exp, c.tally, s.readers)
        ep.join(120 + ds.total / (full / 100))
        slow_s = time.monotonic() - t0
        st1 = wan.status()
        wan.set(bandwidth=full, jitter=0)
        t_restore = time.monotonic()
        rest = read_all(c, sp.url, snap, exp)
        c.result.recover_s = round(max((r.end for r in rest.records), default=t_restore)
                                   - t_restore, 3)
    c.epoch_failures(ep)
    hub_req = lab.metric(hub.url, "spokefs_requests_total", 'route="object"') - hub_req0
    errors = lab.metric(sp.url, "spokefs_upstream_errors_total") - errors0
    conns = st1["connections"] - st0["connections"]
    c.check(errors == 0, f"{errors:g} failed upstream requests on a slow link")
    # Every block crosses at most once (+ a few for load's ranges): no retry loop.
    c.check(hub_req <= blocks + 4, f"{hub_req:g} upstream requests for {blocks} blocks")
    c.check(conns <= 64 + 8, f"{conns} new upstream connections on a slow link")
    c.detail(slow_epoch_s=round(slow_s, 2), upstream_requests=hub_req, blocks=blocks,
             new_connections=conns, slow_mb_s=round(sum(len(exp[p]) for p in small)
                                                    / slow_s / 1e6, 2))


def case_spoke_kill(c: Case) -> None:
    """kill -9 of the spoke during a heavy fill; restart on the same cache and port."""
    s, lab = c.scale, c.lab
    c.result.injected = "spoke kill -9 mid-fill; restart on same dir + port"
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    wan = lab.wan(hub, s)
    sp = lab.spoke(wan.url, "cache", "--deadline", f"{s.deadline}s")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    client_deadline = 30.0
    full = wan.status()["bandwidth"]
    wan.set(bandwidth=full / 20)  # so the kill lands mid-fill, with blocks being written
    ep = Epoch(c.client_reader(sp.url, snap, client_deadline), list(exp), exp, c.tally,
               s.readers)
    lab.post(f"{sp.url}/v1/datasets/{DATASET}/warm", {"snapshot": snap, "prefix": ""})
    wait_until(lambda: lab.metric(sp.url, "spokefs_cache_bytes") >= ds.total * 0.3, 60,
               "the cache to fill to 30%", interval=0.02)
    sp.kill()
    t_kill = time.monotonic()
    before = store_check(lab.root / "cache")
    c.check(before["bad"] == before["missing"] == 0,
            f"indexed blocks bad or missing on disk after kill -9: {before}")
    sp2 = lab.restart(sp)
    t_up = time.monotonic()
    wan.set(bandwidth=full)
    m = None
    for line in sp2.output:
        m = m or re.search(r"cache: (\d+) blocks \((\d+) bytes\) resident", line)
    kept = int(m.group(1)) if m else 0
    c.check(m, "the restarted spoke did not log what it recovered")
    c.check(kept == before["whole"], f"kept {kept} blocks of {before['whole']} whole ones")
    ep.join(120 + client_deadline)
    c.epoch_failures(ep)
    after_restart = [r.end for r in ep.records if r.ok and r.start < t_up and r.end > t_up]
    c.result.recover_s = round(min(after_restart) - t_kill, 3) if after_restart else None
    read_all(c, sp2.url, snap, exp)
    sp2.stop()
    final = store_check(lab.root / "cache")
    c.check(final["bad"] == final["missing"] == final["orphans"] == 0,
            f"cache folder after a clean stop: {final}")
    c.detail(at_kill=before, kept_blocks=kept,
             kept_fraction=round(kept / before["whole"], 3) if before["whole"] else None,
             restart_s=round(t_up - t_kill, 2), final=final)


def case_hub_kill(c: Case) -> None:
    """kill -9 of the hub; restart on the same port and state: spokes reconnect by themselves."""
    s, lab = c.scale, c.lab
    dl = max(s.deadline, 15.0)
    c.result.injected = f"hub kill -9, down {s.cut_s:g}s; restart on same port + state"
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    wan = lab.wan(hub, s)
    sp = lab.spoke(wan.url, "cache", "--deadline", f"{dl}s", "--no-prefetch")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    cached, uncached = _split(list(exp))
    read_all(c, sp.url, snap, exp, cached)
    with c.load(sp.url, snap, exp):
        hub.kill()
        t_kill = time.monotonic()
        ep = Epoch(c.http_reader(sp.url, snap), list(exp), exp, c.tally, s.readers, seed=5)
        time.sleep(max(0.0, t_kill + s.cut_s - time.monotonic()))  # the outage itself
        t_restart = time.monotonic()
        lab.restart(hub)
        t_up = time.monotonic()
        ep.join(60 + dl)
    c.epoch_failures(ep)
    during = [r for r in ep.records if r.path in cached and r.end < t_restart and r.ok]
    c.check(during, "no cached read was served while the hub was down")
    slow = max((r.end - r.start for r in during), default=0.0)
    c.check(slow < 1.0, f"a cached read took {slow:.2f}s while the hub was down")
    waited = [r.end for r in ep.records if r.path in uncached and r.ok and r.end > t_restart]
    c.check(waited, "no uncached read completed after the hub came back")
    c.result.recover_s = round(min(waited) - t_restart, 3) if waited else None
    c.detail(hub_restart_s=round(t_up - t_restart, 2), cached_during_outage=len(during),
             slowest_cached_read_s=round(slow, 3))


def case_source_change(c: Case) -> None:
    """Files are rewritten, deleted and added under a job pinned to a snapshot."""
    s, lab = c.scale, c.lab
    c.result.injected = "files rewritten/deleted/added under a pinned job"
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    sp = lab.spoke(hub.url, "cache", "--deadline", f"{s.deadline}s", "--latest-ttl", "1s",
                   "--no-prefetch")
    snap1 = lab.latest(sp.url)
    exp1 = ds.pin(snap1)
    bs = int(lab.json(f"{sp.url}/v1/datasets/{DATASET}")["block_size"])
    # A multi-block file of which only the first block is cached when it changes.
    partial = max(exp1, key=lambda p: len(exp1[p]))
    c.check(len(exp1[partial]) > 2 * bs, "the case needs a file of several blocks")
    cached, uncached = _split([p for p in exp1 if exp1[p] and p != partial])
    read_all(c, sp.url, snap1, exp1, cached)
    r = lab.get(f"{sp.url}/{DATASET}@{snap1}/{partial}", Range="bytes=0-999")
    c.check(r.status == 206 and c.tally.compare(partial, r.data, exp1[partial][:1000]),
            f"first block of {partial}: HTTP {r.status}")
    rng = random.Random(11)
    changed = set(rng.sample(cached, 3) + rng.sample(uncached, 3)) | {partial}
    deleted = {p for p in rng.sample(sorted(set(cached) - changed), 1)
               + rng.sample(sorted(set(uncached) - changed), 1)}
    added = ["class0/new-a.jpg", "shards/new-b.tar"]
    touched = changed | deleted
    # Read only after the change, so they are certain to be gone from the hub by then.
    late = [*sorted((changed | deleted) & set(uncached))[:3], partial]

    def allowed(path: str, exc: BaseException) -> bool:
        # A pinned version the hub no longer has: 410, never other bytes.
        return path in touched and getattr(exc, "status", 0) == 410 and b"version_gone" in \
            getattr(exc, "body", b"")

    def mutate() -> None:
        for i, p in enumerate(sorted(changed)):
            old = ds.files[p]
            new = bytes(b ^ 0x5A for b in old[:4096]) + old[4096:] if i % 2 else \
                rng.randbytes(len(old) + 1000)
            ds.write(p, new, in_place=bool(i % 2))
            time.sleep(0.02)
        for p in deleted:
            ds.delete(p)
        for p in added:
            ds.write(p, rng.randbytes(300_000))

    with c.load(sp.url, snap1, exp1):
        ep = Epoch(c.http_reader(sp.url, snap1), [p for p in exp1 if p not in late] * 2, exp1,
                   c.tally, s.readers, on_error=allowed)
        writer = threading.Thread(target=mutate)
        writer.start()
        writer.join(60)
        ep.join(120)
        c.epoch_failures(ep)
        # After the change: the pinned job still gets its snapshot from the cache, the hub's
        # unchanged files, and a clear 410 for what is gone -- never bytes of another version.
        gone = 0
        for p in sorted(set(exp1) - {partial}):
            r = lab.get(f"{sp.url}/{DATASET}@{snap1}/{p}", timeout=30)
            if r.status == 200:
                c.tally.compare(p, r.data, exp1[p])
            elif r.status == 410 and p in touched:
                gone += 1
            else:
                c.check(False, f"pinned {p} after the change: HTTP {r.status} {r.data[:200]!r}")
            if p in late and p != partial:
                c.check(r.status == 410 and b"version_gone" in r.data,
                        f"{p} changed on the hub and never cached: HTTP {r.status}, want 410")
        # Partly cached: the cached block is still served; the whole file cannot be, and the
        # reader must learn it without waiting and without a single wrong byte.
        r = lab.get(f"{sp.url}/{DATASET}@{snap1}/{partial}", Range="bytes=10-99999")
        c.check(r.status == 206 and c.tally.compare(partial, r.data, exp1[partial][10:100000]),
                f"cached block of a changed file: HTTP {r.status}")
        t0 = time.monotonic()
        got, outcome = _read_stream(lab, f"{sp.url}/{DATASET}@{snap1}/{partial}", timeout=15)
        c.tally.compare(partial, got, exp1[partial][:len(got)])
        c.check(outcome in ("cut", "HTTP 410"), f"whole read of a partly cached changed file: "
                f"{outcome} after {time.monotonic() - t0:.1f}s, {len(got)} bytes")
        t0 = time.monotonic()
        try:
            c.client_reader(sp.url, snap1, 20)(partial)
            c.check(False, "spokefs.open read a file whose version is gone")
        except spokefs.VersionGone:
            pass
        except spokefs.SpokeError as exc:
            c.check(False, f"spokefs.open of a partly cached changed file: {exc!r}")
        client_s = time.monotonic() - t0
        c.check(client_s < 5, f"spokefs.open took {client_s:.1f}s to report VersionGone")
        t_snap = time.monotonic()
        made = lab.post(f"{hub.url}/v1/datasets/{DATASET}/snapshots", {})
        snap2 = str(made["id"])
        c.check(snap2 != snap1, "the change gave no new snapshot")
        exp2 = ds.pin(snap2)
        wait_until(lambda: lab.latest(sp.url) == snap2, 10, "the spoke to see the new snapshot")
        c.result.recover_s = round(time.monotonic() - t_snap, 3)
        # New readers see the change; deleted files are gone from the new snapshot.
        for p in sorted(exp2):
            r = lab.get(f"{sp.url}/{DATASET}/{p}")
            c.check(r.status == 200 and r.headers.get("X-Spokefs-Snapshot") == snap2,
                    f"latest {p}: HTTP {r.status} snapshot {r.headers.get('X-Spokefs-Snapshot')}")
            if r.status == 200:
                c.tally.compare(p, r.data, exp2[p])
        for p in deleted:
            c.check(lab.get(f"{sp.url}/{DATASET}/{p}").status == 404,
                    f"deleted {p} still in latest")
    # Purge what no current file uses: every block of a version not in the latest snapshot.
    man = lab.get(f"{sp.url}/v1/datasets/{DATASET}/snapshots/{snap2}/manifest")
    current = set(Manifest.decode(man.data).versions)
    settle_index(lab, sp.url, lab.root / "cache")
    before = cached_versions(lab.root / "cache")
    stale = sum(n for v, n in before.items() if v not in current)
    c.check(stale > 0, "no stale version was cached (the case needs some)")
    purged = lab.post(f"{sp.url}/v1/purge", {"dataset": DATASET, "keep": ["latest"]})
    after = cached_versions(lab.root / "cache")
    c.check(purged.get("freed_bytes") == stale,
            f"purge freed {purged.get('freed_bytes')} bytes, stale versions held {stale}")
    c.check(all(v in current for v in after), "a stale version survived the purge")
    c.check(sum(after.values()) == sum(n for v, n in before.items() if v in current),
            "the purge dropped blocks of the latest snapshot")
    c.detail(changed=len(changed), deleted=len(deleted), added=len(added), gone_410=gone,
             partial_read=outcome, version_gone_after_s=round(client_s, 3),
             upstream_digest_failures=lab.metric(sp.url, "spokefs_integrity_failures_total",
                                                 'where="upstream"'),
             snapshot_visible_s=c.result.recover_s, stale_bytes_purged=stale)


def case_disk_full(c: Case) -> None:
    """The cache volume (an 8 MiB tmpfs) fills up mid-fill."""
    s, lab = c.scale, c.lab
    c.result.injected = "cache volume (8 MiB tmpfs) full mid-fill"
    if os.geteuid() != 0 or shutil.which("mount") is None:
        raise Skip("needs root and mount(8) for a small tmpfs")
    cache = lab.root / "cache"
    cache.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(cache)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    lab.cleanups.append(lambda: subprocess.run(["umount", "-l", str(cache)],
                                               capture_output=True))
    ds = Dataset(lab.root / "ds", s)
    c.check(ds.total > 8 << 20, "the dataset must be larger than the volume")
    hub = lab.hub(ds, s)
    sp = lab.spoke(hub.url, "cache", "--deadline", f"{s.deadline}s")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    with c.load(sp.url, snap, exp):
        read_all(c, sp.url, snap, exp)
        read_all(c, sp.url, snap, exp)  # hits and pass-through mixed
    c.check(lab.get(f"{sp.url}/v1/status").status == 200, "spoke unhealthy on a full disk")
    werr = lab.metric(sp.url, "spokefs_cache_write_errors_total")
    passed = lab.metric(sp.url, "spokefs_passthrough_bytes_total")
    evicted = lab.metric(sp.url, "spokefs_cache_evictions_total")
    c.check(werr > 0, "the full disk was never noticed")
    c.check(passed > 0 or evicted > 0, "neither pass-through nor eviction on a full disk")
    # Space comes back (an operator purges): the spoke caches again by itself.
    lab.post(f"{sp.url}/v1/purge", {"dataset": DATASET})
    t_free = time.monotonic()
    victim = max(exp, key=lambda p: len(exp[p]) if len(exp[p]) < 2 << 20 else 0)
    hits0 = lab.metric(sp.url, "spokefs_cache_hits_total")

    def cached_again() -> bool:
        _timed_read(c, sp.url, snap, victim, exp[victim])
        return lab.metric(sp.url, "spokefs_cache_hits_total") > hits0

    wait_until(cached_again, 20, "the spoke to cache again after space came back",
               interval=0.5)
    c.result.recover_s = round(time.monotonic() - t_free, 3)
    read_all(c, sp.url, snap, exp)
    sp.stop()
    final = store_check(cache)
    c.check(final["bad"] == 0, f"torn or partial blocks: {final}")
    # Restart on a volume that is full again: recovery must not need free space.
    filler = cache / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)
    sp2 = lab.restart(sp)
    read_all(c, sp2.url, snap, exp)
    c.detail(write_errors=werr, passthrough_bytes=passed, evictions=evicted, final=final)


def case_bit_rot(c: Case) -> None:
    """Cached blocks are damaged on disk in several ways (a flipped bit, zeros, another block's
    bytes, a hole, the segment file cut short inside a block); each is caught on its next read,
    healed and counted."""
    s, lab = c.scale, c.lab
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    sp = lab.spoke(hub.url, "cache", "--deadline", f"{s.deadline}s")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    read_all(c, sp.url, snap, exp)
    wait_until(lambda: sum(b.size for b in blocks_on_disk(lab.root / "cache")) >= ds.total,
               10, "the spoke's index to list every block read")
    blocks = [b for b in blocks_on_disk(lab.root / "cache") if b.size]
    rng = random.Random(5)
    victims = rng.sample(blocks, min(len(blocks), 8))
    # The last block of a segment, for the cut: cutting the file there damages only it.
    last = max(blocks, key=lambda b: (b.path.name, b.offset))
    if last not in victims:
        victims[-1] = last
    kinds = ["flip", "zero", "swap", "flip-last-byte", "hole", "flip", "zero", "cut"]
    damaged = 0
    for b, kind in zip(victims, kinds, strict=False):
        if b is last:
            kind = "cut"
        elif kind == "cut":
            kind = "flip"
        data = b.read()
        with open(b.path, "r+b") as f:
            if kind.startswith("flip"):
                i = len(data) - 1 if kind == "flip-last-byte" else rng.randrange(len(data))
                os.pwrite(f.fileno(), bytes([data[i] ^ (1 << rng.randrange(8))]), b.offset + i)
            elif kind == "zero":
                os.pwrite(f.fileno(), b"\0" * min(len(data), 4096), b.offset)
            elif kind == "hole":  # the filesystem lost the block's pages: they read as zeros
                from spokefs.cache.segments import punch_hole
                punch_hole(f.fileno(), b.offset, len(data))
            elif kind == "swap":  # another block's bytes (whole, plausible, wrong)
                other = next(o for o in blocks if o not in victims)
                os.pwrite(f.fileno(), other.read()[:len(data)].ljust(len(data), b"\1"),
                          b.offset)
            elif kind == "cut":  # the segment file cut short inside the block
                os.ftruncate(f.fileno(), b.offset + len(data) // 2)
        damaged += len(data)
    c.result.injected = f"{len(victims)} cached blocks damaged"
    fail0 = lab.metric(sp.url, "spokefs_integrity_failures_total")
    up0 = lab.metric(sp.url, "spokefs_upstream_bytes_total")
    t0 = time.monotonic()
    with c.load(sp.url, snap, exp):
        read_all(c, sp.url, snap, exp)
    c.result.recover_s = round(time.monotonic() - t0, 3)
    fails = lab.metric(sp.url, "spokefs_integrity_failures_total", 'where="cache"') - fail0
    up = lab.metric(sp.url, "spokefs_upstream_bytes_total") - up0
    c.check(fails == len(victims), f"{fails:g} integrity failures counted for {len(victims)} "
            "damaged blocks")
    if c.scale.load == 0:
        c.check(up == damaged, f"refetched {up:g} bytes for {damaged} damaged")
    read_all(c, sp.url, snap, exp)
    again = lab.metric(sp.url, "spokefs_integrity_failures_total") - fail0
    c.check(again == fails, "healed blocks failed their check again")
    # The index itself rots: the spoke must still start (empty) and serve correct bytes.
    sp.stop()
    cache = lab.root / "cache"
    for name in ("index.sqlite-wal", "index.sqlite-shm"):
        (cache / name).unlink(missing_ok=True)
    (cache / "index.sqlite").write_bytes(random.Random(3).randbytes(64 * 1024))
    c.result.injected += "; index garbled"
    sp2 = lab.restart(sp)
    c.check(any("unusable" in line for line in sp2.output),
            "the restarted spoke did not report its unusable index")
    read_all(c, sp2.url, snap, exp)
    c.detail(damaged_blocks=len(victims), detected=fails, refetched_bytes=up,
             after_index_rot=lab.json(f"{sp2.url}/v1/status")["cache"])


def case_chain_restart(c: Case) -> None:
    """node spoke -> cluster spoke -> hub; the cluster spoke is killed and restarted under load."""
    s, lab = c.scale, c.lab
    dl = max(s.deadline, 15.0)
    c.result.injected = "middle spoke kill -9 mid-epoch; restart"
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    wan = lab.wan(hub, s)
    cluster = lab.spoke(wan.url, "cluster", "--deadline", f"{s.deadline}s", name="cluster")
    node = lab.spoke(cluster.url, "node", "--deadline", f"{dl}s", name="node")
    snap = lab.latest(node.url)
    exp = ds.pin(snap)
    cached, _ = _split(list(exp))
    read_all(c, cluster.url, snap, exp, cached)
    with c.load(node.url, snap, exp):
        ep = Epoch(c.http_reader(node.url, snap), list(exp), exp, c.tally, s.readers, seed=9)
        wait_until(lambda: ep.done_count >= len(exp) // 4, 60, "a quarter of the epoch")
        cluster.kill()
        t_kill = time.monotonic()
        time.sleep(0.5)  # readers now hit a dead upstream
        cluster2 = lab.restart(cluster)
        t_up = time.monotonic()
        ep.join(60 + dl)
    c.epoch_failures(ep)
    c.check(lab.metric(node.url, "spokefs_integrity_failures_total") == 0,
            "the node saw corrupt blocks from the restarted middle spoke")
    after = [r.end for r in ep.records if r.ok and r.end > t_up]
    c.result.recover_s = round(min(after) - t_up, 3) if after else None
    read_all(c, node.url, snap, exp)
    c.detail(restart_s=round(t_up - t_kill, 2),
             cluster_upstream_bytes_after_restart=lab.metric(cluster2.url,
                                                             "spokefs_upstream_bytes_total"))


# -- mount cases -----------------------------------------------------------------------------
def _mount_stack(c: Case, spoke_deadline: float, mount_deadline: float
                 ) -> tuple[Dataset, Wan, Proc, str, dict[str, bytes], Path, Any]:
    from spokefs.mount.process import MountProcess, fuse_unusable, unmount

    reason = fuse_unusable()
    if reason is not None:
        raise Skip(f"no FUSE mount: {reason}")

    s, lab = c.scale, c.lab
    ds = Dataset(lab.root / "ds", s)
    hub = lab.hub(ds, s)
    wan = lab.wan(hub, s)
    sp = lab.spoke(wan.url, "cache", "--deadline", f"{spoke_deadline}s", "--no-prefetch")
    snap = lab.latest(sp.url)
    exp = ds.pin(snap)
    mp = lab.root / "mnt"
    mp.mkdir()
    m = MountProcess(f"{sp.url}/{DATASET}@{snap}", mp, "--deadline", f"{mount_deadline}s")
    m.start()

    def cleanup() -> None:
        m.kill()
        from spokefs.mount import sysfs
        if sysfs.is_mounted(mp):
            unmount(mp)

    lab.cleanups.append(cleanup)
    return ds, wan, sp, snap, exp, mp, m


def _pread_file(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _mount_epoch(c: Case, mp: Path, exp: dict[str, bytes]) -> None:
    """Every file through the mount, several readers, every byte compared."""
    ep = Epoch(lambda p: _pread_file(mp / p), list(exp), exp, c.tally, c.scale.readers)
    ep.join(180)
    c.epoch_failures(ep)


def case_mount_cut(c: Case) -> None:
    """A cut longer than the mount's deadline: EIO, not a hang; the mount serves afterwards."""
    s, lab = c.scale, c.lab
    dl = s.short_deadline
    c.result.injected = f"link cut > mount deadline {dl:g}s"
    _, wan, sp, snap, exp, mp, m = _mount_stack(c, 60.0, dl)
    small = sorted(p for p in exp if p.startswith("class"))
    first, victim = small[0], small[-1]
    c.tally.compare(first, _pread_file(mp / first), exp[first])
    with c.load(sp.url, snap, exp):
        wan.cut(reset_after=3600)
        t0 = time.monotonic()
        code = 0
        try:
            _pread_file(mp / victim)
            c.check(False, "read an uncached file through the mount during the cut")
        except OSError as exc:
            code = exc.errno or 0
        elapsed = time.monotonic() - t0
        eio_answers = sum("answering EIO" in line for line in m.output)
        c.check(code == errno.EIO, f"mount read during the cut: errno {code}, want EIO")
        # The kernel asks once more after a failed readahead: up to two deadlines per read().
        c.check(elapsed <= 2 * dl + s.slack, f"EIO after {elapsed:.2f}s, deadline {dl:g}s")
        t1 = time.monotonic()
        c.tally.compare(first, _pread_file(mp / first), exp[first])
        c.check(time.monotonic() - t1 < 1.0, "a cached read through the mount was slow")
        c.check(m.alive(), "the mount process died")
        c.check(lab.get(f"{sp.url}/v1/status").status == 200, "spoke unhealthy")
        wan.restore()
        t_restore = time.monotonic()

        def served() -> bool:
            try:
                return c.tally.compare(victim, _pread_file(mp / victim), exp[victim])
            except OSError:
                return False

        wait_until(served, 30, "the mount to read the file after the link came back", 0.1)
        c.result.recover_s = round(time.monotonic() - t_restore, 3)
        _mount_epoch(c, mp, exp)
    c.detail(eio_after_s=round(elapsed, 2), mount_eio_answers=eio_answers)


def case_mount_kill(c: Case) -> None:
    """The mount process is killed (kill -9) while a reader waits in read(): the reader gets
    an error at once, `spokefs umount` clears the mountpoint, a new mount works."""
    from spokefs.mount import sysfs
    from spokefs.mount.process import MountProcess

    lab = c.lab
    c.result.injected = "mount kill -9 with a read pending"
    _, wan, sp, snap, exp, mp, m = _mount_stack(c, 60.0, 60.0)
    small = sorted(p for p in exp if p.startswith("class"))
    first, victim = small[0], small[-1]
    c.tally.compare(first, _pread_file(mp / first), exp[first])
    wan.cut(reset_after=3600)
    outcome: dict[str, Any] = {}

    def reader() -> None:
        try:
            outcome["data"] = _pread_file(mp / victim)
        except OSError as exc:
            outcome["errno"] = exc.errno
        outcome["t"] = time.monotonic()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    wait_until(lambda: lab.metric(sp.url, "spokefs_upstream_inflight") >= 1, 20,
               "the reader's fetch to be pending")
    m.kill()
    t_kill = time.monotonic()
    th.join(10)
    c.check(not th.is_alive(), "a reader hung in read() after the mount process died")
    code = outcome.get("errno")
    c.check(code in (errno.EIO, errno.ENOTCONN, errno.ECONNABORTED),
            f"pending read after kill -9: {outcome}")
    err_s = max(0.0, outcome.get("t", time.monotonic()) - t_kill)  # may beat kill()'s return
    try:
        _pread_file(mp / first)
        c.check(False, "a read of the dead mount succeeded")
        new_code = 0
    except OSError as exc:
        new_code = exc.errno or 0
    c.check(new_code in (errno.EIO, errno.ENOTCONN), f"new read of a dead mount: errno {new_code}")
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "umount", str(mp)],
                       capture_output=True, text=True, timeout=60)
    c.check(r.returncode == 0, f"spokefs umount failed: {r.stderr.strip()}")
    c.check(not sysfs.is_mounted(mp) and os.listdir(mp) == [], "the mountpoint is not clear")
    wan.restore()
    t_remount = time.monotonic()
    m2 = MountProcess(f"{sp.url}/{DATASET}@{snap}", mp, "--deadline", "30s").start()
    lab.cleanups.append(m2.stop)
    c.tally.compare(victim, _pread_file(mp / victim), exp[victim])
    c.result.recover_s = round(time.monotonic() - t_remount, 3)
    _mount_epoch(c, mp, exp)
    m2.stop()
    c.detail(pending_read_errno=errno.errorcode.get(code or 0, code),
             pending_read_error_after_s=round(err_s, 3),
             dead_mount_errno=errno.errorcode.get(new_code, new_code))


CASES: dict[str, Callable[[Case], None]] = {
    "link_cut": case_link_cut,
    "long_cut": case_long_cut,
    "degraded": case_degraded,
    "spoke_kill": case_spoke_kill,
    "hub_kill": case_hub_kill,
    "mount_cut": case_mount_cut,
    "mount_kill": case_mount_kill,
    "source_change": case_source_change,
    "disk_full": case_disk_full,
    "bit_rot": case_bit_rot,
    "chain_restart": case_chain_restart,
}


def run_case(name: str, root: Path, scale: Scale, logs: Path | None = None,
             tokens: bool = True) -> Result:
    """Run one case in ``root`` (a fresh folder); never raises for what the case finds."""
    c = Case(name, Lab(root, logs, tokens), scale)
    t0 = time.monotonic()
    try:
        with c.lab.tokens.as_client() if c.lab.tokens else contextlib.nullcontext():
            CASES[name](c)
    except Skip as exc:
        c.result.outcome = f"skipped: {exc}"
    except CaseFailed as exc:
        c.check(False, str(exc))
    except Exception:
        c.check(False, "crashed:\n" + traceback.format_exc())
    finally:
        c.lab.close()
    r = c.result
    r.seconds = round(time.monotonic() - t0, 2)
    r.bytes_verified = c.tally.verified
    r.bytes_wrong = c.tally.wrong
    if c.tally.wrong:
        r.failures.append(f"{c.tally.wrong} wrong bytes: {c.tally.wrong_reads[:5]}")
    if c.loads:
        r.details["load_reads"] = sum(ld.reads for ld in c.loads)
        r.details["load_errors"] = sum(ld.errors for ld in c.loads)
    if r.failures and not r.skipped:
        r.outcome = "FAILED"
        r.logs = c.lab.output()
    return r


# -- the benchmark command -------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="inject faults under load; check every byte readers get",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where to write results.json and the services' logs")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated cases (default: all: {', '.join(CASES)})")
    p.add_argument("--repeat", type=int, default=2, help="rounds of every case (default: 2)")
    p.add_argument("--scale", choices=("bench", "ci"), default="bench",
                   help="bench: more data, readers and background load; ci: the test sizes")
    p.add_argument("--no-tokens", action="store_true",
                   help="run hub and spoke without --auth (default: with tokens, as deployed)")
    p.add_argument("--load", type=int, default=None,
                   help="background reader threads per case (default: 4 at bench scale)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import tempfile

    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise spokefs.ConfigError(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    scale = Scale.bench() if args.scale == "bench" else Scale.ci()
    if args.load is not None:
        scale = replace(scale, load=args.load)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Result] = []
    t0 = time.monotonic()
    for rnd in range(args.repeat):
        for name in names:
            with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as tmp:
                r = run_case(name, Path(tmp), scale, out / "logs" / f"{name}-{rnd}",
                             tokens=not args.no_tokens)
            r.details["round"] = rnd
            rows.append(r)
            status = r.outcome if r.ok else r.explain()
            print(f"[{rnd + 1}/{args.repeat}] {name}: {status} ({r.seconds:.1f}s)",
                  file=sys.stderr, flush=True)
    header = ["case", "injected", "outcome", "bytes verified", "bytes wrong", "recover s",
              "case s"]
    print(table([[r.case, r.injected, r.outcome, r.bytes_verified, r.bytes_wrong,
                  "-" if r.recover_s is None else r.recover_s, r.seconds] for r in rows],
                header))
    path = write_json(out, {"benchmark": "chaos", "machine": machine(), "scale": asdict(scale),
                            "tokens": not args.no_tokens,
                            "repeat": args.repeat, "seconds": round(time.monotonic() - t0, 1),
                            "cases": [r.row() for r in rows]})
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows)} runs, {len(failed)} failed, "
          f"{sum(r.bytes_verified for r in rows)} bytes verified, "
          f"{sum(r.bytes_wrong for r in rows)} wrong; wrote {path}")
    return 1 if failed else 0

