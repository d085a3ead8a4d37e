"""``spokefs bench checkpoint``: a sharded checkpoint saved near the compute, safe at the hub
soon after.

One hub with a writable dataset behind ``spokefs wan`` (60 ms, 200 MB/s by default), one
spoke in front of the link. W writer processes (8) each write one shard of a --size
checkpoint (2 GiB in all) and close it, as torch.distributed.checkpoint's ranks do; then
the coordinator writes ``.metadata`` and the folder is committed. The shards' bytes are made
before the clock starts. Saves, each timed from the writers' start until the save returns:

  local    to a local folder (each shard fsynced): the baseline
  spoke    to the spoke, ``spokefs://`` (``spokefs.client.writer``): returns once the spoke
           holds every byte durably and the commit is journalled there; then the time until
           the hub has published it (``wait_safe``), against the link's floor
           (bytes / bandwidth + RTT)
  hub      straight to the hub over the link: returns once published there
  crash    to the spoke, which is killed (-9) as soon as the save returns, started again:
           every byte written must be published at the hub (``lost_bytes``)

Figures (docs/benchmark.md, "Checkpoints"): ``save_block_ratio_local`` (spoke / local; goal
<= 1.1), ``safe_at_hub_ratio_floor`` (goal <= 1.1), ``save_hub_ratio_local``,
``lost_bytes`` (goal 0). CPU-seconds of every process (writers, spoke, wan, hub) per save.
Not measured yet, reported as null with why: ``restore_tier_ratio_local`` and
``resume_batches``. Writes DIR/results.json and DIR/checkpoint.png, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import queue
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spokefs.units import format_size, parse_duration, parse_rate, parse_size
from spokefs.wan.cli import _arg
from spokefs_bench.common import have_matplotlib, machine, table, write_json
from spokefs_bench.dataplane import tree_cpu

GOAL_BLOCK = 1.1   # a save to the spoke blocks at most this x the same save to local disk
GOAL_SAFE = 1.1    # safe at the hub within this x the link's floor
METADATA = ".metadata"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="a sharded checkpoint saved through a spoke: the "
                       "time it blocks, the time until safe at the hub, nothing lost",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--size", type=_arg(parse_size), default=2 << 30, metavar="SIZE",
                   help="the whole checkpoint (default 2GiB)")
    p.add_argument("--writers", type=int, default=8, help="writer processes (default 8)")
    p.add_argument("--rtt", type=_arg(parse_duration), default=0.06, metavar="DURATION",
                   help="the link's round trip (default 60ms)")
    p.add_argument("--bandwidth", type=_arg(parse_rate), default=200e6, metavar="RATE",
                   help="the link's bandwidth (default 200MB/s)")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="where the hub's folder, the spoke's cache and the local saves go "
                   "(default: a temporary folder, removed after)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.writers < 1 or args.size < args.writers:
        raise SystemExit("--writers must be at least 1 and --size at least one byte each")
    args.out.mkdir(parents=True, exist_ok=True)
    with _work(args.work_dir) as work:
        doc = _bench(args, work)
    write_json(args.out, doc)
    _print(doc)
    if have_matplotlib():
        _plot(doc, args.out / "checkpoint.png")
    return 0


@contextlib.contextmanager
def _work(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="spokefs-bench-ckpt-") as tmp:
        yield Path(tmp)


# -- the writers -----------------------------------------------------------------------------
def _shard(rank: int, size: int) -> bytes:
    """Rank ``rank``'s bytes (the same each run), made in pieces: ``randbytes`` takes at
    most 2**31 bits at once."""
    rng, piece = random.Random(1000 + rank), 64 << 20
    return b"".join(rng.randbytes(min(piece, size - at)) for at in range(0, size, piece))


def _writer(rank: int, size: int, target: str, staging: str, barrier: Any, out: Any) -> None:
    """One rank: its shard made, then (the clock running) written and closed at ``target``
    (a folder, or a ``spokefs://`` URL). Reports (rank, seconds, CPU-seconds)."""
    os.environ["SPOKEFS_STAGING"] = staging
    data = _shard(rank, size)
    barrier.wait()
    t0, c0 = time.monotonic(), _cpu()
    name = f"__{rank}_0.distcp"
    if target.startswith("spokefs://"):
        import fsspec

        with fsspec.filesystem("spokefs").open(f"{target}/{name}", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    else:
        Path(target).mkdir(parents=True, exist_ok=True)
        with open(Path(target) / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    out.put((rank, time.monotonic() - t0, _cpu() - c0))


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _save(target: str, writers: int, size: int, staging: Path) -> dict[str, Any]:
    """Every writer's shard, then the coordinator's ``.metadata``: the seconds until the save
    returned, and the writers' CPU-seconds."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(writers + 1), ctx.Queue()
    each = size // writers
    procs = [ctx.Process(target=_writer, args=(r, each, target, str(staging), barrier, out))
             for r in range(writers)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=600)  # every shard made
        t0 = time.monotonic()
        done = []
        while len(done) < writers:
            try:
                done.append(out.get(timeout=5))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise
    except (threading.BrokenBarrierError, queue.Empty):
        for p in procs:
            p.kill()
        codes = [p.exitcode for p in procs]
        raise SystemExit(f"a writer failed before its shard was written (exit codes "
                         f"{codes}; its traceback is above)") from None
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a writer failed (exit {p.exitcode})")
    meta = repr(sorted(done)).encode()
    if target.startswith("spokefs://"):
        import fsspec

        fs = fsspec.filesystem("spokefs", skip_instance_cache=True)
        with fs.open(f"{target}/{METADATA}.tmp", "wb") as f:
            f.write(meta)
        fs.mv(f"{target}/{METADATA}.tmp", f"{target}/{METADATA}")  # commits, as DCP's rename
    else:
        tmp = Path(target) / f"{METADATA}.tmp"
        tmp.write_bytes(meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.rename(Path(target) / METADATA)
    return {"seconds": round(time.monotonic() - t0, 3),
            "writer_cpu_s": round(sum(c for _, _, c in done), 3),
            "bytes": each * writers}


# -- the run ---------------------------------------------------------------------------------
def _bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from spokefs.checkpoint import wait_safe
    from spokefs.procs import Service, hub_args, spoke_args

    for d in ("ckpt", "hubstate", "cache", "local", "staging"):
        shutil.rmtree(work / d, ignore_errors=True)
    (work / "ckpt").mkdir()
    (work / "staging").mkdir()
    floor = args.size / args.bandwidth + args.rtt
    saves: dict[str, dict[str, Any]] = {}
    lost = 0
    with contextlib.ExitStack() as stack:
        hub = Service([*hub_args(work / "ckpt", work / "hubstate"), "--writable", "ckpt"])
        stack.enter_context(hub.start(timeout=600))
        wan = Service(["wan", "--upstream", hub.hostport, "--rtt", f"{args.rtt}s",
                       "--bandwidth", f"{args.bandwidth}B/s"])
        stack.enter_context(wan.start())
        spoke = Service(spoke_args(wan.url, work / "cache", "1GiB", 0))
        stack.enter_context(spoke.start())
        procs = {"hub": hub, "wan": wan, "spoke": spoke}

        def cpu() -> dict[str, float]:
            return {k: sum(tree_cpu(s.proc.pid)) if s.proc else 0.0 for k, s in procs.items()}

        def timed(name: str, target: str) -> dict[str, Any]:
            c0 = cpu()
            r = _save(target, args.writers, args.size, work / "staging")
            c1 = cpu()
            r["cpu_s"] = {k: round(c1[k] - c0[k], 3) for k in c0}
            saves[name] = r
            print(f"{name}: saved {format_size(r['bytes'])} in {r['seconds']:.2f}s",
                  flush=True)
            return r

        timed("local", str(work / "local" / "step-0"))
        host = spoke.hostport
        t0 = time.monotonic()
        timed("spoke", f"spokefs://{host}/ckpt/step-1")
        if not wait_safe(f"{spoke.url}/ckpt/step-1", timeout=3600):
            raise SystemExit("step-1 was not safe at the hub within an hour")
        saves["spoke"]["safe_s"] = round(time.monotonic() - t0, 3)
        timed("hub", f"spokefs://{wan.hostport}/ckpt/step-2")
        # The crash: the spoke killed as soon as the save returned, then started again.
        timed("crash", f"spokefs://{host}/ckpt/step-3")
        spoke.kill()
        spoke = Service(spoke_args(wan.url, work / "cache", "1GiB", spoke.port))
        stack.enter_context(spoke.start())
        procs["spoke"] = spoke
        if not wait_safe(f"{spoke.url}/ckpt/step-3", timeout=3600):
            raise SystemExit("step-3 was not safe at the hub within an hour of the restart")
        each = args.size // args.writers
        for r in range(args.writers):
            path = work / "ckpt" / "step-3" / f"__{r}_0.distcp"
            want = hashlib.sha256(_shard(r, each)).digest()
            got = hashlib.sha256(path.read_bytes()).digest() if path.exists() else b""
            lost += 0 if got == want else each
    local, via = saves["local"]["seconds"], saves["spoke"]
    return {
        "benchmark": "checkpoint", "machine": machine(),
        "params": {"size": args.size, "writers": args.writers, "rtt_s": args.rtt,
                   "bandwidth": args.bandwidth},
        "saves": saves, "floor_s": round(floor, 3),
        "save_block_ratio_local": round(via["seconds"] / local, 3),
        "safe_at_hub_ratio_floor": round(via["safe_s"] / floor, 3),
        "save_hub_ratio_local": round(saves["hub"]["seconds"] / local, 3),
        "lost_bytes": lost,
        "restore_tier_ratio_local": None, "resume_batches": None,
        "not_measured": {
            "restore_tier_ratio_local": "restore through a tier member: not in this cut",
            "resume_batches": "a job killed mid-epoch and restarted from its checkpoint: "
                              "not in this cut (the sampler's resume is tested in "
                              "tests/test_torch.py)"},
        "goals": {"save_block_ratio_local": GOAL_BLOCK, "safe_at_hub_ratio_floor": GOAL_SAFE,
                  "lost_bytes": 0},
    }


def _print(doc: dict[str, Any]) -> None:
    rows = []
    for name, r in doc["saves"].items():
        cpu = r["cpu_s"]
        rows.append([name, r["seconds"], r.get("safe_s", ""), r["writer_cpu_s"],
                     cpu["spoke"], cpu["wan"], cpu["hub"]])
    print(table(rows, ["save", "blocks s", "safe at hub s", "writers CPU-s", "spoke CPU-s",
                       "wan CPU-s", "hub CPU-s"]))
    print(f"save blocks {doc['save_block_ratio_local']}x the local save (goal <= {GOAL_BLOCK});"
          f" safe at the hub in {doc['safe_at_hub_ratio_floor']}x the link floor of "
          f"{doc['floor_s']}s (goal <= {GOAL_SAFE}); straight to the hub: "
          f"{doc['save_hub_ratio_local']}x; lost bytes after a kill -9: {doc['lost_bytes']}")


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["saves"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [doc["saves"][n]["seconds"] for n in names], label="save blocks")
    safe = doc["saves"]["spoke"].get("safe_s")
    if safe is not None:
        ax.bar(["spoke: safe"], [safe], color="tab:green", label="safe at the hub")
    ax.axhline(doc["floor_s"], color="grey", linestyle="--", label="link floor")
    ax.set_ylabel("seconds")
    ax.set_title(f"{format_size(doc['params']['size'])} checkpoint, "
                 f"{doc['params']['writers']} writers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
