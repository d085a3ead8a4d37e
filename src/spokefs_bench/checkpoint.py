"""``spokefs bench checkpoint``: a sharded checkpoint saved near the compute, safe at the hub
soon after, and restored on a fresh node.

One hub with a writable dataset behind ``spokefs wan`` (60 ms, 200 MB/s by default), one
spoke in front of the link (a member of a two-member tier whose other member starts later).
W writer processes (8) each write one shard of a --size checkpoint (2 GiB in all), fsync and
close it, as torch.distributed.checkpoint's ranks do; then the coordinator writes
``.metadata.tmp`` and renames it to ``.metadata``, which commits the folder. The shards'
bytes are made before the clock starts. Saves, each timed from the writers' start until the
save returns:

  local    to a local folder: the baseline
  mount    through ``spokefs mount URL/ckpt MP --writable`` on the spoke: each close returns
           once the spoke holds the shard durably, the rename commits; then the time until
           the hub has published it (``wait_safe``), against the link's floor
           (bytes / bandwidth + RTT). Without FUSE here: skipped, and ``fsspec`` stands in.
  fsspec   to the spoke through ``spokefs://`` (``spokefs.client.writer``), the same way
  hub      straight to the hub over the link (``spokefs://``): returns once published there
  crash    to the spoke (``spokefs://``), which is killed (-9) as soon as the save returns
           and started again: every byte written must be published at the hub
           (``lost_bytes``)

Restores of the mount's checkpoint on a fresh node, W readers each reading one shard whole,
every byte checked (the page cache of every copy dropped first):

  local    the local save, from local disk: the baseline
  tier     through a fresh spoke (an empty cache) that joins the writing spoke's tier: the
           writing spoke kept the checkpoint in its cache when the hub published it, and
           the new member takes it over the local network (the tier's handoff)
  hub      through a fresh spoke of its own, over the link

Figures (docs/benchmark.md, "Checkpoints"): ``save_block_ratio_local`` (mount / local; goal
<= 1.1), ``safe_at_hub_ratio_floor`` (goal <= 1.1), ``save_hub_ratio_local``,
``restore_tier_ratio_local`` (goal <= 1.3), ``restore_hub_ratio_local``, ``lost_bytes``
(goal 0) and ``restore_wrong_bytes`` (0). CPU-seconds of every process (writers, spoke,
wan, hub, mount, readers) per save and restore. Then the restart (``spokefs_bench.resume``):
a training job killed mid-epoch, restarted on a fresh node from its checkpoint's sampler
state: ``resume_batches`` (goal <= 3; null, with why, without PyTorch or with
--resume-samples 0). Writes DIR/results.json and DIR/checkpoint.png, and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
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

import urllib3
import xxhash

from spokefs.units import format_size, parse_duration, parse_rate, parse_size
from spokefs.wan.cli import _arg
from spokefs_bench.common import (
    free_port,
    have_matplotlib,
    machine,
    spokefs_mount,
    table,
    write_json,
)
from spokefs_bench.dataplane import tree_cpu

GOAL_BLOCK = 1.1   # a save to the spoke blocks at most this x the same save to local disk
GOAL_SAFE = 1.1    # safe at the hub within this x the link's floor
GOAL_RESTORE = 1.3  # a restore through a tier member within this x reading local disk
GOAL_RESUME = 3     # batches to full speed after a restart on a fresh node
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
    p.add_argument("--resume-samples", type=int, default=1600, metavar="N",
                   help="samples of the dataset the restart figure trains on (default 1600, "
                   "100 batches an epoch; 0: no restart figure)")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="where the hub's folder, the spoke's cache and the local saves go "
                   "(default: a temporary folder, removed after)")
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                   help="an argument for the writable mount, as --mount-arg=--write-"
                   "passthrough=off (repeat for more)")
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


def _disk_written() -> int:
    """Bytes written to this machine's block devices so far (``/sys/block/*/stat``: whole
    devices, not their partitions; loop and RAM disks left out): what a save costs the disk,
    page-cache flushes included."""
    total = 0
    for dev in Path("/sys/block").iterdir():
        if dev.name.startswith(("loop", "ram", "zram")):
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int((dev / "stat").read_text().split()[6]) * 512  # sectors written
    return total


def _save(target: str, writers: int, size: int, staging: Path) -> dict[str, Any]:
    """Every writer's shard, then the coordinator's ``.metadata``: the seconds until the save
    returned, the writers' CPU-seconds, and when its clock started (``started``, monotonic:
    once every shard was made)."""
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
            "bytes": each * writers, "started": t0}


# -- restores --------------------------------------------------------------------------------
def _uncache(root: Path) -> None:
    """Every file under ``root`` out of the page cache (written back first), so a restore
    reads disk as a fresh node would."""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _digest(rank: int, size: int) -> bytes:
    return xxhash.xxh3_128_digest(_shard(rank, size))


def _restore(where: str, names: list[str], want: list[bytes]) -> dict[str, Any]:
    """Every shard read whole by a thread of its own (a rank), from a folder or through a
    spoke (``http://...``), and checked: seconds, bytes, bytes read wrong, readers' CPU."""
    wrong = [0] * len(names)
    sizes = [0] * len(names)
    start = threading.Barrier(len(names) + 1)

    def one(i: int) -> None:
        h = xxhash.xxh3_128()
        start.wait()
        if where.startswith("http"):
            pool = urllib3.PoolManager(retries=False, maxsize=1, timeout=600)
            r = pool.request("GET", f"{where}/{names[i]}", preload_content=False)
            if r.status == 200:
                for piece in r.stream(4 << 20):
                    h.update(piece)
                    sizes[i] += len(piece)
            r.release_conn()
        else:
            with open(Path(where) / names[i], "rb", buffering=0) as f:
                while piece := f.read(4 << 20):
                    h.update(piece)
                    sizes[i] += len(piece)
        wrong[i] = 0 if h.digest() == want[i] else max(sizes[i], 1)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    c0 = _cpu()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    return {"seconds": round(time.monotonic() - t0, 3), "bytes": sum(sizes),
            "wrong_bytes": sum(wrong), "reader_cpu_s": round(_cpu() - c0, 3)}


def _wan_down(wan: Any) -> int:
    """Bytes the link carried towards the spokes so far."""
    r = urllib3.request("GET", f"{wan.control}/status", timeout=10)
    return int(json.loads(r.data)["bytes_down"])


# -- the mount -------------------------------------------------------------------------------
@contextlib.contextmanager
def _writable_mount(url: str, mp: Path, log: Path, *extra: str) -> Iterator[Path | None]:
    """``spokefs mount URL MP --writable EXTRA`` (None, with why printed, where FUSE is not
    usable here), unmounted after."""
    from spokefs.mount.process import fuse_unusable

    why = fuse_unusable(need_pyfuse3=False)
    if why is not None:
        print(f"mount: skipped ({why}); the spokefs:// save stands in", flush=True)
        yield None
        return
    with spokefs_mount(url, mp, log, "--writable", *extra):  # RuntimeError, saying why, if not
        yield mp


def _mount_pid(mp: Path) -> int | None:
    """The mount daemon's pid (its CPU counts), from the processes whose command names
    ``mp``."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                if b"mount" in cmd and str(mp).encode() in cmd and b"spokefs.cli" in cmd:
                    return int(d.name)
    return None


# -- the run ---------------------------------------------------------------------------------
def _bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from spokefs.checkpoint import wait_safe
    from spokefs.procs import Service, hub_args, spoke_args

    for d in ("ckpt", "hubstate", "cache", "cache-tier", "cache-hub", "local", "staging",
              "mnt", "logs"):
        shutil.rmtree(work / d, ignore_errors=True)
    for d in ("ckpt", "staging", "logs"):
        (work / d).mkdir()
    floor = args.size / args.bandwidth + args.rtt
    # Room for the two commits kept pinned (at most half the cache), and then some.
    cache_size = str(4 * args.size + (256 << 20))
    saves: dict[str, dict[str, Any]] = {}
    restores: dict[str, dict[str, Any]] = {}
    lost = 0
    each = args.size // args.writers
    names = [f"__{r}_0.distcp" for r in range(args.writers)]
    ports = [free_port(), free_port()]
    tier = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    from spokefs_bench import resume

    why_not = resume.unavailable() if args.resume_samples > 0 else "--resume-samples 0"
    data = resume.dataset(args.resume_samples) if why_not is None else None
    serve = ["--dataset", f"{data.spec.name}={data.root}"] if data is not None else []
    restart: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        hub = Service([*hub_args(work / "ckpt", work / "hubstate"), "--writable", "ckpt",
                       *serve])
        stack.enter_context(hub.start(timeout=600))
        wan = Service(["wan", "--upstream", hub.hostport, "--rtt", f"{args.rtt}s",
                       "--bandwidth", f"{args.bandwidth}B/s"])
        stack.enter_context(wan.start())

        def writing_spoke() -> Service:
            return Service(spoke_args(wan.url, work / "cache", cache_size, ports[0],
                                      "--tier", tier),
                           log_path=work / "logs" / "spoke.log")

        spoke = writing_spoke()
        stack.enter_context(spoke.start())
        procs: dict[str, Any] = {"hub": hub, "wan": wan, "spoke": spoke}
        mount_pid: list[int | None] = [None]

        def cpu() -> dict[str, float]:
            out = {k: sum(tree_cpu(s.proc.pid)) if s.proc else 0.0 for k, s in procs.items()}
            if mount_pid[0] is not None:
                out["mount"] = sum(tree_cpu(mount_pid[0]))
            return out

        def timed(name: str, target: str) -> dict[str, Any]:
            c0, d0 = cpu(), _disk_written()
            r = _save(target, args.writers, args.size, work / "staging")
            c1 = cpu()
            r["cpu_s"] = {k: round(c1[k] - c0.get(k, 0.0), 3) for k in c1}
            r["disk_written_bytes"] = _disk_written() - d0
            saves[name] = r
            print(f"save {name}: {format_size(r['bytes'])} in {r['seconds']:.2f}s", flush=True)
            return r

        def safe(name: str, step: str) -> None:
            # From the save's own start, as its "blocks" seconds: not from before the
            # writers made their shards (seconds of CPU that no real save spends).
            if not wait_safe(f"{spoke.url}/ckpt/{step}", timeout=3600):
                raise SystemExit(f"{step} was not safe at the hub within an hour")
            saves[name]["safe_s"] = round(time.monotonic() - saves[name]["started"], 3)

        timed("local", str(work / "local" / "step-0"))
        host = spoke.hostport
        restored = "step-1"  # the checkpoint the restores read: the mount's, else fsspec's
        with _writable_mount(f"{spoke.url}/ckpt", work / "mnt", work / "logs" / "mount.log",
                             *args.mount_arg) as mp:
            if mp is not None:
                mount_pid[0] = _mount_pid(mp)
                timed("mount", str(mp / "step-1"))
                safe("mount", "step-1")
                mount_pid[0] = None
            else:
                restored = "step-4"
        timed("fsspec", f"spokefs://{host}/ckpt/step-4")
        safe("fsspec", "step-4")
        timed("hub", f"spokefs://{wan.hostport}/ckpt/step-2")
        # The crash: the spoke killed as soon as the save returned, then started again.
        timed("crash", f"spokefs://{host}/ckpt/step-3")
        spoke.kill()
        spoke = writing_spoke()
        stack.enter_context(spoke.start())
        procs["spoke"] = spoke
        if not wait_safe(f"{spoke.url}/ckpt/step-3", timeout=3600):
            raise SystemExit("step-3 was not safe at the hub within an hour of the restart")
        for r, name in enumerate(names):
            path = work / "ckpt" / "step-3" / name
            want = hashlib.sha256(_shard(r, each)).digest()
            got = hashlib.sha256(path.read_bytes()).digest() if path.exists() else b""
            lost += 0 if got == want else each

        # Restores on a fresh node: every copy read from disk, not the page cache.
        want = [_digest(r, each) for r in range(args.writers)]
        fresh = {
            "tier": Service(spoke_args(wan.url, work / "cache-tier", cache_size, ports[1],
                                       "--tier", tier),
                            log_path=work / "logs" / "spoke-tier.log"),
            "hub": Service(spoke_args(wan.url, work / "cache-hub", cache_size, 0),
                           log_path=work / "logs" / "spoke-hub.log")}

        def restore(name: str, where: str, reader: Service | None) -> None:
            for d in ("local", "cache"):
                _uncache(work / d)
            if reader is not None:
                procs["fresh_spoke"] = reader
            c0, w0 = cpu(), _wan_down(wan)
            r = _restore(where, names, want)
            c1 = cpu()
            r["wan_bytes"] = _wan_down(wan) - w0  # what crossed the link for it
            procs.pop("fresh_spoke", None)
            r["cpu_s"] = {k: round(c1[k] - c0.get(k, 0.0), 3) for k in c1}
            restores[name] = r
            print(f"restore {name}: {format_size(r['bytes'])} in {r['seconds']:.2f}s, "
                  f"{r['wrong_bytes']} bytes wrong", flush=True)

        restore("local", str(work / "local" / "step-0"), None)
        for name, svc in fresh.items():
            stack.enter_context(svc.start())
            restore(name, f"{svc.url}/ckpt/{restored}", svc)
        if data is not None:
            from spokefs.client.sync import Client

            snap = Client(hub.url).resolve(data.spec.name, "latest")
            print("restart: a job killed mid-epoch, restarted on a fresh node", flush=True)
            restart = resume.measure(data, wan.url, snap, work, work / "logs")
    for r in saves.values():
        r.pop("started")  # a monotonic clock's reading: meaningless outside this process
    local, via = saves["local"]["seconds"], saves.get("mount") or saves["fsspec"]
    back = restores["local"]["seconds"]
    return {
        "benchmark": "checkpoint", "machine": machine(),
        "params": {"size": args.size, "writers": args.writers, "rtt_s": args.rtt,
                   "bandwidth": args.bandwidth, "mount_args": args.mount_arg},
        "saves": saves, "restores": restores, "restored": restored,
        "floor_s": round(floor, 3),
        "save_block_ratio_local": round(via["seconds"] / local, 3),
        "safe_at_hub_ratio_floor": round(via["safe_s"] / floor, 3),
        "save_hub_ratio_local": round(saves["hub"]["seconds"] / local, 3),
        "restore_tier_ratio_local": round(restores["tier"]["seconds"] / back, 3),
        "restore_hub_ratio_local": round(restores["hub"]["seconds"] / back, 3),
        "lost_bytes": lost,
        "restore_wrong_bytes": sum(r["wrong_bytes"] for r in restores.values()),
        "resume_batches": restart.get("resume_batches"), "restart": restart,
        "not_measured": {"resume_batches": why_not} if why_not else {},
        "goals": {"save_block_ratio_local": GOAL_BLOCK, "safe_at_hub_ratio_floor": GOAL_SAFE,
                  "restore_tier_ratio_local": GOAL_RESTORE, "resume_batches": GOAL_RESUME,
                  "lost_bytes": 0,
                  "restore_wrong_bytes": 0},
    }


def _print(doc: dict[str, Any]) -> None:
    rows = []
    for name, r in doc["saves"].items():
        cpu = r["cpu_s"]
        rows.append([name, r["seconds"], r.get("safe_s", ""),
                     format_size(r.get("disk_written_bytes", 0)), r["writer_cpu_s"],
                     cpu.get("mount", ""), cpu["spoke"], cpu["wan"], cpu["hub"]])
    print(table(rows, ["save", "blocks s", "safe at hub s", "disk written", "writers CPU-s",
                       "mount CPU-s", "spoke CPU-s", "wan CPU-s", "hub CPU-s"]))
    rows = []
    for name, r in doc["restores"].items():
        cpu = r["cpu_s"]
        rows.append([name, r["seconds"], format_size(r["wan_bytes"]), r["wrong_bytes"],
                     r["reader_cpu_s"], cpu.get("fresh_spoke", ""), cpu["spoke"], cpu["wan"],
                     cpu["hub"]])
    print(table(rows, ["restore", "seconds", "over the link", "wrong bytes", "readers CPU-s",
                       "fresh spoke CPU-s", "writing spoke CPU-s", "wan CPU-s", "hub CPU-s"]))
    print(f"save blocks {doc['save_block_ratio_local']}x the local save (goal <= {GOAL_BLOCK});"
          f" safe at the hub in {doc['safe_at_hub_ratio_floor']}x the link floor of "
          f"{doc['floor_s']}s (goal <= {GOAL_SAFE}); straight to the hub: "
          f"{doc['save_hub_ratio_local']}x; lost bytes after a kill -9: {doc['lost_bytes']}")
    print(f"restore on a fresh node through a tier member: {doc['restore_tier_ratio_local']}x "
          f"reading local disk (goal <= {GOAL_RESTORE}); through the hub: "
          f"{doc['restore_hub_ratio_local']}x; bytes read wrong: {doc['restore_wrong_bytes']}")
    r = doc["restart"]
    if r:
        print(f"a job killed at batch {r['killed_at_batch']} of {r['batches_per_epoch']} and "
              f"restarted on a fresh node: {r['resume_batches']} batches to full speed (goal "
              f"<= {GOAL_RESUME}; warmed up: {r['warmed_up']}); utilisation "
              f"{r['au_restarted']} against {r['au_local']} from local disk; the first "
              f"batches waited {r['first_waits_s']} s; wrong samples: {r['wrong_samples']}")
    else:
        print(f"restart figure: not measured ({doc['not_measured'].get('resume_batches')})")


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = list(doc["saves"])
    ax.bar(names, [doc["saves"][n]["seconds"] for n in names], label="save blocks")
    headline = "mount" if "mount" in doc["saves"] else "fsspec"
    safe = doc["saves"][headline].get("safe_s")
    if safe is not None:
        ax.bar([f"{headline}: safe"], [safe], color="tab:green", label="safe at the hub")
    ax.axhline(doc["floor_s"], color="grey", linestyle="--", label="link floor")
    ax.set_ylabel("seconds")
    ax.set_title(f"save: {format_size(doc['params']['size'])}, "
                 f"{doc['params']['writers']} writers")
    ax.legend()
    names = list(doc["restores"])
    bx.bar(names, [doc["restores"][n]["seconds"] for n in names], color="tab:purple")
    bx.set_title("restore on a fresh node")
    bx.set_ylabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
