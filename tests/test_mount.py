"""The FUSE mount, for real: hub and spoke processes, ``spokefs mount`` processes, POSIX reads.

Unit tests of the pieces (URL parsing, retry deadline, block coalescing, mountinfo parsing)
run anywhere; the rest need a usable /dev/fuse and are skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import mmap
import os
import random
import re
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from servers import ServerProcess, hub, make_dataset, metric, spoke
from spokefs.cache.inspect import blocks_on_disk
from spokefs.errors import ConfigError, ReadFailed, SpokeError, Transient
from spokefs.mount import sysfs
from spokefs.mount.coalesce import Coalescer
from spokefs.mount.process import MountError, MountProcess, fuse_unusable, unmount
from spokefs.mount.source import Target, retry_until

FUSE_REASON = fuse_unusable()
needs_fuse = pytest.mark.skipif(FUSE_REASON is not None, reason=f"no FUSE: {FUSE_REASON}")


# -- unit tests (no FUSE) ----------------------------------------------------------------------
def test_target_parse() -> None:
    t = Target.parse("http://127.0.0.1:8471/imagenet")
    assert (t.base, t.dataset, t.snapshot) == ("http://127.0.0.1:8471", "imagenet", "latest")
    t = Target.parse("https://hub:8470/ds@3fa9c1d20b7e/")
    assert (t.base, t.dataset, t.snapshot) == ("https://hub:8470", "ds", "3fa9c1d20b7e")
    # The rules of every other spokefs URL (parse_url): no scheme is http, the dataset is the
    # first segment. The mount's own parser took the last one, so "http://h/a/b" was
    # dataset b to the mount and dataset a (path b) to spokefs.open, status and warm.
    t = Target.parse("hub:8470/ds")
    assert (t.base, t.dataset) == ("http://hub:8470", "ds")
    # No dataset: the namespace (tests/test_namespace_mount.py).
    assert Target.parse("http://hub:8470/").namespace
    for bad in ("ftp://h/ds", "ftp://h/", "http://hub:8470/a/b"):
        with pytest.raises(ConfigError):
            Target.parse(bad)
    # A name the server would refuse fails here, not as a 400 from the upstream at mount.
    for bad in ("http://hub:8470/my%20ds", "http://hub:8470/ds@../x", "http://h/ds@a@b"):
        with pytest.raises(SpokeError):
            Target.parse(bad)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


async def test_retry_until_gives_up_at_the_deadline_then_recovers() -> None:
    clock = FakeClock()
    calls = 0

    async def down() -> bytes:
        nonlocal calls
        calls += 1
        raise Transient("connection refused")

    with pytest.raises(ReadFailed, match=r"unavailable for 2s \(connection refused\)"):
        await retry_until(2.0, "block 0", down, now=clock.time, sleep=clock.sleep)
    assert calls > 3 and clock.now <= 2.0 and max(clock.slept) <= 0.5

    async def up() -> bytes:
        return b"ok"

    assert await retry_until(2.0, "block 0", up, now=clock.time, sleep=clock.sleep) == b"ok"


# Real time: an attempt is bounded by asyncio.timeout on the event loop's clock, which
# retry_until's ``now`` does not replace.
@pytest.mark.timing
async def test_retry_until_bounds_a_hung_attempt() -> None:
    async def hang() -> bytes:
        await asyncio.sleep(60)
        return b""

    t0 = time.monotonic()
    with pytest.raises(ReadFailed, match=r"no answer within 0\.2s"):
        await retry_until(0.2, "block 0", hang)
    elapsed = time.monotonic() - t0
    assert 0.19 <= elapsed < 5.0, elapsed  # not cut short; far from the 60 s hang


class FakeUpstream:
    """fetch_into over an in-memory object, counting requests."""

    def __init__(self, data: bytes, fail: bool = False) -> None:
        self.data = data
        self.calls: list[tuple[int, int]] = []
        self.fail = fail

    async def fetch_into(self, version: str, start: int, buf: memoryview) -> int:
        self.calls.append((start, start + len(buf)))
        await asyncio.sleep(0)
        if self.fail:
            raise ReadFailed("upstream down")
        chunk = self.data[start:start + len(buf)]
        buf[:len(chunk)] = chunk
        return len(chunk)


async def test_coalescer_streams_whole_blocks_and_random_reads_exact() -> None:
    bs = 64 * 1024
    data = random.Random(3).randbytes(10 * bs + 123)
    up = FakeUpstream(data)
    c = Coalescer(up.fetch_into, bs, capacity=4 * bs, prefetch=1)
    # Sequential 16 KiB reads: one fetch per block, not one per read.
    for off in range(0, len(data), 16 * 1024):
        end = min(off + 16 * 1024, len(data))
        assert bytes(await c.read("v", len(data), off, end)) == data[off:end]
    assert len(up.calls) <= 12 and all(s % bs == 0 for s, _ in up.calls)
    assert c.stats.exact_fetches == 1  # only the very first read, before a stream is seen
    # Random reads elsewhere: exactly the asked range.
    up.calls.clear()
    rng = random.Random(4)
    for _ in range(50):
        off = rng.randrange(len(data))
        end = min(len(data), off + rng.randrange(1, 3 * bs))
        assert bytes(await c.read("w", len(data), off, end)) == data[off:end]
    assert len(up.calls) == 50
    # Concurrent readers of one stream share fetches and never see each other's buffers.
    up.calls.clear()
    c2 = Coalescer(up.fetch_into, bs, capacity=2 * bs, prefetch=2)
    offs = list(range(0, len(data), 8 * 1024))
    first = await c2.read("x", len(data), 0, 600 * 1024)  # a big first read: a stream
    assert bytes(first) == data[:600 * 1024]

    async def reader(k: int) -> None:
        for off in offs[k::4]:
            end = min(off + 8 * 1024, len(data))
            assert bytes(await c2.read("x", len(data), off, end)) == data[off:end]

    await asyncio.gather(*(reader(k) for k in range(4)))
    await c.close()
    await c2.close()


async def test_coalescer_forgets_a_failed_block() -> None:
    bs = 64 * 1024
    data = bytes(range(256)) * (3 * bs // 256)
    up = FakeUpstream(data, fail=True)
    c = Coalescer(up.fetch_into, bs)
    with pytest.raises(ReadFailed):
        await c.read("v", len(data), 0, bs)  # a big first read: a block fetch
    up.fail = False
    assert bytes(await c.read("v", len(data), 0, bs)) == data[:bs]
    await c.close()


async def test_data_client_reads_into_buffers_and_maps_errors() -> None:
    from aiohttp import web

    from spokefs.errors import NotFound, RangeNotSatisfiable
    from spokefs.wire.http1 import DataClient

    blob = random.Random(5).randbytes(300_000)

    async def obj(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "missing":
            return web.json_response({"error": {"code": "not_found", "message": "no such"}},
                                     status=404)
        if name == "busy":
            return web.json_response({"error": {"code": "upstream_unavailable",
                                                "message": "later"}}, status=503)
        if name == "cut":  # promises more than it sends, then hangs up
            resp = web.StreamResponse(status=206, headers={
                "Content-Length": "1000", "Content-Range": "bytes 0-999/1000"})
            await resp.prepare(request)
            await resp.write(b"x" * 10)
            request.transport.close()  # type: ignore[union-attr]
            return resp
        lo, hi = (int(x) for x in request.headers["Range"][6:].split("-"))
        if lo >= len(blob):
            return web.json_response({"error": {"code": "range_not_satisfiable",
                                                "message": "past the end",
                                                "size": len(blob)}}, status=416)
        body = blob[lo:hi + 1]
        return web.Response(status=206, body=body, headers={
            "Content-Range": f"bytes {lo}-{lo + len(body) - 1}/{len(blob)}"})

    app = web.Application()
    app.router.add_get("/o/{name}", obj)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = DataClient(f"http://127.0.0.1:{port}")
    try:
        buf = bytearray(70_000)
        for off in (0, 1, 123_456, 250_000):  # kept-alive connection reused throughout
            n, _ = await client.read_into("/o/x", off, memoryview(buf))
            assert bytes(buf[:n]) == blob[off:off + 70_000]
        assert len(client._all) == 1
        with pytest.raises(RangeNotSatisfiable):
            await client.read_into("/o/x", 400_000, memoryview(buf))
        with pytest.raises(NotFound, match="no such"):
            await client.read_into("/o/missing", 0, memoryview(buf))
        with pytest.raises(Transient, match="503"):
            await client.read_into("/o/busy", 0, memoryview(buf))
        with pytest.raises(Transient, match="closed"):
            await client.read_into("/o/cut", 0, memoryview(buf))
        n, _ = await client.read_into("/o/x", 5, memoryview(buf))  # still works afterwards
        assert bytes(buf[:n]) == blob[5:70_005]
    finally:
        await client.close()
        await runner.cleanup()
    with pytest.raises(Transient, match="cannot connect"):
        await client.read_into("/o/x", 0, memoryview(buf))


def test_mountinfo_parsing() -> None:
    info = ("36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw\n"
            "52 27 0:47 / /tmp/with\\040space rw,nosuid - fuse.spokefs spokefs ro\n"
            "53 52 0:48 / /tmp/with\\040space rw - fuse.spokefs spokefs ro\n")
    assert sysfs.mount_entry("/tmp/with space", info) == ("0:48", "fuse.spokefs")
    assert sysfs.mount_entry("/mnt2", info) == ("98:0", "ext3")
    assert sysfs.mount_entry("/elsewhere", info) is None


# -- a real mount ------------------------------------------------------------------------------
def _build_dataset(root: Path) -> Path:
    ds = make_dataset(root, n_small=12, big_sizes=(9_000_000, 4 * 1024 * 1024, 21_000_000))
    tar_path = ds / "shards" / "small.tar"
    rng = random.Random(7)
    with tarfile.open(tar_path, "w") as tf:
        for i in range(5):
            payload = rng.randbytes(1000 * (i + 1))
            info = tarfile.TarInfo(f"sample{i}/data.bin")
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
    odd = ds / "dir with space" / "caf\u00e9"
    odd.mkdir(parents=True)
    (odd / "na\u00efve \u2713.txt").write_bytes(b"unicode names work\n")
    (ds / "class0" / "img0000.jpg").chmod(0o600)
    (ds / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (ds / "run.sh").chmod(0o755)
    many = ds / "many"  # more entries than one readdir reply holds
    many.mkdir()
    for i in range(600):
        (many / f"f{i:04d}").write_bytes(b"%d" % i)
    return ds


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    if FUSE_REASON is not None:
        pytest.skip(f"no FUSE: {FUSE_REASON}")
    root = tmp_path_factory.mktemp("mountstack")
    ds = _build_dataset(root / "ds")
    with hub(ds, root / "hubstate") as h, spoke(h.url, root / "cache", "1GiB",
                                                "--deadline", "3s") as s:
        yield ds, s


@pytest.fixture(scope="module")
def mounted(stack: tuple[Path, ServerProcess], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Path, Path]]:
    ds, s = stack
    mp = tmp_path_factory.mktemp("mnt")
    with MountProcess(f"{s.url}/ds", mp, "--deadline", "5s"):
        yield ds, mp
    assert not sysfs.is_mounted(mp), "SIGTERM left the mount behind"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _tree(root: Path) -> tuple[set[str], dict[str, str]]:
    dirs, files = set(), {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirs.update(str(rel / d) for d in dirnames)
        files.update({str(rel / f): _sha(Path(dirpath) / f) for f in filenames})
    return dirs, files


@needs_fuse
def test_walk_and_hash_equal_the_source(mounted: tuple[Path, Path]) -> None:
    ds, mp = mounted
    assert _tree(mp) == _tree(ds)
    out = subprocess.run(["find", str(mp), "-type", "f"], capture_output=True, text=True,
                         timeout=30, check=True).stdout.splitlines()
    assert len(out) == len(_tree(ds)[1])
    empties = subprocess.run(["find", str(mp), "-type", "d", "-empty"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    assert str(mp / "empty_dir") in empties
    assert sorted(os.listdir(mp / "dir with space" / "caf\u00e9")) == ["na\u00efve \u2713.txt"]


@needs_fuse
def test_random_reads_equal_the_source(mounted: tuple[Path, Path]) -> None:
    ds, mp = mounted
    rng = random.Random(11)
    for name in ("shards/shard-000.tar", "shards/shard-002.tar", "class1/img0001.jpg"):
        src = (ds / name).read_bytes()
        with open(mp / name, "rb", buffering=0) as f:
            for _ in range(60):
                off = rng.randrange(len(src) + 100)  # sometimes past the end: b""
                n = rng.choice([1, 4096, 100_000, 131_072, 1 << 20])
                f.seek(off)
                assert f.read(n) == src[off:off + n]
            assert os.pread(f.fileno(), 10, len(src)) == b""
    with open(mp / "empty.txt", "rb") as f:
        assert f.read() == b""


@needs_fuse
def test_tar_lists_and_extracts_a_shard(mounted: tuple[Path, Path], tmp_path: Path) -> None:
    ds, mp = mounted
    listing = subprocess.run(["tar", "-tf", str(mp / "shards" / "small.tar")],
                             capture_output=True, text=True, timeout=30, check=True)
    with tarfile.open(ds / "shards" / "small.tar") as tf:
        assert listing.stdout.split() == tf.getnames()
    subprocess.run(["tar", "-xf", str(mp / "shards" / "small.tar"), "-C", str(tmp_path)],
                   timeout=30, check=True)
    with tarfile.open(ds / "shards" / "small.tar") as tf:
        member = tf.extractfile("sample3/data.bin")
        assert member is not None
        assert (tmp_path / "sample3" / "data.bin").read_bytes() == member.read()


@needs_fuse
def test_eight_concurrent_readers(mounted: tuple[Path, Path]) -> None:
    ds, mp = mounted
    names = ["shards/shard-002.tar", "shards/shard-000.tar", "shards/shard-001.tar"]
    sources = {n: (ds / n).read_bytes() for n in names}
    errors: list[str] = []

    def reader(k: int) -> None:
        rng = random.Random(100 + k)
        name = names[k % len(names)]
        src = sources[name]
        try:
            with open(mp / name, "rb", buffering=0) as f:
                if k < 3:  # streaming readers
                    pos = 0
                    while chunk := f.read(256 * 1024):
                        if chunk != src[pos:pos + len(chunk)]:
                            errors.append(f"{name} differs at {pos}")
                            return
                        pos += len(chunk)
                    if pos != len(src):
                        errors.append(f"{name} short: {pos}")
                else:  # random readers
                    for _ in range(40):
                        off = rng.randrange(len(src))
                        got = os.pread(f.fileno(), 128 * 1024, off)
                        if got != src[off:off + 128 * 1024]:
                            errors.append(f"{name} differs at {off}")
                            return
        except OSError as exc:
            errors.append(f"{name}: {exc}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


@needs_fuse
def test_mmap_read(mounted: tuple[Path, Path]) -> None:
    ds, mp = mounted
    src = (ds / "shards" / "shard-000.tar").read_bytes()
    with open(mp / "shards" / "shard-000.tar", "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert len(m) == len(src)
        for off in (0, 4095, 4 * 1024 * 1024 - 7, len(src) - 10):
            assert m[off:off + 5000] == src[off:off + 5000]
        assert hashlib.sha256(m).digest() == hashlib.sha256(src).digest()


@needs_fuse
def test_writes_are_erofs(mounted: tuple[Path, Path]) -> None:
    _, mp = mounted
    f = mp / "class0" / "img0000.jpg"
    def opened(path: Path, mode: str) -> None:
        with open(path, mode):
            pass

    attempts = [
        lambda: opened(f, "r+b"),
        lambda: opened(f, "ab"),
        lambda: opened(mp / "new.txt", "wb"),
        lambda: os.mkdir(mp / "newdir"),
        lambda: os.unlink(f),
        lambda: os.rmdir(mp / "empty_dir"),
        lambda: os.rename(f, mp / "moved.jpg"),
        lambda: os.chmod(f, 0o777),
        lambda: os.truncate(f, 0),
        lambda: os.utime(f, (0, 0)),
        lambda: os.symlink("x", mp / "link"),
        lambda: os.link(f, mp / "hard"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS, attempt
    assert not os.access(f, os.W_OK)


@needs_fuse
def test_unknown_paths_are_enoent(mounted: tuple[Path, Path]) -> None:
    _, mp = mounted
    for p in (mp / "nope", mp / "class0" / "nope.jpg", mp / "empty_dir" / "x"):
        with pytest.raises(FileNotFoundError):
            os.stat(p)
        with pytest.raises(FileNotFoundError):  # again: now from the cached negative entry
            p.read_bytes()
    with pytest.raises(NotADirectoryError):
        os.listdir(mp / "empty.txt")
    with pytest.raises(NotADirectoryError):
        os.stat(mp / "empty.txt" / "x")


@needs_fuse
def test_stat_sizes_modes_times_and_statfs(mounted: tuple[Path, Path]) -> None:
    ds, mp = mounted
    total = count = 0
    for dirpath, _, filenames in os.walk(ds):
        for name in filenames:
            src = Path(dirpath) / name
            st_src, st = src.stat(), (mp / src.relative_to(ds)).stat()
            assert stat.S_ISREG(st.st_mode)
            assert (st.st_size, stat.S_IMODE(st.st_mode)) == (
                st_src.st_size, stat.S_IMODE(st_src.st_mode)), name
            assert st.st_mtime_ns == st_src.st_mtime_ns
            total += st_src.st_size
            count += 1
    st = (mp / "empty_dir").stat()
    assert stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o222
    assert (mp / "run.sh").stat().st_mode & 0o111
    vfs = os.statvfs(mp)
    assert vfs.f_bfree == 0 and vfs.f_files >= count
    assert vfs.f_blocks * vfs.f_frsize >= total
    entry = sysfs.mount_entry(mp)
    assert entry is not None and entry[1] == "fuse.spokefs"
    options = next(line.split()[5].split(",")
                   for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if line.split()[4] == str(mp))
    assert {"ro", "nosuid", "nodev"} <= set(options), options
    ra = sysfs.read_ahead_path(mp)
    if os.geteuid() == 0 and ra is not None:
        assert int(ra.read_text()) == 4096


@needs_fuse
def test_torch_dataloader_over_class_folders(mounted: tuple[Path, Path]) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from torch.utils.data import DataLoader, Dataset

    ds, mp = mounted

    class Folders(Dataset):
        def __init__(self, root: Path) -> None:
            self.classes = sorted(p.name for p in root.iterdir() if p.name.startswith("class"))
            self.items = [(str(p), c) for c, name in enumerate(self.classes)
                          for p in sorted((root / name).iterdir())]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> tuple[object, int]:
            path, label = self.items[i]
            with open(path, "rb") as f:
                data = f.read()
            return torch.tensor(list(hashlib.sha256(data).digest())), label

    mounted_set, source_set = Folders(mp), Folders(ds)
    loader = DataLoader(mounted_set, batch_size=4, shuffle=True, num_workers=2,
                        generator=torch.Generator().manual_seed(0), timeout=60)
    seen = {}
    for digests, labels in loader:
        for d, label in zip(digests, labels, strict=True):
            seen[bytes(d.tolist())] = int(label)
    expected = {bytes(source_set[i][0].tolist()): source_set[i][1]
                for i in range(len(source_set))}
    assert seen == expected


# Real time: the deadline runs in the mount process, behind the kernel's FUSE request.
@pytest.mark.timing
@needs_fuse
def test_spoke_down_gives_eio_within_the_deadline_then_recovers(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds, shared = stack
    # A spoke of our own, so stopping it leaves the module's one alone.
    hub_url = shared.args[shared.args.index("--upstream") + 1]
    cache = tmp_path / "cache"
    s = spoke(hub_url, cache, "1GiB").start()
    mp = tmp_path / "mnt"
    mp.mkdir()
    name = "shards/shard-002.tar"
    src = (ds / name).read_bytes()
    try:
        with MountProcess(f"{s.url}/ds", mp, "--deadline", "2s") as m, \
                open(mp / name, "rb", buffering=0) as f:
            assert os.pread(f.fileno(), 4096, 0) == src[:4096]  # mid-read...
            s.stop()  # ...the spoke goes away
            t0 = time.monotonic()
            with pytest.raises(OSError) as info:
                os.pread(f.fileno(), 65536, 16 * 1024 * 1024)
            elapsed = time.monotonic() - t0
            assert info.value.errno == errno.EIO
            # Not before the deadline less one backoff step (0.5 s); the kernel asks again
            # for one page after a failed read, so up to two deadlines (~3.7 s measured) plus
            # room for load; the default 30 s deadline would take a minute.
            assert 1.5 <= elapsed < 8.0, elapsed
            assert m.alive()
            # The spoke comes back on the same port, with the same cache.
            s = spoke(hub_url, cache, "1GiB", "--port", str(s.port)).start()
            assert os.pread(f.fileno(), 65536, 16 * 1024 * 1024) == \
                src[16 * 1024 * 1024:16 * 1024 * 1024 + 65536]
            f.seek(4096)
            assert f.read() == src[4096:]
        assert any("answering EIO" in line and "unavailable for 2s" in line
                   for line in m.output), "".join(m.output)
    finally:
        s.stop()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spokefs.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@needs_fuse
def test_killed_mount_is_cleared_by_umount_and_remounts(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    m = MountProcess(f"{s.url}/ds", mp).start()
    try:
        assert (mp / "run.sh").read_bytes() == (ds / "run.sh").read_bytes()
        m.kill()  # kill -9: nothing unmounts
        with pytest.raises(OSError) as info:
            os.listdir(mp)  # (stat may still answer from the kernel's attribute cache)
        assert info.value.errno == errno.ENOTCONN
        r = _cli("umount", str(mp))
        assert r.returncode == 0, r.stderr
        assert not sysfs.is_mounted(mp) and os.listdir(mp) == []
        assert _cli("umount", str(mp)).returncode == 1  # nothing left to unmount
        with MountProcess(f"{s.url}/ds", mp) as again:
            assert (mp / "run.sh").read_bytes() == (ds / "run.sh").read_bytes()
            again.kill()
        # Mounting over a dead mount clears it without an explicit umount.
        with MountProcess(f"{s.url}/ds", mp) as third:
            assert sorted(os.listdir(mp)) == sorted(os.listdir(ds))
            third.proc.send_signal(signal.SIGINT)  # Ctrl-C unmounts too
            assert third.proc.wait(15) == 0
        assert not sysfs.is_mounted(mp)
    finally:
        m.kill()
        if sysfs.is_mounted(mp):
            unmount(mp)


@needs_fuse
def test_background_mount_returns_when_ready_and_pins_the_snapshot(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    r = _cli("mount", f"{s.url}/ds", str(mp), "--log-file", str(tmp_path / "mount.log"))
    assert r.returncode == 0, r.stderr
    m = re.search(r"ready: ds@(\w+) at .*\(pid (\d+), log ", r.stdout)
    assert m, r.stdout
    snap, pid = m.group(1), int(m.group(2))
    try:
        # Usable the moment the command returned.
        assert (mp / "run.sh").read_bytes() == (ds / "run.sh").read_bytes()
        assert _cli("umount", str(mp)).returncode == 0
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the mount process did not exit after umount"
        # An explicit snapshot id mounts the same tree; an unknown one fails clearly.
        with MountProcess(f"{s.url}/ds@{snap}", mp) as pinned:
            assert snap in pinned.ready_line
        with pytest.raises(MountError, match=r"no snapshot|not found"):
            MountProcess(f"{s.url}/ds@ffffffffffff", mp).start(timeout=30)
        bad = _cli("mount", f"{s.url}/nosuch", str(mp), "--deadline", "2s")
        assert bad.returncode != 0 and "nosuch" in bad.stderr
        assert not sysfs.is_mounted(mp)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if sysfs.is_mounted(mp):
            unmount(mp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@needs_fuse
def test_embedded_cache_reads_a_hub_directly(stack: tuple[Path, ServerProcess],
                                             tmp_path: Path) -> None:
    ds, s = stack
    hub_url = s.args[s.args.index("--upstream") + 1]
    mp, cache = tmp_path / "mnt", tmp_path / "cache"
    mp.mkdir()
    with MountProcess(f"{hub_url}/ds", mp, "--cache-dir", str(cache), "--cache-size", "256MiB",
                      "--deadline", "5s"):
        for name in ("shards/shard-000.tar", "class2/img0002.jpg", "many/f0599"):
            assert (mp / name).read_bytes() == (ds / name).read_bytes()
        src = (ds / "shards" / "shard-002.tar").read_bytes()
        with open(mp / "shards" / "shard-002.tar", "rb", buffering=0) as f:
            for off in (0, 5_000_000, len(src) - 100):
                assert os.pread(f.fileno(), 200_000, off) == src[off:off + 200_000]
    assert blocks_on_disk(cache), "the embedded cache kept nothing"


# -- the short circuit: reading the spoke's cache files on its own host ----------------------
def _own_spoke(stack: tuple[Path, ServerProcess], tmp_path: Path, *extra: str) -> ServerProcess:
    hub_url = stack[1].args[stack[1].args.index("--upstream") + 1]
    return spoke(hub_url, tmp_path / "cache", "1GiB", *extra)


@needs_fuse
def test_short_circuit_reads_resident_blocks_from_the_cache_files(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds = stack[0]
    mp = tmp_path / "mnt"
    mp.mkdir()
    with _own_spoke(stack, tmp_path) as s, MountProcess(f"{s.url}/ds", mp) as m:
        assert any("short circuit on" in line for line in m.output), "".join(m.output)
        names = sorted(p.relative_to(ds).as_posix() for p in (ds / "many").iterdir())[:50]
        for name in names:  # misses: the spoke fetches, the mount reads its cache files
            assert (mp / name).read_bytes() == (ds / name).read_bytes()
        served = metric(s.url, "spokefs_served_bytes_total")
        assert served < sum((ds / n).stat().st_size for n in names)  # not through HTTP
        big = "shards/shard-002.tar"
        src = (ds / big).read_bytes()
        with open(mp / big, "rb", buffering=0) as f:
            for off in (0, 4_194_000, 17_000_000, len(src) - 10):
                assert os.pread(f.fileno(), 300_000, off) == src[off:off + 300_000]
        assert metric(s.url, "spokefs_integrity_failures_total") == 0


@needs_fuse
def test_short_circuit_never_serves_a_damaged_block(stack: tuple[Path, ServerProcess],
                                                    tmp_path: Path) -> None:
    import urllib3

    ds = stack[0]
    mp = tmp_path / "mnt"
    mp.mkdir()
    name = "shards/shard-000.tar"
    src = (ds / name).read_bytes()
    with _own_spoke(stack, tmp_path) as s:
        assert urllib3.request("GET", f"{s.url}/ds/{name}").data == src  # resident now
        end = time.monotonic() + 10
        while len(blocks_on_disk(tmp_path / "cache")) < 3 and time.monotonic() < end:
            time.sleep(0.02)  # the index is committed in batches
        for b in blocks_on_disk(tmp_path / "cache"):  # flip a byte in every block
            with open(b.path, "r+b") as f:
                at = b.offset + b.size // 3
                byte = os.pread(f.fileno(), 1, at)
                os.pwrite(f.fileno(), bytes([byte[0] ^ 0x55]), at)
        with MountProcess(f"{s.url}/ds", mp) as m:
            assert any("short circuit on" in line for line in m.output)
            assert (mp / name).read_bytes() == src  # detected, refetched, never served
        assert metric(s.url, "spokefs_integrity_failures_total") >= 1


@needs_fuse
def test_short_circuit_read_of_an_evicted_block_refetches(stack: tuple[Path, ServerProcess],
                                                          tmp_path: Path) -> None:
    import urllib3

    ds = stack[0]
    mp = tmp_path / "mnt"
    mp.mkdir()
    big = "shards/shard-002.tar"  # 21 MB: six blocks
    src = (ds / big).read_bytes()
    # A cache of three blocks: reading other files evicts what the mount located.
    with _own_spoke(stack, tmp_path, "--cache-size", "13MiB") as s, \
            MountProcess(f"{s.url}/ds", mp) as m, open(mp / big, "rb", buffering=0) as f:
        assert any("short circuit on" in line for line in m.output)
        assert os.pread(f.fileno(), 1000, 0) == src[:1000]   # block 0 located and read
        for other in ("shards/shard-001.tar", "shards/shard-000.tar"):
            assert urllib3.request("GET", f"{s.url}/ds/{other}").data == (ds / other).read_bytes()
        assert metric(s.url, "spokefs_cache_evictions_total") > 0
        # Another part of block 0 (not in the kernel's cache yet): its old location now
        # reads as freed space, fails its check, is asked again and fetched again.
        assert os.pread(f.fileno(), 1000, 3_000_000) == src[3_000_000:3_001_000]
        assert metric(s.url, "spokefs_integrity_failures_total") == 0  # stale is not damage


@needs_fuse
def test_short_circuit_hears_of_prefetched_blocks_before_reading_them(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    from spokefs.client.control import SpokeControl

    ds = stack[0]
    mp = tmp_path / "mnt"
    mp.mkdir()
    names = sorted(p.relative_to(ds).as_posix() for p in (ds / "many").iterdir())[:60]
    with _own_spoke(stack, tmp_path) as s:
        SpokeControl(f"{s.url}/ds").warm(names, wait=True, progress=False, timeout=60)
        with MountProcess(f"{s.url}/ds", mp) as m:
            for name in names:  # one reader, file after file, as a loader would
                assert (mp / name).read_bytes() == (ds / name).read_bytes()
        line = next(x for x in m.output if "short circuit: " in x)
        got = {k: int(v) for v, k in re.findall(
            r"(\d+) (reads from|blocks located|locations heard|reads over)", line)}
        # The first read asks where its block is and hears of every warmed one with the
        # answer: the other files are read without asking.
        assert got["blocks located"] == 1, line
        assert got["locations heard"] >= len(names), line
        assert got["reads from"] == len(names) and got["reads over"] == 0, line
        assert metric(s.url, "spokefs_short_circuit_bytes_total") == sum(
            (ds / n).stat().st_size for n in names)


@needs_fuse
def test_a_mount_that_cannot_see_the_spokes_folder_reads_over_http(
        stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds = stack[0]
    mp = tmp_path / "mnt"
    mp.mkdir()
    with _own_spoke(stack, tmp_path) as s:
        # As on another host where the same path names another folder: its id differs.
        (tmp_path / "cache" / "instance").write_text("0" * 32 + "\n")
        with MountProcess(f"{s.url}/ds", mp) as m:
            assert any("short circuit off" in line for line in m.output), "".join(m.output)
            name = "class1/img0001.jpg"
            assert (mp / name).read_bytes() == (ds / name).read_bytes()
            assert metric(s.url, "spokefs_served_bytes_total") == (ds / name).stat().st_size


# -- options: uid, gid, modes, -o, the background child, the fstab helper ---------------------
def _mount_parser() -> tuple[object, object]:
    from spokefs.cli import build_parser

    p = build_parser()
    leaf = p._spokefs_model.leaves[("mount",)][0]  # type: ignore[attr-defined]
    return p, leaf


def test_modes_and_o_options_parse() -> None:
    from spokefs.mount.options import parse_mode, split

    assert parse_mode("0644") == parse_mode("644") == parse_mode("0o644") == 0o644
    for bad in ("0o4755", "999", "rw-r--r--", "1777"):
        with pytest.raises(ConfigError):
            parse_mode(bad)
    assert split(["ro,uid=5", " deadline=1m ,,allow_other"]) == [
        ("ro", None), ("uid", "5"), ("deadline", "1m"), ("allow_other", None)]


def _o(*argv: str) -> tuple[object, list[str]]:
    from spokefs.mount.options import apply_o

    p, leaf = _mount_parser()
    args = p.parse_args(["mount", "http://h:1/ds", "/mnt", *argv])  # type: ignore[attr-defined]
    return args, apply_o(leaf, args, args.options or [])  # type: ignore[arg-type]


def test_o_sets_what_flags_set() -> None:
    args, kernel = _o("-o", "rw,allow_other,uid=1000,gid=100,file_mode=0440,dir_mode=0550",
                      "-o", "deadline=1m,engine=python,cache-dir=/c,cache_size=1GiB,"
                      "no_short_circuit,noexec,_netdev,nofail,x-systemd.automount,defaults")
    a = vars(args)
    assert (a["allow_other"], a["uid"], a["gid"], a["file_mode"], a["dir_mode"]) == (
        True, 1000, 100, 0o440, 0o550)
    assert (a["deadline"], a["engine"], a["cache_dir"], a["cache_size"]) == (
        60.0, "python", Path("/c"), 1 << 30)
    assert a["no_short_circuit"] is True and kernel == ["noexec"]


@pytest.mark.parametrize("argv,message", [
    (["-o", "colour=blue"], "-o colour: not a mount option"),
    (["-o", "uid=me"], "-o uid='me': not an integer"),
    (["-o", "file_mode=4755"], "permission bits only"),
    (["-o", "engine=rust"], "use one of auto, native, python"),
    (["-o", "deadline"], "-o deadline: needs a value"),
    (["--uid", "5", "-o", "uid=6"], "-o uid and --uid both given"),
])
def test_o_refuses_clearly(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _o(*argv)


def test_the_background_child_gets_every_mount_option() -> None:
    """Every option of ``spokefs mount`` (found by walking its parser: an option added later
    is covered) reaches the background mount's child with the value given."""
    import argparse

    from spokefs.mount.cli import child_command
    from spokefs.units import parse_duration, parse_size

    p, leaf = _mount_parser()
    argv = ["-v", "mount", "http://h:1/ds", "mnt"]
    dests = []
    for a in leaf._actions:  # type: ignore[attr-defined]
        if (not a.option_strings or a.help is argparse.SUPPRESS or isinstance(
                a, argparse._HelpAction) or a.dest in ("foreground", "print_config", "config")):
            continue
        dests.append(a.dest)
        flag = a.option_strings[-1]
        if a.nargs == 0:
            argv.append(flag)
            continue
        if a.choices is not None:
            value = next(str(c) for c in a.choices if c != a.default.value)
        else:
            value = {int: "7", parse_size: "3MiB", parse_duration: "7s", Path: "some/where"
                     }.get(a.type, "0640" if "mode" in a.dest else "x=1")
        argv += [flag, value]
    assert {"uid", "gid", "file_mode", "dir_mode", "options", "engine", "deadline",
            "cache_dir", "read_ahead_kb", "log_file", "allow_other"} <= set(dests)
    given = p.parse_args(argv)  # type: ignore[attr-defined]
    cmd = child_command(argv, 99)
    assert cmd[:3] == [sys.executable, "-m", "spokefs.cli"]
    child = p.parse_args(cmd[3:])  # type: ignore[attr-defined]
    for dest in dests:
        assert getattr(child, dest) == getattr(given, dest), dest
    assert (child.verbose, child.foreground, child.ready_fd) == (1, True, 99)
    assert (child.url, child.mountpoint) == (given.url, given.mountpoint)
    # Arguments after "--" stay positional.
    cmd = child_command(["mount", "--", "http://h:1/ds", "-odd-name"], 5)
    assert p.parse_args(cmd[3:]).mountpoint == Path("-odd-name")  # type: ignore[attr-defined]


def _check_perms(root: Path, uid: int, gid: int, file_mode: int | None, dir_mode: int,
                 ds: Path) -> int:
    """Every inode under ``root`` shows this owner and these bits; returns how many."""
    n = 0
    for dirpath, _, filenames in os.walk(root):
        st = os.stat(dirpath)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, dir_mode), dirpath
        for name in filenames:
            p = Path(dirpath) / name
            st = p.stat()
            want = file_mode if file_mode is not None else stat.S_IMODE(
                (ds / p.relative_to(root)).stat().st_mode)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, want), p
            n += 1
    return n


@needs_fuse
def test_owner_and_modes_show_in_stat(stack: tuple[Path, ServerProcess],
                                      tmp_path: Path) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    with MountProcess(f"{s.url}/ds", mp, "--engine", "python", "--uid", "1234", "--gid",
                      "2345", "--file-mode", "0640", "--dir-mode", "0750") as m:
        assert "engine=python" in m.ready_line
        assert _check_perms(mp, 1234, 2345, 0o640, 0o750, ds) > 600
        assert (mp / "run.sh").read_bytes() == (ds / "run.sh").read_bytes()  # root still reads
    # The defaults: the mounting user, each file's own bits, folders 0555.
    with MountProcess(f"{s.url}/ds", mp, "--engine", "python"):
        _check_perms(mp, os.getuid(), os.getgid(), None, 0o555, ds)


@needs_fuse
def test_a_background_mount_gets_flags_o_env_and_file(stack: tuple[Path, ServerProcess],
                                                      tmp_path: Path) -> None:
    """Options given every way reach the detached child: -o, a flag, the environment, a
    --config file."""
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    conf = tmp_path / "spokefs.toml"
    conf.write_text("[mount]\nread_ahead_kb = 1024\ndir_mode = \"0700\"\n")
    env = {**os.environ, "SPOKEFS_MOUNT_ENGINE": "python"}
    r = subprocess.run([sys.executable, "-m", "spokefs.cli", "mount", f"{s.url}/ds", str(mp),
                        "-o", "uid=4321,gid=20,file_mode=0444,noexec", "--deadline", "5s",
                        "--config", str(conf), "--log-file", str(tmp_path / "m.log")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    m = re.search(r"engine=python, read_ahead_kb=(\w+)\).*\(pid (\d+), log ", r.stdout)
    assert m, r.stdout
    pid = int(m.group(2))
    try:
        if os.geteuid() == 0 and sysfs.read_ahead_path(mp) is not None:
            assert m.group(1) == "1024"
        _check_perms(mp, 4321, 20, 0o444, 0o700, ds)
        options = next(line.split()[5].split(",")
                       for line in Path("/proc/self/mountinfo").read_text().splitlines()
                       if line.split()[4] == str(mp))
        assert "noexec" in options, options
    finally:
        assert _cli("umount", str(mp)).returncode == 0
        end = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _helper(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """mount.fuse.spokefs as mount(8) runs it: SOURCE MOUNTPOINT -o OPTS."""
    return subprocess.run([sys.executable, "-m", "spokefs.mount.fstab", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_the_fstab_helper_builds_the_mount_command() -> None:
    from spokefs.mount.fstab import command

    assert command(["http://h:1/ds", "/mnt", "-o", "rw,allow_other,token_file=/etc/t,"
                    "config=/etc/spokefs.toml,log_level=debug,deadline=60s", "-n"]) == [
        "--token-file", "/etc/t", "--log-level", "debug", "mount", "http://h:1/ds", "/mnt",
        "--config", "/etc/spokefs.toml", "-o", "rw,allow_other,deadline=60s"]
    assert command(["http://h:1/ds", "/mnt", "-f", "-o", "ro"]) is None  # mount -f: fake
    assert command(["-v", "http://h:1/ds", "/mnt", "-t", "fuse.spokefs"])[:2] == [
        "-v", "mount"]


@needs_fuse
def test_the_fstab_helper_mounts(stack: tuple[Path, ServerProcess], tmp_path: Path) -> None:
    ds, s = stack
    mp = tmp_path / "mnt"
    mp.mkdir()
    log = tmp_path / "m.log"
    r = _helper(f"{s.url}/ds", str(mp), "-o", f"rw,allow_other,_netdev,nofail,"
                f"x-systemd.automount,uid=1234,file_mode=0400,engine=python,log_file={log}")
    assert r.returncode == 0, r.stderr
    pid = int(re.search(r"\(pid (\d+), log ", r.stdout).group(1))  # type: ignore[union-attr]
    try:
        _check_perms(mp, 1234, os.getgid(), 0o400, 0o555, ds)
        assert (mp / "run.sh").read_bytes() == (ds / "run.sh").read_bytes()
        entry = sysfs.mount_entry(mp)
        assert entry is not None and entry[1] == "fuse.spokefs"
        super_opts = next(line.split(" - ")[1].split()[2]
                          for line in Path("/proc/self/mountinfo").read_text().splitlines()
                          if line.split()[4] == str(mp))
        assert "allow_other" in super_opts, super_opts
        # mount(8)'s exit statuses: 32 a failed mount, 1 a wrong invocation.
        assert _helper(f"{s.url}/ds", str(mp)).returncode == 32   # already mounted
        assert _helper(f"{s.url}/ds", str(mp), "-o", "colour=blue").returncode == 32
        assert _helper(f"{s.url}/ds").returncode == 1
    finally:
        assert _cli("umount", str(mp)).returncode == 0
        end = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < end:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
