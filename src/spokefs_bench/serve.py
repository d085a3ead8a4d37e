"""``spokefs bench serve``: cached data from a spoke next to the same reads from the hub.

Both services run as real processes on 127.0.0.1; the readers are aiohttp clients in this
process. The spoke is warmed first (every block resident), so its figures are cache hits.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from spokefs.procs import Service, hub_args, running, spoke_args
from spokefs.units import parse_size
from spokefs_bench.common import machine, percentile, table, write_json

MiB = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="spoke cache hits vs hub reads on loopback",
                       description="Sequential 4 MiB reads (1 and 8 readers) and random 128 KiB "
                       "reads from a warm spoke and from the hub, in one run.")
    p.add_argument("--out", required=True, type=Path, help="folder for results.json")
    p.add_argument("--files", type=int, default=8, help="files in the dataset (default 8)")
    p.add_argument("--file-size", type=parse_size, default=64 * MiB,
                   help="size of each file (default 64MiB)")
    p.add_argument("--seconds", type=float, default=4.0, help="time per sequential case")
    p.add_argument("--random-reads", type=int, default=400, help="random reads per case")
    p.add_argument("--tokens", action="store_true",
                   help="also measure the spoke with --auth (every request presents a token): "
                   "what checking a token per request costs")
    p.set_defaults(func=_run)


_HEADERS: dict[str, str] = {}  # sent with every request (a token, for the --auth run)


async def _files(session: aiohttp.ClientSession, base: str) -> list[tuple[str, int]]:
    async with session.get(f"{base}/v1/datasets/bench/snapshots/latest/manifest") as r:
        from spokefs.manifest import Manifest
        m = Manifest.decode(await r.read())
    return [(f"{base}/v1/datasets/bench/objects/{e.version}", e.size) for e in m.entries()]


async def _get(session: aiohttp.ClientSession, url: str, start: int, end: int) -> int:
    async with session.get(url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
        if r.status != 206:
            raise RuntimeError(f"{url}: HTTP {r.status}")
        n = 0
        async for chunk in r.content.iter_chunked(1 << 20):
            n += len(chunk)
        return n


async def _seq(base: str, readers: int, seconds: float) -> dict[str, Any]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=readers),
                                     headers=_HEADERS) as s:
        files = await _files(s, base)
        total = 0
        lat: list[float] = []
        end = time.perf_counter() + seconds

        async def reader(k: int) -> None:
            nonlocal total
            i = k
            while time.perf_counter() < end:
                url, size = files[i % len(files)]
                for off in range(0, size, 4 * MiB):
                    t0 = time.perf_counter()
                    n = await _get(s, url, off, min(size, off + 4 * MiB))
                    total += n  # not `total += await ...`: that loses concurrent updates
                    lat.append(time.perf_counter() - t0)
                    if time.perf_counter() >= end:
                        break
                i += readers

        t0 = time.perf_counter()
        await asyncio.gather(*(reader(k) for k in range(readers)))
        dt = time.perf_counter() - t0
    return {"GBps": total / dt / 1e9, "p50_ms": 1000 * percentile(lat, 50),
            "p99_ms": 1000 * percentile(lat, 99), "bytes": total}


async def _rand(base: str, n: int, seed: int = 7) -> dict[str, Any]:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                     headers=_HEADERS) as s:
        files = await _files(s, base)
        lat = []
        for _ in range(n):
            url, size = rng.choice(files)
            off = rng.randrange(0, max(1, size - 128 * 1024))
            t0 = time.perf_counter()
            await _get(s, url, off, off + 128 * 1024)
            lat.append(time.perf_counter() - t0)
    return {"p50_ms": 1000 * percentile(lat, 50), "p99_ms": 1000 * percentile(lat, 99),
            "mean_ms": 1000 * sum(lat) / len(lat)}


async def _measure(base: str, args: argparse.Namespace) -> dict[str, Any]:
    c1 = await _seq(base, 1, args.seconds)
    c8 = await _seq(base, 8, args.seconds)
    r = await _rand(base, args.random_reads)
    return {"seq_4MiB_c1_GBps": c1["GBps"], "seq_4MiB_c8_GBps": c8["GBps"],
            "seq_4MiB_c1_p99_ms": c1["p99_ms"], "seq_4MiB_c8_p99_ms": c8["p99_ms"],
            "rand_128KiB_c1_p50_ms": r["p50_ms"], "rand_128KiB_c1_p99_ms": r["p99_ms"]}


def _run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="spokefs-bench-serve-") as tmp:
        root = Path(tmp)
        data = root / "bench"
        data.mkdir()
        rng = random.Random(1)
        for i in range(args.files):
            (data / f"file{i:03d}.bin").write_bytes(rng.randbytes(args.file_size))
        hub = Service(hub_args(data, root / "hubstate"))
        with running(hub):
            spoke = Service(spoke_args(hub.url, root / "cache",
                                       str(args.files * args.file_size * 2)))
            with running(spoke):
                asyncio.run(_warm(spoke.url))
                results = {"hub": asyncio.run(_measure(hub.url, args)),
                           "spoke": asyncio.run(_measure(spoke.url, args))}
            if args.tokens:  # the same warm cache, now behind tokens
                token = "bench-" + "t" * 32
                (root / "tokens").write_text(f"bench read {token}\n")
                authed = Service([*spoke_args(hub.url, root / "cache",
                                              str(args.files * args.file_size * 2)),
                                  "--auth", str(root / "tokens")])
                with running(authed):
                    _HEADERS["Authorization"] = f"Bearer {token}"
                    try:
                        results["spoke_auth"] = asyncio.run(_measure(authed.url, args))
                    finally:
                        _HEADERS.clear()
    h, s = results["hub"], results["spoke"]
    goals = {"spoke_seq_4MiB_c8_GBps>=1.0": s["seq_4MiB_c8_GBps"] >= 1.0,
             "spoke_vs_hub_c8>=0.9": s["seq_4MiB_c8_GBps"] >= 0.9 * h["seq_4MiB_c8_GBps"],
             "spoke_rand_128KiB_c1_p99_ms<=3": s["rand_128KiB_c1_p99_ms"] <= 3.0}
    doc = {"params": {"files": args.files, "file_size": args.file_size,
                      "seconds": args.seconds, "random_reads": args.random_reads,
                      "machine": machine()},
           **results, "spoke_vs_hub": {k: s[k] / h[k] for k in s if h[k]}, "goals": goals}
    path = write_json(args.out, doc)
    keys = list(h)
    a = results.get("spoke_auth")
    if a is not None:
        doc["auth_vs_spoke"] = {k: a[k] / s[k] for k in s if s[k]}
        write_json(args.out, doc)
        print(table([[k, h[k], s[k], a[k], a[k] / s[k] if s[k] else float("nan")]
                     for k in keys], ["figure", "hub", "spoke", "spoke+tokens", "tokens/plain"]))
    else:
        print(table([[k, h[k], s[k], s[k] / h[k] if h[k] else float("nan")] for k in keys],
                    ["figure", "hub", "spoke", "spoke/hub"]))
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in goals.items()))
    print(f"wrote {path}")
    return 0


async def _warm(base: str) -> None:
    async with aiohttp.ClientSession(headers=_HEADERS) as s:
        for url, size in await _files(s, base):
            await _get(s, url, 0, size)
