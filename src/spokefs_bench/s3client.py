"""``spokefs bench s3client``: which S3 client fetches ranged GETs at the least CPU.

Many ranged GETs in flight (``--inflight``, default 64) of ``--ranges`` sizes against a bucket
in a moto server on loopback (``spokefs_bench.s3server``), one client at a time, each in a
fresh process (no warm state shared). moto is slower than any client (Python, one thread a
request), so wall time mostly measures moto; the figure that compares the clients is their
own CPU-seconds per GiB received (``resource.getrusage`` of the client's process: every
thread, a Rust runtime's included). moto's CPU is shown beside it.

Clients: ``obstore`` (Rust object_store), ``aiobotocore`` (asyncio botocore), ``boto3``
(threads). A client that is not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from spokefs.units import parse_size
from spokefs_bench.common import machine, table, write_json

MiB = 1 << 20
GiB = 1 << 30
BUCKET = "spokefs-bench"
CLIENTS = ["obstore", "aiobotocore", "boto3"]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    """CPU-seconds of another process so far (/proc/PID/stat utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _plan(objects: int, object_size: int, rng_size: int, gets: int, seed: int
          ) -> list[tuple[str, int, int]]:
    r = random.Random(seed)
    per = object_size // rng_size
    return [(f"data/obj-{r.randrange(objects):04d}", (k := r.randrange(per)) * rng_size,
             (k + 1) * rng_size) for _ in range(gets)]


async def _run_obstore(url: str, plan: list[tuple[str, int, int]], inflight: int) -> int:
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=url, allow_http=True, virtual_hosted_style_request=False)
    sem = asyncio.Semaphore(inflight)

    async def one(key: str, a: int, b: int) -> int:
        async with sem:
            buf = await obstore.get_range_async(store, key, start=a, end=b)
            return len(memoryview(buf))

    return sum(await asyncio.gather(*(one(*p) for p in plan)))


async def _run_aiobotocore(url: str, plan: list[tuple[str, int, int]], inflight: int) -> int:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    sem = asyncio.Semaphore(inflight)
    async with get_session().create_client(
            "s3", endpoint_url=url, config=AioConfig(max_pool_connections=inflight)) as client:
        async def one(key: str, a: int, b: int) -> int:
            async with sem:
                resp = await client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={a}-{b - 1}")
                async with resp["Body"] as body:
                    return len(await body.read())

        return sum(await asyncio.gather(*(one(*p) for p in plan)))


def _run_boto3(url: str, plan: list[tuple[str, int, int]], inflight: int) -> int:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=url, config=Config(max_pool_connections=inflight))

    def one(p: tuple[str, int, int]) -> int:
        key, a, b = p
        return len(client.get_object(Bucket=BUCKET, Key=key,
                                     Range=f"bytes={a}-{b - 1}")["Body"].read())

    with ThreadPoolExecutor(inflight) as pool:
        return sum(pool.map(one, plan))


def _measure(client: str, url: str, plan: list[tuple[str, int, int]], inflight: int,
             moto_pid: int) -> dict[str, Any]:
    """In a fresh process: import and warm the client (a few GETs), then time the plan."""
    warm = plan[:4]
    runner: Any
    if client == "boto3":
        def runner(p: list[tuple[str, int, int]]) -> int:
            return _run_boto3(url, p, inflight)
    else:
        fn = _run_obstore if client == "obstore" else _run_aiobotocore

        def runner(p: list[tuple[str, int, int]]) -> int:
            return asyncio.run(fn(url, p, inflight))
    runner(warm)
    c0, m0, t0 = _cpu(), _proc_cpu(moto_pid), time.monotonic()
    nbytes = runner(plan)
    wall, cpu, moto = time.monotonic() - t0, _cpu() - c0, _proc_cpu(moto_pid) - m0
    return {"client": client, "bytes": nbytes, "wall_s": wall, "cpu_s": cpu, "moto_cpu_s": moto,
            "mb_s": nbytes / wall / 1e6, "cpu_s_per_gib": cpu * GiB / nbytes}


def _available(client: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(client) is not None


def run(args: argparse.Namespace) -> int:
    import boto3

    from spokefs_bench.s3server import TEST_ENV, S3Server

    for k, v in TEST_ENV.items():
        os.environ.setdefault(k, v)
    clients = [c for c in args.clients.split(",") if c]
    missing = [c for c in clients if not _available(c)]
    for c in missing:
        print(f"skipping {c}: not installed (pip install {c})")
    clients = [c for c in clients if c not in missing]
    ranges = [parse_size(r) for r in args.ranges.split(",")]
    rows: list[dict[str, Any]] = []
    with S3Server() as s3:
        s3c = boto3.client("s3", endpoint_url=s3.url)
        s3c.create_bucket(Bucket=BUCKET)
        data = random.Random(0).randbytes(args.object_size)
        for i in range(args.objects):
            s3c.put_object(Bucket=BUCKET, Key=f"data/obj-{i:04d}", Body=data)
        ctx = get_context("spawn")
        for size in ranges:
            gets = max(args.inflight, args.bytes // size)
            plan = _plan(args.objects, args.object_size, size, gets, seed=size)
            for client in clients:
                with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                    row = pool.submit(_measure, client, s3.url, plan, args.inflight,
                                      s3.pid).result()
                row.update(range=size, gets=gets, inflight=args.inflight)
                rows.append(row)
                print(f"{client:12s} {size // MiB:3d} MiB x {gets}: {row['mb_s']:7.1f} MB/s, "
                      f"client {row['cpu_s_per_gib']:.3f} CPU-s/GiB, moto "
                      f"{row['moto_cpu_s'] * GiB / row['bytes']:.2f} CPU-s/GiB", flush=True)
    print(table([[r["client"], f"{r['range'] // MiB} MiB", r["gets"], f"{r['mb_s']:.0f}",
                  f"{r['cpu_s_per_gib']:.3f}", f"{r['moto_cpu_s'] * GiB / r['bytes']:.2f}"]
                 for r in rows],
                ["client", "range", "GETs", "MB/s", "client CPU-s/GiB", "moto CPU-s/GiB"]))
    path = write_json(args.out, {"benchmark": "s3client", "machine": machine(),
                                 "inflight": args.inflight, "objects": args.objects,
                                 "object_size": args.object_size, "rows": rows})
    print(f"wrote {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("s3client", help="compare S3 clients on concurrent ranged GETs",
                       description="Many ranged GETs in flight against a moto S3 server on "
                       "loopback, per client: MB/s and the client's CPU-seconds per GiB "
                       "(needs moto; clients not installed are skipped).")
    p.add_argument("--out", required=True, type=Path, help="folder for results.json")
    p.add_argument("--clients", default=",".join(CLIENTS), help=f"comma list of {CLIENTS}")
    p.add_argument("--ranges", default="1MiB,4MiB,8MiB",
                   help="range sizes (default 1MiB,4MiB,8MiB)")
    p.add_argument("--inflight", type=int, default=64, help="GETs in flight (default 64)")
    p.add_argument("--objects", type=int, default=8, help="objects in the bucket (default 8)")
    p.add_argument("--object-size", type=parse_size, default=16 * MiB,
                   help="size of each object (default 16MiB; moto reads a whole object to "
                   "answer a range, so larger ones slow it, not the clients)")
    p.add_argument("--bytes", type=parse_size, default=512 * MiB,
                   help="bytes fetched per client and range size (default 512MiB)")
    p.set_defaults(func=run)
