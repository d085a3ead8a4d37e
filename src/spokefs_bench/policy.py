"""``spokefs bench policy``: replay training read traces through the real planner and
eviction policies, in memory, and compare them with the offline optimum.

The model (no I/O, a simulated clock):

- The store holds blocks up to a hard capacity. A fetched block is admitted by evicting the
  policy's victims; when every resident block is pinned it is served without being kept.
- The link moves one block after another at ``--link`` bytes/s, and each fetch completes one
  ``--rtt`` after its bytes went out; fetches start when the planner emits them (its in-flight
  budget, twice the bandwidth-delay product, paces prefetches).
- One reader consumes reads in trace order, ``--compute`` seconds per sample. A read whose
  block is not resident when it arrives is *late*; it waits for the block (demand fetch, or
  the prefetch already on its way).

Figures per trace, cache size and configuration (all over the steady epochs, after the
first, cold one):

- ``hit``: 1 - fetched blocks / block reads: how much of what was read the link did not have
  to carry again. Prefetching cannot raise it (a prefetch is a fetch), so the offline optimum,
  Belady's MIN with perfect knowledge of the whole trace (and the choice not to keep a block),
  bounds it; under a fresh shuffle no policy gets much above cache/dataset.
- ``ready``: reads whose blocks were all resident when the reader asked: the goal.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spokefs.planner import (
    CapacityChanged,
    Event,
    Fetch,
    Manifest,
    ManifestAdded,
    OrderAnnounced,
    Planner,
    Read,
)
from spokefs.planner.interpreter import Interpreter
from spokefs.policy import BeladyPolicy, BlockKey, EvictionPolicy, make_policy
from spokefs.units import parse_duration, parse_rate, parse_size

MiB = 1 << 20
BLOCK = 4 * MiB
TRACES = ["fresh_shuffle", "sequential", "shard_shuffle", "multi_worker", "two_jobs"]
SIZES = [0.25, 0.5, 0.75, 1.0]


@dataclass(frozen=True)
class Config:
    name: str
    policy: str
    learn: bool = False
    order: bool = False


CONFIGS = [
    Config("lru", "lru"),
    Config("s3fifo", "s3fifo"),
    Config("belady-nohint", "belady"),
    Config("learn+lru", "lru", learn=True),
    Config("learn+s3fifo", "s3fifo", learn=True),
    Config("belady-order", "belady", order=True),
]


# -- traces ---------------------------------------------------------------------------------


@dataclass
class Trace:
    """Reads (job, file, offset, length, worker, epoch) over one manifest per job, plus the
    order each job would announce at the start of each epoch."""

    name: str
    manifests: list[Manifest]
    reads: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    # read index -> [(job, epoch, files, ranges)] announced just before that read
    orders: dict[int, list[tuple[int, int, list[int], list[tuple[int, int]] | None]]] = field(
        default_factory=dict
    )

    @property
    def dataset_bytes(self) -> int:
        return sum(m.total_bytes for m in self.manifests)

    def announce(self, job: int, epoch: int, files: list[int], ranges=None) -> None:
        self.orders.setdefault(len(self.reads), []).append((job, epoch, files, ranges))


def images(n: int, avg: int, rng: random.Random, tag: str = "") -> Manifest:
    """``n`` files of 0.5x-1.5x ``avg`` bytes in 20 class folders (each under a block)."""
    entries = [
        (
            f"train/c{j % 20:02d}/{tag}{j:06d}.jpg",
            f"{tag}v{j:06d}",
            int(avg * rng.uniform(0.5, 1.5)),
        )
        for j in range(n)
    ]
    return Manifest.from_entries(entries, BLOCK)


def make_trace(name: str, files: int, avg: int, epochs: int, seed: int = 1) -> Trace:
    rng = random.Random(seed)
    if name == "shard_shuffle":
        nshards = max(8, files * avg // (16 * MiB))
        m = Manifest.from_entries(
            [(f"shards/s{j:04d}.tar", f"sv{j:04d}", 16 * MiB) for j in range(nshards)], BLOCK
        )
        t = Trace(name, [m])
        for e in range(epochs):
            shards = rng.sample(range(nshards), nshards)
            chunks = [(s, off) for s in shards for off in range(0, 16 * MiB, MiB)]
            t.announce(0, e, [s for s, _ in chunks], [(off, MiB) for _, off in chunks])
            t.reads += [(0, s, off, MiB, 0, e) for s, off in chunks]
        return t
    if name == "two_jobs":
        ms = [images(files // 2, avg, rng, tag) for tag in ("a", "b")]
        t = Trace(name, ms)
        for e in range(epochs):
            perms = [rng.sample(range(len(m)), len(m)) for m in ms]
            for job, perm in enumerate(perms):
                t.announce(job, e, perm)
            for pair in zip(*perms, strict=True):
                t.reads += [(job, i, 0, ms[job].sizes[i], job, e) for job, i in enumerate(pair)]
        return t
    m = images(files, avg, rng)
    t = Trace(name, [m])
    for e in range(epochs):
        perm = list(range(files)) if name == "sequential" else rng.sample(range(files), files)
        t.announce(0, e, perm)
        if name == "multi_worker":
            t.reads += _interleave(perm, m, e, rng, workers=4, batch=8)
        else:
            t.reads += [(0, i, 0, m.sizes[i], 0, e) for i in perm]
    return t


def _interleave(perm: list[int], m: Manifest, epoch: int, rng: random.Random, workers: int,
                batch: int) -> list[tuple[int, int, int, int, int, int]]:  # fmt: skip
    """DataLoader style: batch k goes to worker k % workers; workers run at the same pace,
    staggered by batch/workers samples, with a little jitter; reads merge by time."""
    timed = []
    for k in range(0, len(perm), batch):
        w = (k // batch) % workers
        start = (k // batch // workers) * batch + w * batch / workers
        for j, i in enumerate(perm[k : k + batch]):
            timed.append((start + j + rng.uniform(0, 0.9), w, i))
    timed.sort()
    return [(0, i, 0, m.sizes[i], w, epoch) for _, w, i in timed]


def block_reads(trace: Trace) -> list[tuple[BlockKey, int, int]]:
    """(key, size, epoch) for each block a read touches first (a worker's next read inside
    the same block is not another block read)."""
    out = []
    last: dict[int, tuple[int, int, int]] = {}
    for job, fi, off, length, worker, epoch in trace.reads:
        m = trace.manifests[job]
        for b in m.blocks_of(fi, off, length):
            if last.get(worker) == (job, fi, b):
                continue
            last[worker] = (job, fi, b)
            out.append((m.key(fi, b), m.block_bytes(fi, b), epoch))
    return out


# -- the offline optimum ----------------------------------------------------------------------


def optimum(trace: Trace, capacity: int) -> dict[str, float]:
    """Belady's MIN with perfect knowledge (and bypass) over the trace's block reads."""
    seq = block_reads(trace)
    p = BeladyPolicy(window=1)
    p.set_future([k for k, _, _ in seq])
    used = 0
    reads = [0, 0]
    misses = [0, 0]
    for pos, (key, size, epoch) in enumerate(seq):
        steady = int(epoch > 0)
        reads[steady] += 1
        p.advance(pos)
        if key in p:
            p.access(key)
            continue
        misses[steady] += 1
        p.access(key)  # consume this use: what is left is the block's next use
        mine = p.next_use(key)
        evict: list[BlockKey] = []
        room = capacity - used
        for victim in _victims(p):
            if room >= size:
                break
            if p.next_use(victim) <= mine:
                break  # keeping what is there beats keeping this block
            evict.append(victim)
            room += p._sizes[victim]
        if room < size:
            continue  # bypass: served, not kept
        for victim in evict:
            used -= p._sizes[victim]
            p.remove(victim)
        p.insert(key, size)
        used += size
    return {
        "hit": 1 - misses[1] / max(1, reads[1]),
        "hit_all": 1 - sum(misses) / max(1, sum(reads)),
    }


def _victims(p: BeladyPolicy) -> Iterable[BlockKey]:
    """The policy's victims, farthest next use first, without evicting them."""
    stamp = p._stamp
    for _, s, key in sorted(p._heap):
        if stamp.get(key) == s:
            yield key


# -- the simulation ---------------------------------------------------------------------------


@dataclass
class Link:
    rate: float  # bytes/s
    rtt: float  # s
    free: float = 0.0  # when the link's bandwidth is next free

    def send(self, now: float, size: int) -> float:
        start = max(now, self.free)
        self.free = start + size / self.rate
        return self.free + self.rtt


class PolicyCache:
    """The simulated store as the interpreter sees it: the eviction policy's residency and
    pins, and its future when it is ``belady``."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def pin(self, key: BlockKey) -> None:
        self.policy.pin(key)

    def unpin(self, key: BlockKey) -> None:
        self.policy.unpin(key)

    def set_future(self, keys: Sequence[BlockKey], stream: str, append: bool = False) -> None:
        p = self.policy
        if isinstance(p, BeladyPolicy):
            (p.extend_future if append else p.set_future)(list(keys), stream)


class Sim:
    """One configuration on one trace at one capacity."""

    def __init__(
        self, trace: Trace, cfg: Config, capacity: int, link: Link, compute: float,
        lookahead: int = 16 * MiB,
    ) -> None:  # fmt: skip
        self.trace, self.cfg, self.capacity, self.link = trace, cfg, capacity, link
        self.compute = compute
        opts: dict[str, Any] = {"capacity": capacity} if cfg.policy == "s3fifo" else {}
        if cfg.policy == "belady":
            opts["window"] = 256
        self.policy: EvictionPolicy = make_policy(cfg.policy, **opts)
        bdp = int(link.rate * link.rtt)
        self.planner = Planner(
            capacity=capacity, resident=self.policy, block_size=BLOCK,
            max_inflight_bytes=max(2 * bdp, BLOCK), readahead_max_bytes=max(bdp, BLOCK),
            lookahead_bytes=lookahead, learn=cfg.learn, disorder_window=512,
        )  # fmt: skip
        # The spoke's own action interpreter (spoke/prefetch.py runs it too); cancelled
        # fetches complete anyway, the planner hears FetchDone.
        self.t = 0.0  # the clock of what is being handled
        self._soon: list[Callable[[], None]] = []
        self.interp = Interpreter(self.planner, PolicyCache(self.policy), self._fetch,
                                  lambda key: False, self._soon.append, lambda: self.t)
        for j, m in enumerate(trace.manifests):
            self.handle(ManifestAdded(f"d{j}", m))
        self.used = 0
        self.now = 0.0
        self.done: list[tuple[float, int, BlockKey, int]] = []  # completion heap
        self.due: dict[BlockKey, float] = {}
        self.seq = 0
        self.steady = False
        self.fetched = [0, 0]
        self.wasted = 0

    def handle(self, event: Event, now: float = 0.0) -> None:
        self.t = now
        self.interp.handle(event)
        self._drain()

    def _drain(self) -> None:
        while self._soon:  # answers the interpreter deferred (none, as the spoke runs it)
            self._soon.pop(0)()

    def _fetch(self, dataset: str, a: Fetch) -> None:
        if a.key in self.due:
            return  # a priority bump: the link model has no queue to reorder
        self.due[a.key] = at = self.link.send(self.t, a.size)
        self.seq += 1
        heapq.heappush(self.done, (at, self.seq, a.key, a.size))
        self.fetched[self.steady] += 1

    def deliver(self, until: float) -> None:
        while self.done and self.done[0][0] <= until:
            at, _, key, size = heapq.heappop(self.done)
            del self.due[key]
            ok = self.admit(key, size)
            self.t = at
            self.interp.finished(key, ok)
            self._drain()

    def admit(self, key: BlockKey, size: int) -> bool:
        p = self.policy
        if key in p:
            return True
        while self.used + size > self.capacity:
            victim = p.victim()
            if victim is None:
                return False
            self.used -= p._sizes[victim]  # type: ignore[attr-defined]
            p.remove(victim)
        p.insert(key, size)
        self.used += size
        return True

    def run(self) -> dict[str, float]:
        t = self.trace
        p = self.policy
        self.handle(CapacityChanged(self.capacity))
        reads = [0, 0]
        late = [0, 0]
        block_reads = [0, 0]
        last: dict[int, tuple[int, int, int]] = {}
        steady_from = max(
            next(n for n, r in enumerate(t.reads) if r[0] == j and r[5] > 0)
            for j in range(len(t.manifests))
        )
        for n, (job, fi, off, length, worker, _) in enumerate(t.reads):
            if n == steady_from:
                self.steady = True
            s = int(self.steady)
            self.deliver(self.now)
            if self.cfg.order:
                for j, e, files, ranges in t.orders.get(n, []):
                    ev = OrderAnnounced(f"d{j}", f"job{j}", e, files, ranges, now=self.now)
                    self.handle(ev, self.now)
            m = t.manifests[job]
            keys = [m.key(fi, b) for b in m.blocks_of(fi, off, length)]
            for b in m.blocks_of(fi, off, length):
                if last.get(worker) != (job, fi, b):
                    block_reads[s] += 1
                last[worker] = (job, fi, b)
            missing = [k for k in keys if k not in p]
            name = f"job{job}" if self.cfg.order else ""
            ev = Read(f"d{job}", m.paths[fi], m.versions[fi], m.sizes[fi], off, length,
                      reader_id=worker, job=name, now=self.now)  # fmt: skip
            self.handle(ev, self.now)
            reads[s] += 1
            if missing:
                late[s] += 1
                wait = max(self.due.get(k, self.now) for k in missing)
                self.deliver(wait)
                self.now = max(self.now, wait)
            for k in keys:
                p.access(k)
            self.now += self.compute
        return {
            "hit": 1 - self.fetched[1] / max(1, block_reads[1]),
            "ready": 1 - late[1] / max(1, reads[1]),
            "hit_all": 1 - sum(self.fetched) / max(1, sum(block_reads)),
            "ready_all": 1 - sum(late) / max(1, sum(reads)),
            "seconds": self.now,
        }


# -- the command ------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "policy", help="replay read traces through the planner and eviction policies",
        description="Simulate (in memory) training read traces through the real planner and "
        "eviction policies at several cache sizes; compare hit ratios with the offline "
        "optimum and count late reads under a link-bandwidth model.",
    )  # fmt: skip
    p.add_argument("--out", required=True, type=Path, help="folder for results.json")
    p.add_argument("--traces", default=",".join(TRACES), help=f"comma list of {TRACES}")
    p.add_argument(
        "--sizes",
        default=",".join(str(s) for s in SIZES),
        help="cache sizes as fractions of the dataset (default 0.25,0.5,0.75,1.0)",
    )
    p.add_argument(
        "--configs", default=",".join(c.name for c in CONFIGS), help="comma list of configurations"
    )
    p.add_argument("--files", type=int, default=1500, help="files per trace (default 1500)")
    p.add_argument("--file-size", type=parse_size, default=MiB, help="mean file size (1MiB)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per trace (default 3)")
    p.add_argument(
        "--link",
        type=parse_rate,
        default=parse_rate("250MB/s"),
        help="link bandwidth (default 250MB/s)",
    )
    p.add_argument("--rtt", type=parse_duration, default=0.02, help="round trip (20ms)")
    p.add_argument(
        "--compute", type=parse_duration, default=0.005, help="reader time per sample (default 5ms)"
    )
    p.add_argument(
        "--lookahead",
        type=parse_size,
        default=16 * MiB,
        help="announced-order lookahead (default 16MiB)",
    )
    p.add_argument("--procs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=_run)  # fmt: skip


def _one(job: tuple[str, float, str, dict[str, Any]]) -> dict[str, Any]:
    trace_name, frac, cfg_name, a = job
    trace = make_trace(trace_name, a["files"], a["file_size"], a["epochs"], a["seed"])
    capacity = int(trace.dataset_bytes * frac)
    if cfg_name == "optimum":
        r = optimum(trace, capacity)
        r.update(ready=float("nan"), ready_all=float("nan"))
    else:
        cfg = next(c for c in CONFIGS if c.name == cfg_name)
        link = Link(a["link"], a["rtt"])
        r = Sim(trace, cfg, capacity, link, a["compute"], a["lookahead"]).run()
    return {"trace": trace_name, "cache": frac, "config": cfg_name, **r}


def simulate(args: dict[str, Any], traces: list[str], sizes: list[float], configs: list[str],
             procs: int = 1) -> list[dict[str, Any]]:  # fmt: skip
    jobs = [(t, s, c, args) for t in traces for s in sizes for c in [*configs, "optimum"]]
    if procs <= 1:
        return [_one(j) for j in jobs]
    with ProcessPoolExecutor(procs) as pool:
        return list(pool.map(_one, jobs))


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row: the optimum next to it; goals on the figures the design asks for.

    ``vs_optimum`` compares whole runs (``hit_all``): every fetch counts exactly once there,
    where the steady figures can shift a prefetch issued late in the cold epoch."""
    opt = {(r["trace"], r["cache"]): r for r in rows if r["config"] == "optimum"}
    for r in rows:
        best = opt.get((r["trace"], r["cache"]))
        r["optimum_hit"] = best["hit"] if best else None
        r["optimum_hit_all"] = best["hit_all"] if best else None
        r["vs_optimum"] = r["hit_all"] / best["hit_all"] if best else float("nan")
    goals: dict[str, Any] = {}
    order = [r for r in rows if r["config"] == "belady-order"]
    if order:
        goals["order_min_vs_optimum"] = min(r["vs_optimum"] for r in order)
    fresh = [r for r in rows if r["trace"] == "fresh_shuffle" and r["config"] != "optimum"]
    for cfg in sorted({r["config"] for r in fresh}):
        mine = [r for r in fresh if r["config"] == cfg]
        goals[f"fresh_shuffle_{cfg}_min_hit_minus_cache"] = min(r["hit"] - r["cache"] for r in mine)
    return goals


def _run(a: argparse.Namespace) -> int:
    from spokefs_bench.common import machine, table, write_json

    args = {"files": a.files, "file_size": a.file_size, "epochs": a.epochs, "link": a.link,
            "rtt": a.rtt, "compute": a.compute, "seed": a.seed,
            "lookahead": a.lookahead}  # fmt: skip
    traces = [t for t in a.traces.split(",") if t]
    sizes = [float(s) for s in a.sizes.split(",") if s]
    configs = [c for c in a.configs.split(",") if c]
    unknown = [t for t in traces if t not in TRACES] + [
        c for c in configs if c not in {x.name for x in CONFIGS}
    ]
    if unknown:
        print(f"unknown trace or configuration: {', '.join(unknown)}")
        return 2
    t0 = time.perf_counter()
    rows = simulate(args, traces, sizes, configs, a.procs)
    goals = summarise(rows)
    elapsed = time.perf_counter() - t0
    doc = {
        "benchmark": "policy", "machine": machine(), "params": args, "seconds": elapsed,
        "configs": [c.__dict__ for c in CONFIGS if c.name in configs],
        "rows": rows, "goals": goals,
    }  # fmt: skip
    path = write_json(a.out, doc)
    header = ["trace", "cache", "config", "hit", "optimum", "ready", "hit(all)", "all/opt"]
    body = [
        [r["trace"], f"{r['cache']:.0%}", r["config"], r["hit"], r["optimum_hit"], r["ready"],
         r["hit_all"], r["vs_optimum"]]
        for r in rows if r["config"] != "optimum"
    ]  # fmt: skip
    print(table(body, header))
    print()
    for k, v in goals.items():
        print(f"{k}: {v:.3f}")
    print(f"\n{len(rows)} runs in {elapsed:.1f}s; wrote {path}")
    return 0
