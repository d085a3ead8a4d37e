"""``spokefs bench abuse``: ordinary readers beside hostile and careless clients.

A hub and a spoke on 127.0.0.1. Ordinary readers read small files (already cached) for a
while alone (``idle``), then again while, at the same time (``loaded``):

- hundreds of slow clients send request headers a byte at a time and never finish;
- one reader asks for a multi-GiB file and takes 1 MiB/s of it, then goes away;
- a stream of malformed requests: bad ranges, path escapes, wrong JSON types, a gzip bomb,
  an order with absurd ranges, raw garbage;
- memory hogs: a crowd of batch reads of 64 MiB of cached blocks each, read slowly (a replica
  worker copies what it serves); JSON that parses to ~24 times its size; a job announcing
  epoch after epoch without reading.

Reported: the spoke's and the hub's peak memory (RSS of every process of each), the ordinary
readers' p99 loaded against idle, the bytes of the abandoned file that crossed to the spoke
after its reader left, and every 5xx anyone got. Writes DIR/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import multiprocessing
import os
import random
import shutil
import socket
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from spokefs.procs import Service, hub_args, spoke_args
from spokefs.units import parse_size
from spokefs_bench.common import machine, percentile, table, write_json
from spokefs_bench.dataplane import tree_cpu_s

GOALS = {
    "spoke_peak_rss_mib <= 512": ("spoke_peak_rss_mib", 512.0),
    "ordinary_p99_ratio <= 2": ("ordinary_p99_ratio", 2.0),
    "abandoned_link_bytes <= 64 MiB": ("abandoned_link_bytes", float(64 << 20)),
    "server_errors == 0": ("server_errors", 0.0),
}


CASES = ("slow", "abandoned", "malformed", "memory")


def _cases(text: str) -> tuple[str, ...]:
    chosen = tuple(c for c in text.split(",") if c)
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(unknown)}: choose from "
                                         f"{', '.join(CASES)}")
    return chosen


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("abuse", help="ordinary readers beside slow, abandoned and bad clients",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--out", required=True, type=Path, help="results folder")
    p.add_argument("--work-dir", type=Path, help="dataset and cache (default OUT/work)")
    p.add_argument("--slow-clients", type=int, default=500, help="default 500")
    p.add_argument("--large-size", type=parse_size, default=2 << 30,
                   help="the file the abandoned reader asks for (default 2GiB)")
    p.add_argument("--seconds", type=float, default=20.0,
                   help="length of the idle and of the loaded phase (default 20)")
    p.add_argument("--readers", type=int, default=4, help="ordinary reader threads (4)")
    p.add_argument("--batch-crowd", type=int, default=16,
                   help="slow batch reads of 64 MiB each at once (default 16)")
    p.add_argument("--cases", type=_cases, default=",".join(CASES), metavar="A,B,...",
                   help=f"which hostile cases run beside the readers (default: all of "
                        f"{','.join(CASES)}); one at a time says what each costs")
    p.set_defaults(func=run)


# -- the pieces ------------------------------------------------------------------------------
def _tree_rss_mib(pid: int) -> float:
    """RSS of a process and its children (a spoke's workers), MiB."""
    total, todo = 0, [pid]
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
        todo.extend(children.get(p, []))
    return total / 1024


def _metric(base: str, name: str) -> float:
    import urllib3

    text = urllib3.request("GET", f"{base}/metrics").data.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


class Errors:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.server = 0
        self.samples: list[str] = []

    def saw(self, status: int, what: str) -> None:
        if status >= 500:
            with self.lock:
                self.server += 1
                if len(self.samples) < 10:
                    self.samples.append(f"{status} {what}")


def _ordinary_apart(base: str, names: list[str], readers: int, seconds: float
                    ) -> tuple[list[float], int, list[str], float]:
    """``_ordinary`` in a process of its own (``ReadersApart``): latencies, 5xx count and
    samples, and the CPU-seconds it took."""
    errors = Errors()
    cpu = time.process_time()
    lat = _ordinary(base, names, readers, seconds, errors)
    return lat, errors.server, errors.samples, time.process_time() - cpu


class ReadersApart:
    """The ordinary readers in a process of their own, so that the attackers' threads here
    (a tight loop of refused requests, say) do not take their interpreter lock: their
    latency is then the servers', not this process's. One process, reused for both phases."""

    def __init__(self) -> None:
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.cpu_s = 0.0  # the last phase's

    def start(self, base: str, names: list[str], readers: int, seconds: float
              ) -> Future[tuple[list[float], int, list[str], float]]:
        return self.pool.submit(_ordinary_apart, base, names, readers, seconds)

    def result(self, fut: Future[tuple[list[float], int, list[str], float]], errors: Errors
               ) -> list[float]:
        lat, server, samples, self.cpu_s = fut.result()
        with errors.lock:
            errors.server += server
            errors.samples.extend(samples[:max(0, 10 - len(errors.samples))])
        return lat

    def close(self) -> None:
        self.pool.shutdown()


def _ordinary(base: str, names: list[str], readers: int, seconds: float, errors: Errors
              ) -> list[float]:
    import urllib3

    http = urllib3.PoolManager(maxsize=readers, retries=False)
    lat: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        while time.monotonic() < end:
            name = rng.choice(names)
            t0 = time.perf_counter()
            r = http.request("GET", f"{base}/ds/{name}", headers={"X-Spokefs-Job": "ordinary"})
            mine.append(time.perf_counter() - t0)
            errors.saw(r.status, f"GET {name}")
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


async def _slow_clients(host: str, port: int, n: int, stop: asyncio.Event) -> dict[str, int]:
    """Clients that send headers a byte a second and never finish; how many the server
    closed on them before the end."""
    closed = 0

    async def one() -> None:
        nonlocal closed
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            return
        try:
            header = b"GET /ds/small/f00000 HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
            for byte in header:
                if stop.is_set():
                    return
                writer.write(bytes([byte]))
                await writer.drain()
                try:  # the server closing shows as EOF (or a reset on the next write)
                    if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                        closed += 1
                        return
                except TimeoutError:
                    pass
        except (ConnectionError, OSError):
            closed += 1
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(n)))
    return {"slow_clients": n, "closed_by_server": closed}


async def _abandoned(host: str, port: int, path: str, seconds: float) -> dict[str, float]:
    """Ask for the whole large file, take 1 MiB/s for ``seconds``, then leave."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 16)
    # A job of its own, so what prediction learns from the ordinary readers stays theirs.
    writer.write(f"GET /ds/{path} HTTP/1.1\r\nHost: x\r\nX-Spokefs-Job: abandoned\r\n\r\n"
                 .encode())
    await writer.drain()
    taken, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        data = await reader.read(64 << 10)
        if not data:
            break
        taken += len(data)
        ahead = taken / (1 << 20) - (time.monotonic() - t0)  # seconds ahead of 1 MiB/s
        if ahead > 0:
            await asyncio.sleep(ahead)
    writer.close()
    return {"taken_bytes": taken, "left_at": time.monotonic()}


def _bad_requests(base: str, names: list[str]) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(method, path, body, headers) of malformed or hostile requests."""
    bomb = gzip.compress(b"\0" * (256 << 20), compresslevel=9)  # 256 MiB of zeros
    order = {"epoch": 0, "files": names[:3], "ranges": [[0, 10**15], [-5, 3], ["x", 1]]}
    j = {"Content-Type": "application/json"}
    return [
        ("GET", f"/ds/{names[0]}", b"", {"Range": "bytes=" + "9" * 5000 + "-"}),
        ("GET", f"/ds/{names[0]}", b"", {"Range": "bytes=\u00b2-3"}),
        ("GET", "/ds/../../etc/passwd", b"", {}),
        ("GET", "/ds/%2e%2e/%2e%2e/etc/passwd", b"", {}),
        ("GET", "/v1/datasets/ds/objects/..%2f..%2fx", b"", {}),
        ("POST", "/v1/datasets/ds/warm", b'{"paths": 5}', j),
        ("POST", "/v1/datasets/ds/residency", b'{"prefix": ["a"]}', j),
        ("POST", "/v1/datasets/ds/locate", b'{"blocks": [["v", "x"]]}', j),
        ("POST", "/v1/datasets/ds/reads", b'{"reads": [[1, 2, 3, 4]]}', j),
        ("POST", "/v1/datasets/ds/jobs/j/order", json.dumps(order).encode(), j),
        ("POST", "/v1/datasets/ds/jobs/j/order", bomb, {**j, "Content-Encoding": "gzip"}),
        ("POST", "/v1/datasets/ds/warm", bomb, j),
        ("POST", "/v1/datasets/ds/warm", b"\x1f\x8b garbage", j),
        ("GET", "/v1/datasets/" + "x" * 5000, b"", {}),
    ]


def _malformed(base: str, names: list[str], seconds: float, errors: Errors) -> int:
    import urllib3

    http = urllib3.PoolManager(retries=False, timeout=30)
    host, port = base.removeprefix("http://").split(":")
    reqs = _bad_requests(base, names)
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for method, path, body, headers in reqs:
            try:
                r = http.request(method, base + path, body=body or None, headers=headers)
                errors.saw(r.status, f"{method} {path[:60]}")
            except urllib3.exceptions.HTTPError:
                pass  # the server hung up on it: not a 5xx
            sent += 1
        with socket.create_connection((host, int(port)), timeout=5) as s:  # raw garbage
            s.sendall(os.urandom(2048) + b"\r\n\r\n")
            answer = s.recv(64)
            if answer[:9] == b"HTTP/1.1 " and answer[9:10] == b"5":
                errors.saw(int(answer[9:12]), "raw garbage")
        sent += 1
    return sent


def _batch_hog(host: str, port: int, body: bytes, seconds: float) -> int:
    """POST a batch read and take its answer at 1 MiB/s for ``seconds``; the status (0: it
    waited its turn for the spoke's batch room past the socket's 30 s)."""
    try:
        return _batch_hog_once(host, port, body, seconds)
    except TimeoutError:
        return 0


def _batch_hog_once(host: str, port: int, body: bytes, seconds: float) -> int:
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"POST /v1/datasets/ds/blocks HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        head = s.recv(64 << 10)
        end = time.monotonic() + seconds
        while time.monotonic() < end and s.recv(64 << 10):
            time.sleep(1 / 16)  # 64 KiB per 1/16 s: 1 MiB/s
        return int(head[9:12]) if head[:9] == b"HTTP/1.1 " and head[9:12].isdigit() else 0


def _memory_hogs(base: str, seconds: float, crowd: int, errors: Errors) -> dict[str, Any]:
    """The memory cases: a crowd of slow batch reads, a JSON bomb, an endless epoch loop."""
    import urllib3

    from spokefs.manifest import Manifest

    http = urllib3.PoolManager(retries=False, timeout=60)
    host, port = base.removeprefix("http://").split(":")
    blob = http.request("GET", f"{base}/v1/datasets/ds/snapshots/latest/manifest",
                        decode_content=False).data
    m = Manifest.decode(blob)
    small = [[v, 0] for p, v in zip(m.paths, m.versions, strict=True) if p.startswith("small/")]
    per = max(1, (64 << 20) // (64 << 10) - 1)  # just under a batch's 64 MiB
    body = json.dumps({"blocks": small[:per]}).encode()
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda: statuses.append(
        _batch_hog(host, int(port), body, seconds / 2))) for _ in range(crowd)]
    for t in threads:
        t.start()
    j = {"Content-Type": "application/json"}
    bomb = b"[" + b"{}," * (8 << 20) + b"{}]"  # 24 MiB that json.loads makes ~600 MiB of
    r = http.request("POST", f"{base}/v1/datasets/ds/jobs/hog/order", body=bomb, headers=j)
    errors.saw(r.status, "JSON bomb")
    bomb_status = r.status
    files = [p for p in m.paths if p.startswith("small/")]
    epochs, end = 0, time.monotonic() + seconds / 2
    while time.monotonic() < end:  # epoch after epoch, nothing read
        r = http.request("POST", f"{base}/v1/datasets/ds/jobs/loop/order", headers=j,
                         body=json.dumps({"epoch": epochs, "paths": files}).encode())
        errors.saw(r.status, "epoch loop")
        epochs += 1
    for t in threads:
        t.join()
    for st in statuses:
        errors.saw(st, "slow batch read")
    return {"batch_crowd": crowd, "batch_statuses": sorted(set(statuses)),
            "json_bomb_status": bomb_status, "epochs_announced": epochs}


# -- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from spokefs.client.control import SpokeControl

    out: Path = args.out
    work: Path = args.work_dir or out / "work"
    data = work / "ds"
    small = data / "small"
    small.mkdir(parents=True, exist_ok=True)
    names = []
    rng = random.Random(1)
    for i in range(2000):
        p = small / f"f{i:05d}"
        if not p.exists() or p.stat().st_size != 64 << 10:
            p.write_bytes(rng.randbytes(64 << 10))
        names.append(f"small/{p.name}")
    large = data / "large.bin"
    if not large.exists() or large.stat().st_size != args.large_size:
        with open(large, "wb") as f:
            chunk = os.urandom(8 << 20)
            for _ in range(args.large_size // len(chunk)):
                f.write(chunk)
            f.write(chunk[:args.large_size % len(chunk)])
    shutil.rmtree(work / "cache", ignore_errors=True)  # a cold cache: the large file is fetched
    load_before = os.getloadavg()
    errors = Errors()
    rss = {"spoke": 0.0, "hub": 0.0}
    with Service(hub_args(data, work / "hubstate")) as hub, \
            Service(spoke_args(hub.url, work / "cache", "8GiB"),
                    env={"SPOKEFS_IDLE_TIMEOUT": "10"}) as spoke:
        assert hub.proc is not None and spoke.proc is not None
        SpokeControl(f"{spoke.url}/ds").warm(prefix="small/", wait=True, progress=False)
        apart = ReadersApart()
        idle = apart.result(apart.start(spoke.url, names, args.readers, args.seconds), errors)
        print(f"idle: {len(idle)} reads, p99 {percentile(idle, 99) * 1e3:.2f} ms", flush=True)

        upstream_before = _metric(spoke.url, "spokefs_upstream_bytes_total")
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                rss["spoke"] = max(rss["spoke"], _tree_rss_mib(spoke.proc.pid))  # type: ignore
                rss["hub"] = max(rss["hub"], _tree_rss_mib(hub.proc.pid))  # type: ignore
                time.sleep(0.2)

        host, port = spoke.url.removeprefix("http://").split(":")
        side: dict[str, Any] = {}

        def hostile() -> None:
            async def main() -> None:
                stop_slow = asyncio.Event()
                slow = asyncio.create_task(_slow_clients(
                    host, int(port), args.slow_clients if "slow" in args.cases else 0,
                    stop_slow))
                if "abandoned" in args.cases:
                    side["abandoned"] = await _abandoned(host, int(port), "large.bin",
                                                         args.seconds / 2)
                else:
                    await asyncio.sleep(args.seconds / 2)
                side["upstream_at_leave"] = _metric(spoke.url, "spokefs_upstream_bytes_total")
                await asyncio.sleep(args.seconds / 2)
                stop_slow.set()
                side["slow"] = await slow

            asyncio.run(main())

        threads = [threading.Thread(target=sample)]
        if {"slow", "abandoned"} & set(args.cases):
            threads.append(threading.Thread(target=hostile))
        if "malformed" in args.cases:
            threads.append(threading.Thread(target=lambda: side.__setitem__(
                "malformed", _malformed(spoke.url, names, args.seconds, errors))))
        if "memory" in args.cases:
            threads.append(threading.Thread(target=lambda: side.__setitem__(
                "memory", _memory_hogs(spoke.url, args.seconds, args.batch_crowd, errors))))
        # CPU-seconds of every process, over the loaded phase: the attackers run on the same
        # cores as the servers here, so what they cost is part of what the readers see.
        cpu0 = (tree_cpu_s(spoke.proc.pid), tree_cpu_s(hub.proc.pid), time.process_time())
        loading = apart.start(spoke.url, names, args.readers, args.seconds)
        for t in threads:
            t.start()
        loaded = apart.result(loading, errors)
        apart.close()
        for t in threads[1:]:
            t.join()
        cpu1 = (tree_cpu_s(spoke.proc.pid), tree_cpu_s(hub.proc.pid), time.process_time())
        cpu = {k: round(b - a, 2) for k, a, b in zip(("spoke", "hub", "attackers"), cpu0, cpu1,
                                                       strict=True)}
        cpu["readers"] = round(apart.cpu_s, 2)
        end = time.monotonic() + 30  # what was asked before the reader left, arriving
        while _metric(spoke.url, "spokefs_upstream_inflight") and time.monotonic() < end:
            time.sleep(0.1)
        stop.set()
        threads[0].join()
        after = _metric(spoke.url, "spokefs_upstream_bytes_total")
    abandoned_bytes = after - side.get("upstream_at_leave", after)
    p99_idle, p99_loaded = percentile(idle, 99), percentile(loaded, 99)
    results = {
        "spoke_peak_rss_mib": round(rss["spoke"], 1), "hub_peak_rss_mib": round(rss["hub"], 1),
        "ordinary_p99_idle_ms": round(p99_idle * 1e3, 3),
        "ordinary_p99_loaded_ms": round(p99_loaded * 1e3, 3),
        "ordinary_p99_ratio": round(p99_loaded / p99_idle, 2) if p99_idle else None,
        "ordinary_reads": {"idle": len(idle), "loaded": len(loaded)},
        "abandoned_link_bytes": int(abandoned_bytes),
        # The small files were cached first: all of this is the abandoned file's.
        "abandoned_file_link_bytes_total": int(after - upstream_before),
        "abandoned_taken_bytes": side.get("abandoned", {}).get("taken_bytes"),
        "server_errors": errors.server, "server_error_samples": errors.samples,
        "malformed_requests": side.get("malformed"), "slow": side.get("slow"),
        "memory_hogs": side.get("memory"),
        "loaded_cpu_s": cpu,
    }
    goals = [{"goal": g, "value": results[k], "met": results[k] is not None
              and results[k] <= limit} for g, (k, limit) in GOALS.items()]
    doc = {"benchmark": "abuse", "machine": machine(),
           "load_average_before": [round(x, 2) for x in load_before],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "params": {"slow_clients": args.slow_clients, "large_size": args.large_size,
                      "seconds": args.seconds, "readers": args.readers,
                      "batch_crowd": args.batch_crowd, "cases": list(args.cases)},
           "results": results, "goals": goals}
    path = write_json(out, doc)
    print(table([[k, v] for k, v in results.items() if not isinstance(v, (list, dict))],
                ["figure", "value"]))
    print("CPU-seconds in the loaded phase: " + ", ".join(f"{k} {v}" for k, v in cpu.items()))
    for g in goals:
        print(f"{'MET ' if g['met'] else 'MISS'} {g['goal']}: {g['value']}")
    print(f"wrote {path}")
    return 0
