"""``spokefs bench native``: what the native core (``spokefs._native``) costs against the
Python it replaced, on one machine, in one process.

Checked reads: a block (``--block``, 4 MiB) in a segment file (page cache warm), read whole
(and in ``--small`` pieces: 128 KiB, a small file's read) and checked against its chunk
digests (``--chunk``, 64 KiB) again and again, by ``--threads`` threads at once (each its own
scratch buffer), with the Python loop the store used before (``os.preadv``, which releases
the GIL, then ``xxhash.xxh3_64_digest`` per chunk, which keeps it for 64 KiB or less, in a
loop that keeps it) and with ``cache.store.read_loc`` (one native call, without the GIL).
Block digests: xxh3-128 of ``--digest-sizes`` buffers with python-xxhash (what
``integrity`` uses) and with the native one (``_native.block_digest``).

Every figure is the process's own CPU-seconds (``getrusage``: every thread) and wall time for
the same work; CPU-s per GiB is what compares the two, wall time shows whether two threads
ran at once. A shared 2-core machine gives noisy walls: run it alone, several times.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from spokefs import _native
from spokefs.cache.segments import Segment
from spokefs.cache.store import chunk_digests, read_loc
from spokefs.units import parse_size
from spokefs_bench.common import machine, table, write_json

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass
class _Loc:
    seg: Segment
    offset: int
    size: int
    chunks: bytes


def python_read_loc(loc: _Loc, lo: int, hi: int, chunk: int,
                    scratch: bytearray | None = None) -> memoryview | None:
    """``cache.store.read_loc`` as it was before the native core (the reference)."""
    if hi <= lo:
        return memoryview(b"")
    a = lo - lo % chunk
    b = min(loc.size, hi + (-hi % chunk))
    if scratch is not None and len(scratch) >= b - a:
        buf = memoryview(scratch)[:b - a]
    else:
        buf = memoryview(bytearray(b - a))
    try:
        if loc.seg.read(loc.offset + a, buf) != b - a:
            return None
    except OSError:
        return None
    d, want = xxhash.xxh3_64_digest, loc.chunks
    for c in range(a // chunk, (b - 1) // chunk + 1):
        at = c * chunk - a
        if d(buf[at:at + chunk]) != want[8 * c:8 * c + 8]:
            return None
    return buf[lo - a:hi - a]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(threads: int, per_thread: int, work: Callable[[int, int], object]
           ) -> tuple[float, float]:
    """Wall and CPU seconds of ``threads`` threads, thread k calling ``work(k, i)`` for i in
    range(per_thread)."""
    start = threading.Barrier(threads + 1)

    def run(k: int) -> None:
        start.wait()
        for i in range(per_thread):
            work(k, i)

    ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    c0 = _cpu()
    start.wait()
    w0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - w0, _cpu() - c0


def _row(name: str, threads: int, nbytes: int, wall: float, cpu: float) -> dict[str, Any]:
    return {"what": name, "threads": threads, "bytes": nbytes, "wall_s": round(wall, 4),
            "cpu_s": round(cpu, 4), "cpu_s_per_gib": round(cpu / (nbytes / GiB), 3),
            "gb_per_s": round(nbytes / wall / 1e9, 2)}


def bench_reads(folder: Path, block: int, chunk: int, read: int, total: int,
                threads: list[int], rounds: int) -> list[dict[str, Any]]:
    """Checked reads of ``read`` bytes of a block (the whole block, or pieces of it starting
    at chunk boundaries), each thread into its own scratch buffer."""
    data = os.urandom(block)
    path = folder / "00000001.seg"
    path.write_bytes(bytes(8192) + data)
    fd = os.open(path, os.O_RDONLY)
    try:
        loc = _Loc(Segment(1, path, fd, 8192 + block), 8192, block, chunk_digests(data, chunk))
        impls: dict[str, Callable[..., memoryview | None]] = {
            "read_loc python loop": python_read_loc, "read_loc native": read_loc}
        for fn in impls.values():  # warm the page cache; both agree
            got = fn(loc, 0, block, chunk)  # type: ignore[arg-type]
            assert got is not None and bytes(got) == data
        read = min(read, block)
        step = max(chunk, read - read % chunk)
        starts = list(range(0, block - read + 1, step))
        label = (f"{read // KiB} KiB reads, {block // KiB} KiB block, "
                 f"{chunk // KiB} KiB chunks")
        reads = max(1, total // read)
        rows = []
        for _ in range(rounds):
            for name, fn in impls.items():
                for n in threads:
                    scratch = [bytearray(read + 2 * chunk) for _ in range(n)]

                    def work(k: int, i: int, fn: Callable[..., Any] = fn,
                             scratch: list[bytearray] = scratch) -> None:
                        lo = starts[i % len(starts)]
                        if fn(loc, lo, lo + read, chunk, scratch[k]) is None:
                            raise AssertionError("a checked read failed")

                    per = max(1, reads // n)
                    wall, cpu = _timed(n, per, work)
                    rows.append(_row(f"{name}: {label}", n, per * n * read, wall, cpu))
        return rows
    finally:
        os.close(fd)


def bench_digests(sizes: list[int], total: int, threads: list[int],
                  rounds: int) -> list[dict[str, Any]]:
    impls: dict[str, Callable[[bytes], bytes]] = {
        "xxh3-128 python-xxhash": xxhash.xxh3_128_digest,
        "xxh3-128 native": _native.block_digest}
    rows = []
    for _ in range(rounds):
        for size in sizes:
            data = os.urandom(size)
            assert len({fn(data) for fn in impls.values()}) == 1
            for name, fn in impls.items():
                for n in threads:
                    per = max(1, total // size // n)
                    wall, cpu = _timed(n, per, lambda k, i, fn=fn, data=data: fn(data))
                    rows.append(_row(f"{name}: {size // KiB} KiB", n, per * n * size, wall,
                                     cpu))
    return rows


def run(args: argparse.Namespace) -> int:
    threads = [int(t) for t in args.threads.split(",")]
    sizes = [args.block, *(parse_size(s) for s in args.small.split(",") if s)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="spokefs-bench-native-") as tmp:
        for size in sizes:
            rows += bench_reads(Path(tmp), args.block, args.chunk, size, args.bytes, threads,
                                args.rounds)
    rows += bench_digests([parse_size(s) for s in args.digest_sizes.split(",") if s],
                          args.bytes, threads, args.rounds)
    cols = ["what", "threads", "wall_s", "cpu_s", "cpu_s_per_gib", "gb_per_s"]
    print(table([[r[c] for c in cols] for r in rows], cols))
    path = write_json(args.out, {"benchmark": "native", "machine": machine(),
                                 "native_version": _native.__version__, "rows": rows})
    print(f"results: {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("native", help="the native core against the Python it replaced",
                       description="Checked reads of a cached block and block digests: the "
                       "Python loops against spokefs._native, 1 and 2 threads, CPU-seconds "
                       "per GiB and wall time (one process, page cache warm).")
    p.add_argument("--out", required=True, type=Path, help="folder for results.json")
    p.add_argument("--block", type=parse_size, default=4 * MiB, help="block size (4MiB)")
    p.add_argument("--chunk", type=parse_size, default=64 * KiB, help="chunk size (64KiB)")
    p.add_argument("--bytes", type=parse_size, default=1 * GiB,
                   help="bytes read or hashed per figure (1GiB)")
    p.add_argument("--small", default="128KiB",
                   help="sizes of smaller reads besides whole blocks, at chunk boundaries "
                   "(128KiB: a small file; '' for none)")
    p.add_argument("--threads", default="1,2", help="thread counts (1,2)")
    p.add_argument("--digest-sizes", default="4MiB,64KiB", help="block digest sizes")
    p.add_argument("--rounds", type=int, default=3, help="repeats of every figure (3)")
    p.set_defaults(func=run)
