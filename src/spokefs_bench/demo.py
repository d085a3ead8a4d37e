"""``spokefs demo``: the product in two minutes on a small built-in dataset.

Starts a hub, a 60 ms emulated link and a spoke as real processes on 127.0.0.1, reads the
whole dataset through the spoke twice (cold, then warm) next to reading the hub directly,
checks every byte against the source, and prints the comparison. Then runs the short
reference experiment (training loop, every scenario) where the benchmark is available.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spokefs.client.sync import Client
from spokefs.manifest import Manifest
from spokefs.procs import Service, hub_args, running, spoke_args
from spokefs_bench.common import table, write_json

MiB = 1024 * 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on a small dataset over a 60 ms link",
                       description="Build a small dataset, serve it from a hub behind an "
                       "emulated 60 ms link, read it through a spoke cold and warm, verify every "
                       "byte, then run the short training benchmark.")
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="output folder")
    p.add_argument("--rtt", default="60ms", help="link round-trip time (default 60ms)")
    p.add_argument("--bandwidth", default="400MB/s", help="link bandwidth (default 400MB/s)")
    p.add_argument("--readers", type=int, default=8, help="parallel readers (default 8)")
    p.add_argument("--skip-train", action="store_true", help="only the read-through part")
    p.set_defaults(func=run)


def build_dataset(root: Path) -> Path:
    data = root / "data" / "demo"
    if (data / ".complete").exists():
        return data
    rng = random.Random(42)
    for i in range(400):
        d = data / "images" / f"class{i % 8}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img{i:05d}.jpg").write_bytes(rng.randbytes(96 * 1024 + rng.randrange(64 * 1024)))
    (data / "shards").mkdir(parents=True, exist_ok=True)
    for i in range(4):
        (data / "shards" / f"train-{i:04d}.tar").write_bytes(rng.randbytes(16 * MiB))
    (data / ".complete").write_text("")  # hidden marker: the hub publishes it, harmlessly
    return data


def _wan_bytes(control: str) -> int:
    with urllib.request.urlopen(f"{control}/status", timeout=10) as r:
        s = json.load(r)
    return int(s["bytes_down"]) + int(s["bytes_up"])


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text,
                                                      re.MULTILINE))


def read_pass(base: str, m: Manifest, expected: dict[str, str], readers: int
              ) -> tuple[float, int, int]:
    """Read every file once with ``readers`` threads; (seconds, bytes, bytes wrong)."""
    client = Client(base)

    def one(i: int) -> tuple[int, int]:
        e = m.entry(i)
        data = client.read(m.dataset, e.version, 0, e.size) if e.size else b""
        ok = hashlib.blake2b(data, digest_size=16).hexdigest() == expected[e.path]
        return len(data), 0 if ok else len(data)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        results = list(pool.map(one, range(len(m))))
    return time.perf_counter() - t0, sum(r[0] for r in results), sum(r[1] for r in results)


def run(args: argparse.Namespace) -> int:
    out: Path = args.out.resolve()
    data = build_dataset(out)
    expected = {p.relative_to(data).as_posix(): hashlib.blake2b(p.read_bytes(), digest_size=16)
                .hexdigest() for p in data.rglob("*") if p.is_file()}
    work = out / "run"
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    size = sum((data / p).stat().st_size for p in expected)
    print(f"dataset: {len(expected)} files, {size / MiB:.0f} MiB in {data}")
    hub = Service(hub_args(data, work / "hubstate"), log_path=work / "hub.log")
    rows = []
    with running(hub):
        wan = Service(["wan", "--listen", "127.0.0.1:0", "--upstream", hub.hostport,
                       "--rtt", args.rtt, "--bandwidth", args.bandwidth],
                      log_path=work / "wan.log")
        with running(wan):
            spoke = Service(spoke_args(wan.url, work / "cache", "1GiB"),
                            log_path=work / "spoke.log")
            with running(spoke):
                m = Client(spoke.url).manifest("demo", "latest")
                cases = [("hub on this host (no link)", hub.url, False),
                         ("spoke, cold (over the link)", spoke.url, True),
                         ("spoke, warm", spoke.url, True)]
                for label, base, via_spoke in cases:
                    link0 = _wan_bytes(wan.control)
                    h0 = _metric(spoke.url, "spokefs_cache_hits_total")
                    m0 = _metric(spoke.url, "spokefs_cache_misses_total")
                    secs, nbytes, wrong = read_pass(base, m, expected, args.readers)
                    hits = _metric(spoke.url, "spokefs_cache_hits_total") - h0
                    misses = _metric(spoke.url, "spokefs_cache_misses_total") - m0
                    ratio = hits / (hits + misses) if via_spoke and hits + misses else None
                    rows.append({"pass": label, "seconds": secs, "MBps": nbytes / secs / 1e6,
                                 "hit_ratio": ratio, "link_MiB": (_wan_bytes(wan.control) - link0)
                                 / MiB, "bytes_verified": nbytes, "bytes_wrong": wrong})
    print()
    print(f"read-through, {args.readers} readers, link {args.rtt} / {args.bandwidth}:")
    print(table([[r["pass"], r["seconds"], r["MBps"], "-" if r["hit_ratio"] is None else
                  f"{r['hit_ratio']:.2f}", r["link_MiB"], r["bytes_wrong"]] for r in rows],
                ["pass", "time s", "MB/s", "hit ratio", "over link MiB", "bytes wrong"]))
    write_json(out, {"read_through": rows}, "read_through.json")
    if any(r["bytes_wrong"] for r in rows):
        print("ERROR: some bytes did not match the source")
        return 1
    if args.skip_train:
        return 0
    try:
        from spokefs_bench.training import run_seed
    except ImportError as exc:  # torch is an optional extra
        print(f"\n(the training benchmark needs the torch extra: {exc})")
        return 0
    print("\nthe reference experiment, short version (training loop, every scenario):")
    doc = run_seed(out / "seed", quick=True)
    wrong = sum(int(r.get("bytes_wrong", 0) or 0) for r in doc["results"].values())
    return 0 if wrong == 0 else 1  # run_seed printed the table and the figures' paths
