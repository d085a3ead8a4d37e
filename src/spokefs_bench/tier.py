"""``spokefs bench tier``: 1, 2 and 3 spokes sharing one cache behind one emulated WAN.

One hub, one ``spokefs wan`` in front of it, and for each count N a fresh tier of N spokes
(``--tier`` of each other, loopback ports, empty caches). Every spoke is a node: its readers
(threads here, each its own connection) read the whole dataset through it, in an order of
their own, all nodes at once, as data-parallel jobs on N nodes that each scan the dataset do.
A cold epoch, then a warm one. Each member keeps copies of the blocks it got from others
while its disk has room (``--tier-copies``); ``--no-copies`` measures the hop to the owner
that every such read takes once disks are full. Measured: the bytes the WAN carried during
the cold epoch over the dataset's size (the goal: <= 1.02 whatever N: one regional copy),
and each epoch's time per node (the slowest node is reported; the goal: warm epochs through
any member within 1.5x of a single spoke's). Then each node reads a warm epoch alone, the
others serving it: on one machine that is the fair "node on its own machine" figure (all
nodes at once share these cores, so their readers slow each other down whatever the tier
does). Every file read is checked against the source's digest.

This measures the tier's mechanics on one machine: the members, the hub, the link and the
readers share its cores, so the times say how the tier's extra hop costs on loopback, not
what N machines would reach.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from spokefs.errors import ConfigError
from spokefs.units import parse_duration, parse_rate, parse_size
from spokefs_bench.common import free_port, have_matplotlib, machine, table, write_json

MIB = 1 << 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tier", help="1, 2, 3 spokes sharing one cache: WAN bytes, epoch times",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where to write results.json (and tier.png)")
    p.add_argument("--quick", action="store_true",
                   help="a small dataset and link, about a minute (a check that it runs)")
    p.add_argument("--counts", default="1,2,3", metavar="N,N,...",
                   help="tier sizes to run (default: 1,2,3)")
    p.add_argument("--files", type=int, default=None, help="files in the dataset "
                   "(default 1200; --quick: 120)")
    p.add_argument("--file-size", type=parse_size, default=None, metavar="SIZE",
                   help="size of each file (default 512KiB; --quick: 128KiB)")
    p.add_argument("--readers", type=int, default=4, help="readers per node (default 4)")
    p.add_argument("--rtt", type=parse_duration, default=0.06, metavar="DURATION",
                   help="the WAN's round trip (default 60ms)")
    p.add_argument("--bandwidth", type=parse_rate, default=None, metavar="RATE",
                   help="the WAN's bandwidth (default 200MB/s; --quick: 100MB/s)")
    p.add_argument("--cache-size", type=parse_size, default=4 << 30, metavar="SIZE",
                   help="each spoke's --cache-size (default 4GiB: room for the dataset, so "
                   "members keep copies of the blocks others own)")
    p.add_argument("--no-copies", action="store_true",
                   help="spokes run with --no-tier-copies: every read of a block another "
                   "member owns is a hop to it (the tier's path when disks are full)")
    p.add_argument("--workers", type=int, default=1,
                   help="--workers of each spoke (default 1: the machine is shared)")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="where datasets and caches go (default: a temporary folder)")
    p.set_defaults(func=run)


def _params(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    try:
        counts = [int(c) for c in args.counts.split(",") if c.strip()]
    except ValueError as exc:
        raise ConfigError(f"--counts takes numbers, not {args.counts!r}") from exc
    if not counts or min(counts) < 1:
        raise ConfigError("--counts needs tier sizes of at least 1")
    return {"counts": counts,
            "files": args.files or (120 if quick else 1200),
            "file_size": args.file_size or ((128 if quick else 512) * 1024),
            "readers": args.readers, "rtt_s": args.rtt,
            "bandwidth": args.bandwidth or (100e6 if quick else 200e6),
            "workers": args.workers, "quick": quick, "cache_size": args.cache_size,
            "copies": not args.no_copies}


def run(args: argparse.Namespace) -> int:
    p = _params(args)
    with _work_dir(args.work_dir) as work:
        doc = _bench(p, work)
    path = write_json(args.out, doc)
    rows = [[r["spokes"], f"{r['wan_bytes_ratio']:.4f}", r["cold_epoch_s"], r["warm_epoch_s"],
             r["warm_alone_epoch_s"], r["wrong_files"]] for r in doc["results"]]
    print(table(rows, ["spokes", "WAN bytes / dataset", "cold epoch s (slowest node)",
                       "warm epoch s (slowest node)", "warm, a node alone", "wrong files"]))
    if have_matplotlib():
        print(f"wrote {_plot(doc, args.out)}")
    print(f"wrote {path}")
    return 0 if all(r["wrong_files"] == 0 for r in doc["results"]) else 1


@contextlib.contextmanager
def _work_dir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    d = Path(tempfile.mkdtemp(prefix="spokefs-bench-tier-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _make_dataset(root: Path, files: int, size: int) -> dict[str, bytes]:
    """Files of random bytes in a few folders; their digests, by path."""
    rng = random.Random(7)
    digests: dict[str, bytes] = {}
    for i in range(files):
        rel = f"part{i % 8}/sample{i:06d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(size)
        path.write_bytes(data)
        digests[rel] = xxhash.xxh3_128_digest(data)
    return digests


def _wan(control: str, method: str, path: str) -> dict[str, Any]:
    req = urllib.request.Request(control.rstrip("/") + path, method=method,
                                 data=b"{}" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _epoch(urls: list[str], digests: dict[str, bytes], readers: int
           ) -> tuple[list[float], int]:
    """Every node reads the whole dataset (its readers split it, in an order of the node's
    own), all nodes at once; (seconds per node, files whose bytes were wrong or missing)."""
    import urllib3

    paths = sorted(digests)
    wrong = [0]
    lock = threading.Lock()
    times: list[float] = [0.0] * len(urls)
    start = threading.Barrier(len(urls) * readers + 1)

    def reader(node: int, mine: list[str], done: list[float]) -> None:
        pool = urllib3.PoolManager(retries=False, maxsize=1, timeout=120)
        start.wait()
        bad = 0
        for rel in mine:
            try:
                r = pool.request("GET", f"{urls[node]}/ds/{rel}")
                ok = r.status == 200 and xxhash.xxh3_128_digest(r.data) == digests[rel]
            except Exception:  # a failed read counts as a wrong file
                ok = False
            bad += not ok
        done.append(time.monotonic())
        with lock:
            wrong[0] += bad

    threads: list[threading.Thread] = []
    ends: list[list[float]] = [[] for _ in urls]
    for node in range(len(urls)):
        order = paths[:]
        random.Random(node).shuffle(order)
        for k in range(readers):
            t = threading.Thread(target=reader, args=(node, order[k::readers], ends[node]))
            t.start()
            threads.append(t)
    start.wait()
    began = time.monotonic()
    for t in threads:
        t.join()
    for node in range(len(urls)):
        times[node] = round(max(ends[node]) - began, 3)
    return times, wrong[0]


def _bench(p: dict[str, Any], work: Path) -> dict[str, Any]:
    from spokefs.procs import Service, hub_args, spoke_args

    data = work / "ds"
    if data.exists():
        shutil.rmtree(data)
    digests = _make_dataset(data, p["files"], p["file_size"])
    total = p["files"] * p["file_size"]
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        hub = Service(hub_args(data, work / "hubstate"))
        stack.enter_context(hub.start(timeout=600))
        wan = Service(["wan", "--upstream", hub.hostport, "--rtt", f"{p['rtt_s']}s",
                       "--bandwidth", f"{p['bandwidth']}B/s"])
        stack.enter_context(wan.start())
        for n in p["counts"]:
            ports = [free_port() for _ in range(n)]
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            spokes = []
            with contextlib.ExitStack() as tier:
                for i, port in enumerate(ports):
                    cache = work / f"cache-{n}-{i}"
                    shutil.rmtree(cache, ignore_errors=True)
                    extra = ["--workers", str(p["workers"])]
                    if n > 1:
                        extra += ["--tier", ",".join(urls)]
                        if not p["copies"]:
                            extra.append("--no-tier-copies")
                    s = Service(spoke_args(wan.url, cache, str(p["cache_size"]), port, *extra))
                    tier.enter_context(s.start())
                    spokes.append(s)
                _wan(wan.control, "POST", "/reset-counters")
                cold, wrong_cold = _epoch(urls, digests, p["readers"])
                wan_bytes = int(_wan(wan.control, "GET", "/status")["bytes_down"])
                warm, wrong_warm = _epoch(urls, digests, p["readers"])
                # Each node alone (the others serve, their readers idle): what a node on a
                # machine of its own would see, less the contention of N nodes' readers for
                # this machine's cores.
                alone, wrong_alone = [], 0
                for url in urls:
                    t, bad = _epoch([url], digests, p["readers"])
                    alone += t
                    wrong_alone += bad
                held = [_status(u) for u in urls]
            row = {"spokes": n, "wan_bytes_ratio": round(wan_bytes / total, 4),
                   "cold_epoch_s": max(cold), "warm_epoch_s": max(warm),
                   "warm_alone_epoch_s": max(alone),
                   "cold_epoch_s_per_node": cold, "warm_epoch_s_per_node": warm,
                   "warm_alone_epoch_s_per_node": alone,
                   "cached_bytes_per_node": [h["cache"]["data_bytes"] for h in held],
                   "copy_bytes_per_node": [(h["tier"] or {}).get("copy_bytes", 0)
                                           for h in held],
                   "wan_bytes": wan_bytes, "wrong_files": wrong_cold + wrong_warm + wrong_alone}
            results.append(row)
            print(f"{n} spoke(s): WAN {row['wan_bytes_ratio']}x the dataset, cold "
                  f"{row['cold_epoch_s']} s, warm {row['warm_epoch_s']} s (a node alone "
                  f"{row['warm_alone_epoch_s']} s)", flush=True)
    single = results[0] if results and results[0]["spokes"] == 1 else None
    base = single["warm_epoch_s"] if single else None
    base_alone = single["warm_alone_epoch_s"] if single else None
    return {"benchmark": "tier", "params": {**p, "dataset_bytes": total},
            "machine": machine(), "results": results,
            "goals": {"wan_bytes_ratio_max": 1.02, "warm_vs_single_max": 1.5,
                      "warm_vs_single": ([round(r["warm_epoch_s"] / base, 3) for r in results]
                                         if base else None),
                      "warm_alone_vs_single": (
                          [round(r["warm_alone_epoch_s"] / base_alone, 3) for r in results]
                          if base_alone else None)}}


def _plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt

    rows = doc["results"]
    ns = [r["spokes"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(ns))
    a1.bar(list(x), [r["wan_bytes_ratio"] for r in rows], color="#4477aa")
    a1.set_xticks(list(x), [str(n) for n in ns])
    a1.axhline(1.02, color="#cc3311", linestyle="--", label="goal: 1.02")
    a1.set_xlabel("spokes in the tier")
    a1.set_ylabel("WAN bytes / dataset (cold epoch, all nodes)")
    a1.legend()
    a2.bar([i - 0.27 for i in x], [r["cold_epoch_s"] for r in rows], 0.27, label="cold")
    a2.bar(list(x), [r["warm_epoch_s"] for r in rows], 0.27, label="warm, all nodes at once")
    a2.bar([i + 0.27 for i in x], [r["warm_alone_epoch_s"] for r in rows], 0.27,
           label="warm, a node alone")
    if rows and rows[0]["spokes"] == 1:  # the goal: within 1.5x of a single spoke's
        a2.axhline(1.5 * rows[0]["warm_alone_epoch_s"], color="#cc3311", linestyle="--",
                   label="goal: 1.5x one spoke's warm epoch")
    a2.set_xticks(list(x), [str(n) for n in ns])
    a2.set_xlabel("spokes in the tier")
    a2.set_ylabel("epoch seconds, slowest node")
    a2.legend()
    fig.suptitle("spokefs bench tier: each node reads the whole dataset")
    fig.tight_layout()
    path = out / "tier.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
