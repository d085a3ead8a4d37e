"""The block store on real files: segments, checks on every read, capacity, crash recovery."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import xxhash

from spokefs.cache.durable import (
    load_manifest_checked,
    manifest_file,
    store_manifest,
    write_durably,
)
from spokefs.cache.store import BlockStore
from spokefs.errors import CacheLocked, ConfigError, ManifestError
from spokefs.manifest import Manifest
from spokefs.policy import make_policy

KiB = 1024


def block(i: int, size: int) -> bytes:
    return (f"{i:08d}".encode() * (size // 8 + 1))[:size]


class Harness:
    """A store driven the way the spoke drives it: an event loop owns it."""

    def __init__(self, root: Path, capacity: int = 64 << 20, policy: str = "lru") -> None:
        self.root = root
        self.capacity = capacity
        self.policy = policy
        self.loop = asyncio.new_event_loop()
        self.store = self.loop.run_until_complete(self._open())

    async def _open(self) -> BlockStore:
        loop = asyncio.get_running_loop()
        s = BlockStore(self.root, self.capacity, make_policy(self.policy), fsync=False)
        return await asyncio.to_thread(s.open, loop.call_soon_threadsafe)

    def put(self, key: tuple[str, int], data: bytes, dataset: str = "ds") -> bool:
        async def go() -> bool:
            res = self.store.reserve(key, len(data), dataset)
            if res is None:
                return False
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self.store.write(res, memoryview(data), xxhash.xxh3_128_digest(data),
                             done.set_result)
            return await done
        return self.loop.run_until_complete(go())

    def read(self, key: tuple[str, int], lo: int = 0, hi: int | None = None) -> bytes | None:
        loc = self.store.get(key)
        if loc is None:
            return None
        v = self.store.read(key, lo, loc.size if hi is None else hi)
        return None if v is None else bytes(v)

    def close(self) -> None:
        self.store.close()
        self.loop.close()


def test_blocks_share_segment_files_and_read_back(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    for i in range(200):
        assert h.put((f"v{i}", 0), block(i, 128 * KiB + i))
    for i in range(200):
        assert h.read((f"v{i}", 0)) == block(i, 128 * KiB + i)
    assert h.read(("v7", 0), 1000, 70_000) == block(7, 128 * KiB + 7)[1000:70_000]
    segs = list((tmp_path / "segments").glob("*.seg"))
    assert len(segs) == 1  # 200 blocks, one file
    h.close()


def test_a_purge_forgets_writes_in_flight(tmp_path: Path) -> None:
    """A block reserved before a purge and written after it is served, not kept: a purge
    leaves nothing it was meant to drop (it raced a fetch in the learning test)."""
    h = Harness(tmp_path)

    async def go() -> tuple[bool, bool]:
        a = h.store.reserve(("a", 0), 1000, "ds")
        other = h.store.reserve(("b", 0), 1000, "other")
        assert a is not None and other is not None
        h.store.forget_writes("ds")  # what a purge of "ds" does before it drops
        kept = []
        for res in (a, other):
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            data = block(1, 1000)
            h.store.write(res, memoryview(data), xxhash.xxh3_128_digest(data), done.set_result)
            kept.append(await done)
        return kept[0], kept[1]

    kept_a, kept_b = h.loop.run_until_complete(go())
    assert not kept_a and ("a", 0) not in h.store      # the purged dataset's write: not kept
    assert kept_b and ("b", 0) in h.store              # another dataset's: kept
    assert h.store.reserved == 0                         # no room held by the forgotten
    assert h.put(("a", 0), block(1, 1000))              # a fetch after the purge is kept
    h.close()


def test_damage_is_caught_on_every_read_and_the_block_dropped(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    data = block(1, 600 * KiB)
    assert h.put(("v", 0), data)
    assert h.read(("v", 0)) == data
    loc = h.store.get(("v", 0))
    assert loc is not None
    # A stray write keeps the file's identity-free bytes: flip one byte in the third chunk.
    fd = os.open(loc.seg.path, os.O_RDWR)
    at = loc.offset + 520 * KiB
    os.pwrite(fd, bytes([data[520 * KiB] ^ 0xFF]), at)
    os.close(fd)
    assert h.read(("v", 0), 0, 100) == data[:100]      # an undamaged chunk still serves
    assert h.read(("v", 0), 500 * KiB, 530 * KiB) is None  # the damaged one never does
    assert ("v", 0) not in h.store                      # dropped: the caller refetches
    h.close()


def test_capacity_bounds_disk_bytes_and_eviction_frees_them(tmp_path: Path) -> None:
    cap = 4 << 20
    h = Harness(tmp_path, capacity=cap)
    for i in range(100):
        h.put((f"v{i}", 0), block(i, 100_000))
        assert h.store.used + h.store.reserved <= cap
        if i % 10 == 9:
            h.store.worker.flush()
            assert h.store.disk_bytes() <= cap + 64 * KiB  # what ext4 keeps for extents
    assert len(h.store) == cap // 102_400               # each rounds up to 25 pages
    assert h.read(("v99", 0)) == block(99, 100_000)
    assert h.read(("v0", 0)) is None
    h.close()


def test_restart_keeps_committed_blocks_and_frees_orphans(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    for i in range(10):
        h.put((f"v{i}", 0), block(i, 200 * KiB))
    h.store.close()  # commits the index
    h.loop.close()
    # Simulate a crash after a write was made but before its row was committed: a region
    # at the end of the segment that no row points to.
    seg = next((tmp_path / "segments").glob("*.seg"))
    fd = os.open(seg, os.O_RDWR)
    os.pwrite(fd, b"orphan" * 1000, 100 << 20)
    os.close(fd)
    before = os.stat(seg).st_blocks
    h2 = Harness(tmp_path)
    assert len(h2.store) == 10
    assert all(h2.read((f"v{i}", 0)) == block(i, 200 * KiB) for i in range(10))
    assert os.stat(seg).st_blocks < before  # the orphan region was freed
    h2.close()


def test_rows_without_bytes_are_misses_not_wrong_bytes(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.put(("v", 0), block(3, 300 * KiB))
    h.store.close()
    h.loop.close()
    # As after a power loss with no fsync: the row is durable, the bytes are not.
    seg = next((tmp_path / "segments").glob("*.seg"))
    fd = os.open(seg, os.O_RDWR)
    os.pwrite(fd, bytes(300 * KiB), 0)
    os.close(fd)
    h2 = Harness(tmp_path)
    assert ("v", 0) in h2.store
    assert h2.read(("v", 0)) is None and ("v", 0) not in h2.store
    h2.close()


def test_pinned_blocks_are_never_evicted_and_a_full_cache_passes_through(tmp_path: Path
                                                                          ) -> None:
    h = Harness(tmp_path, capacity=1 << 20)
    h.store.pin(("a", 0))
    h.store.pin(("b", 0))
    assert h.put(("a", 0), block(1, 500 * KiB))
    assert h.put(("b", 0), block(2, 500 * KiB))
    assert not h.put(("c", 0), block(3, 100 * KiB))  # no room, nothing evictable
    h.store.unpin(("a", 0))
    assert h.put(("c", 0), block(3, 100 * KiB))
    assert ("a", 0) not in h.store and ("b", 0) in h.store
    h.close()


def test_old_format_cache_is_dropped_cleanly(tmp_path: Path) -> None:
    (tmp_path / "blocks" / "ab").mkdir(parents=True)
    (tmp_path / "blocks" / "ab" / "abcd-0").write_bytes(b"x" * 100)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("CREATE TABLE blocks (version TEXT, idx INTEGER, size INTEGER, digest BLOB, "
               "dataset TEXT, last_access REAL, PRIMARY KEY (version, idx))")
    db.execute("INSERT INTO blocks VALUES ('abcd', 0, 100, x'00', 'ds', 0)")
    db.commit()
    db.close()
    h = Harness(tmp_path)
    assert len(h.store) == 0 and not (tmp_path / "blocks").exists()
    assert h.put(("v", 0), block(1, 1000))
    h.close()


@pytest.mark.parametrize("size", [0, 1, 4096, 256 * KiB, 256 * KiB + 1, 4 << 20])
def test_block_sizes_at_the_edges(tmp_path: Path, size: int) -> None:
    h = Harness(tmp_path)
    data = block(5, size)
    assert h.put(("v", 0), data)
    assert h.read(("v", 0)) == data
    h.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_full_volume_mid_segment_fails_the_write_and_keeps_nothing_torn(tmp_path: Path
                                                                          ) -> None:
    import subprocess

    root = tmp_path / "cache"
    root.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        h = Harness(root, capacity=64 << 20)  # the volume, not the capacity, runs out
        kept = [h.put((f"v{i}", 0), block(i, 300 * KiB)) for i in range(12)]
        assert kept[0] and not all(kept)          # some fit, then the volume was full
        assert not h.store.writable               # and the store passes data through
        assert not h.put(("later", 0), block(99, 1000))
        for i, ok in enumerate(kept):
            assert h.read((f"v{i}", 0)) == (block(i, 300 * KiB) if ok else None)
        h.store.retry_writable()                  # housekeeping tries again later
        assert h.store.writable
        h.close()
        h2 = Harness(root, capacity=64 << 20)     # reopened on the full volume: whole blocks
        assert len(h2.store) == sum(kept)
        assert all(h2.read((f"v{i}", 0)) == block(i, 300 * KiB) for i, ok in enumerate(kept)
                   if ok)
        h2.close()
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def test_direct_io_writes_from_aligned_buffers_read_back(tmp_path: Path) -> None:
    import mmap

    loop = asyncio.new_event_loop()
    store = BlockStore(tmp_path, 64 << 20, make_policy("lru"), fsync=False, direct_io=True)
    loop.run_until_complete(asyncio.to_thread(store.open, loop.call_soon_threadsafe))
    arena = memoryview(mmap.mmap(-1, 4 << 20))  # page-aligned, as the fetcher's buffers
    blocks = [block(i, 100_000 + 997 * i) for i in range(8)]

    async def put_all() -> list[bool]:
        futs, at = [], 0
        for i, data in enumerate(blocks):
            res = store.reserve((f"v{i}", 0), len(data), "ds")
            assert res is not None
            arena[at:at + len(data)] = data
            padded = arena[at:at + (len(data) + 4095) // 4096 * 4096]
            done: asyncio.Future[bool] = loop.create_future()
            store.write(res, arena[at:at + len(data)], xxhash.xxh3_128_digest(data),
                        done.set_result, padded=padded)
            futs.append(done)
            at += len(padded)
        return list(await asyncio.gather(*futs))

    assert all(loop.run_until_complete(put_all()))
    seg = next(iter(store._segs.segments.values()))
    assert seg.dfd is not None  # this filesystem takes direct I/O: it was used
    for i, data in enumerate(blocks):
        got = store.read((f"v{i}", 0), 0, len(data))
        assert got is not None and bytes(got) == data
    store.close()
    loop.close()
    h = Harness(tmp_path)  # reopened: the blocks are whole on disk
    assert all(h.read((f"v{i}", 0)) == data for i, data in enumerate(blocks))
    h.close()


@pytest.mark.parametrize("direct_io", [False, True])
def test_aligned_and_unaligned_writes_mix_in_either_mode(tmp_path: Path, direct_io: bool
                                                         ) -> None:
    """Blocks given page-aligned (the fetcher's) and plain ones (anyone's), written in one
    gathered batch: every one lands, whichever way the store writes."""
    import mmap

    loop = asyncio.new_event_loop()
    store = BlockStore(tmp_path, 64 << 20, make_policy("lru"), fsync=False,
                       direct_io=direct_io)
    loop.run_until_complete(asyncio.to_thread(store.open, loop.call_soon_threadsafe))
    arena = memoryview(mmap.mmap(-1, 4 << 20))
    blocks = [block(i, 50_000 + 4096 * (i % 3)) for i in range(9)]

    async def put_all() -> list[bool]:
        futs, at = [], 0
        for i, data in enumerate(blocks):
            res = store.reserve((f"v{i}", 0), len(data), "ds")
            assert res is not None
            done: asyncio.Future[bool] = loop.create_future()
            if i % 2:  # every other one aligned and padded
                arena[at:at + len(data)] = data
                padded = arena[at:at + (len(data) + 4095) // 4096 * 4096]
                store.write(res, arena[at:at + len(data)], xxhash.xxh3_128_digest(data),
                            done.set_result, padded=padded)
                at += len(padded)
            else:
                store.write(res, memoryview(data), xxhash.xxh3_128_digest(data),
                            done.set_result)
            futs.append(done)
        return list(await asyncio.gather(*futs))

    assert all(loop.run_until_complete(put_all()))
    for i, data in enumerate(blocks):
        got = store.read((f"v{i}", 0), 0, len(data))
        assert got is not None and bytes(got) == data
    store.close()
    loop.close()


def test_residency_feed_hands_out_each_entry_once_in_order() -> None:
    from spokefs.cache.feed import ResidencyFeed

    feed: ResidencyFeed[int, str] = ResidencyFeed(keep=4)
    assert feed.since(0, 10) == ([], 0)
    for k in range(3):
        feed.add(k, f"v{k}")
    got, cur = feed.since(0, 2)
    assert got == [(0, "v0"), (1, "v1")] and cur == 2
    got, cur = feed.since(cur, 10)
    assert got == [(2, "v2")] and cur == 3
    assert feed.since(cur, 10) == ([], 3)  # nothing new: the same cursor back
    for k in range(3, 9):  # more than it keeps: the oldest are dropped
        feed.add(k, f"v{k}")
    got, cur = feed.since(3, 10)  # a reader that fell behind starts at the oldest kept
    assert [k for k, _ in got] == [5, 6, 7, 8] and cur == 9
    got, cur = feed.since(50, 10)  # a cursor from a spoke that has restarted since
    assert [k for k, _ in got] == [5, 6, 7, 8] and cur == 9
    assert feed.since(2, 0) == ([], 5)  # a zero limit only moves a stale cursor on


# -- one owner per cache folder; readers are never blocked ----------------------------------

_HOLDER = """
import sys
from pathlib import Path
from spokefs.cache.store import BlockStore
from spokefs.policy import make_policy
s = BlockStore(Path(sys.argv[1]), 1 << 26, make_policy("lru"), fsync=False).open()
print("ready", flush=True)
sys.stdin.read()
s.close()
"""


def _store(root: Path, **kw: object) -> BlockStore:
    return BlockStore(root, 64 << 20, make_policy("lru"), fsync=False, **kw)  # type: ignore


def test_a_second_store_on_the_same_folder_fails_naming_folder_and_pid(tmp_path: Path
                                                                       ) -> None:
    h = Harness(tmp_path)
    for i in range(5):
        assert h.put((f"v{i}", 0), block(i, 50_000))
    with pytest.raises(CacheLocked) as info:
        _store(tmp_path).open()
    message = str(info.value)
    assert str(tmp_path) in message and f"process {os.getpid()}" in message
    assert isinstance(info.value, ConfigError)  # the CLI reports it as a bad option
    # The refused store touched nothing: the first goes on serving its blocks.
    assert all(h.read((f"v{i}", 0)) == block(i, 50_000) for i in range(5))
    h.close()
    h2 = Harness(tmp_path)  # once the first has closed, the folder opens again
    assert len(h2.store) == 5 and h2.read(("v3", 0)) == block(3, 50_000)
    h2.close()


def test_another_process_holds_the_folder_until_it_ends(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with pytest.raises(CacheLocked, match=f"process {proc.pid}"):
            _store(tmp_path).open()
        proc.kill()  # as kill -9: the kernel lets go of the lock, no stale lock file
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    s = _store(tmp_path).open()
    s.close()


def test_readers_of_the_cache_in_other_processes_are_not_blocked(tmp_path: Path) -> None:
    """A replica worker and a same-host mount read the segment files (spokefs.cache.shared)
    and inspect reads the index, all while the owner holds the lock."""
    h = Harness(tmp_path)
    data = block(7, 300 * KiB)
    assert h.put(("v", 0), data)
    h.store.worker.flush()
    loc = h.store.get(("v", 0))
    assert loc is not None
    entry = {"seg": loc.seg.id, "offset": loc.offset, "size": loc.size,
             "digest": loc.digest.hex(), "chunks": loc.chunks.hex()}
    reader = (
        "import json, sys, xxhash\n"
        "from pathlib import Path\n"
        "from spokefs.cache.shared import SharedCache\n"
        "from spokefs.cache.inspect import store_check\n"
        "root, cid, entry = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])\n"
        "c = SharedCache(root, cid)\n"
        "assert c.usable()\n"
        "loc = c.loc(entry)\n"
        "got = c.read(loc, 0, loc.size)\n"
        "print(xxhash.xxh3_128_hexdigest(bytes(got)), json.dumps(store_check(root)))\n")
    out = subprocess.run([sys.executable, "-c", reader, str(tmp_path), h.store.instance,
                          json.dumps(entry)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    digest, check = out.stdout.split(" ", 1)
    assert digest == xxhash.xxh3_128_hexdigest(data)
    assert json.loads(check)["whole"] == 1
    h.close()


# -- only a damaged index is dropped; a busy one is waited for, never wiped ------------------

def _exclusive(root: Path) -> sqlite3.Connection:
    """Another connection holding the index locked (as a process stuck mid-write would)."""
    db = sqlite3.connect(root / "index.sqlite", isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA locking_mode=EXCLUSIVE")
    db.execute("BEGIN EXCLUSIVE")
    return db


def _filled(root: Path, n: int = 6) -> None:
    h = Harness(root)
    for i in range(n):
        assert h.put((f"v{i}", 0), block(i, 40_000))
    h.close()


def test_a_busy_index_past_the_timeout_fails_the_open_and_wipes_nothing(tmp_path: Path
                                                                         ) -> None:
    _filled(tmp_path)
    segs = sorted(p.name for p in (tmp_path / "segments").iterdir())
    db = _exclusive(tmp_path)
    try:
        with pytest.raises(ConfigError, match="database is locked") as info:
            _store(tmp_path, busy_timeout=0.3).open()
        assert "left as it is" in str(info.value)
        assert sorted(p.name for p in (tmp_path / "segments").iterdir()) == segs
    finally:
        db.close()
    # The lock was let go on the failure: once the index is free, every block is back.
    h = Harness(tmp_path)
    assert len(h.store) == 6 and all(h.read((f"v{i}", 0)) == block(i, 40_000)
                                     for i in range(6))
    h.close()


def test_a_busy_index_is_waited_for_within_the_timeout(tmp_path: Path) -> None:
    _filled(tmp_path)
    db = _exclusive(tmp_path)
    timer = threading.Timer(0.5, db.close)  # the other writer finishes a moment later
    timer.start()
    try:
        s = _store(tmp_path, busy_timeout=20).open()
    finally:
        timer.join()
    assert len(s) == 6
    s.close()


def test_a_damaged_index_is_still_dropped_and_the_cache_starts_empty(tmp_path: Path) -> None:
    _filled(tmp_path)
    for name in ("index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    (tmp_path / "index.sqlite").write_bytes(b"this is not an SQLite database" * 200)
    h = Harness(tmp_path)
    assert len(h.store) == 0 and not list((tmp_path / "segments").glob("*.seg"))
    assert h.put(("v", 0), block(1, 1000)) and h.read(("v", 0)) == block(1, 1000)
    h.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_a_volume_too_full_to_open_the_index_still_starts(tmp_path: Path) -> None:
    """The one case besides damage where the index goes: SQLite cannot even open it (no room
    for its -shm file). Documented: start empty, which frees the space, rather than not at
    all (the chaos suite's disk_full restarts so)."""
    root = tmp_path / "cache"
    root.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        _filled(root, 3)
        subprocess.run(["dd", "if=/dev/zero", f"of={root / 'filler'}", "bs=64k"],
                       capture_output=True)
        h = Harness(root)
        assert len(h.store) == 0 and h.read(("v0", 0)) is None
        h.close()
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


# -- paths built from upstream names; durable, checked manifests ----------------------------

def _real_manifest(n: int = 3) -> tuple[str, bytes]:
    paths = [f"d/f{i}" for i in range(n)]
    m = Manifest("ds", "", 1.0, 4 << 20, paths, [10] * n, [0o644] * n, [5] * n,
                 [f"{i:032x}" for i in range(n)], ["", "d"])
    snap = m.content_id()
    full = Manifest("ds", snap, 1.0, 4 << 20, paths, m.sizes, m.modes, m.mtimes, m.versions,
                    m.dirs)
    return snap, full.encode()


@pytest.mark.parametrize("dataset,snap", [
    ("ds", "../../etc/x"), ("ds", "a/b"), ("ds", ""), ("ds", "A" * 12), ("ds", "0" * 13),
    ("ds", "latest"), ("../x", "0" * 12), ("", "0" * 12), ("a/b", "0" * 12)])
def test_manifest_paths_are_built_only_from_checked_names(tmp_path: Path, dataset: str,
                                                          snap: str) -> None:
    h = Harness(tmp_path)
    try:
        with pytest.raises(ManifestError, match="refusing a manifest path"):
            h.store.manifest_path(dataset, snap)
        assert h.store.manifest_path("ds", "0123456789ab") == (
            tmp_path / "manifests" / "ds" / "0123456789ab.json.gz")
    finally:
        h.close()


def test_write_durably_replaces_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "file.bin"  # folders made on the way
    write_durably(target, b"first")
    write_durably(target, memoryview(b"second, longer"))
    assert target.read_bytes() == b"second, longer"
    assert [p.name for p in target.parent.iterdir()] == ["file.bin"]


def test_a_kept_manifest_loads_only_when_it_matches_its_id(tmp_path: Path) -> None:
    snap, blob = _real_manifest()
    path = manifest_file(tmp_path, "ds", snap)
    assert load_manifest_checked(path, snap, "ds") is None  # none kept yet
    store_manifest(path, blob, snap, "ds")
    assert load_manifest_checked(path, snap, "ds") == blob
    assert load_manifest_checked(path, snap, "ds") == blob  # again (remembered as checked)


@pytest.mark.parametrize("damage", ["truncated", "tampered", "garbage", "empty",
                                    "another snapshot"])
def test_a_damaged_kept_manifest_is_detected_deleted_and_missing(tmp_path: Path,
                                                                 damage: str) -> None:
    snap, blob = _real_manifest()
    path = manifest_file(tmp_path, "ds", snap)
    store_manifest(path, blob, snap, "ds")
    assert load_manifest_checked(path, snap, "ds") == blob  # checked once: remembered
    if damage == "truncated":  # as after a crash of a writer that did not fsync
        with open(path, "r+b") as f:
            f.truncate(len(blob) // 2)
    elif damage == "tampered":  # well-formed, same snapshot named, other content
        doc = json.loads(gzip.decompress(blob))
        doc["sizes"][0] += 1
        path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(blob)))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        other_blob = _real_manifest(4)[1]
        path.write_bytes(other_blob)
    assert load_manifest_checked(path, snap, "ds") is None
    assert not path.exists()  # deleted: the caller fetches it again and keeps a good copy
    store_manifest(path, blob, snap, "ds")
    assert load_manifest_checked(path, snap, "ds") == blob


def test_a_bad_manifest_from_upstream_is_never_kept(tmp_path: Path) -> None:
    snap, blob = _real_manifest()
    path = manifest_file(tmp_path, "ds", snap)
    for bad in (blob[:-5], b"{}", _real_manifest(5)[1]):
        with pytest.raises(ManifestError):
            store_manifest(path, bad, snap, "ds")
        assert not path.exists()
    with pytest.raises(ManifestError):
        store_manifest(path, blob, snap, "other-dataset")
    assert not path.exists()


def test_saved_working_sets_are_capped_oldest_forgotten(tmp_path: Path, monkeypatch) -> None:
    import spokefs.planner as pl
    from spokefs.spoke import prefetch
    from spokefs.spoke.prefetch import PrefetchDriver

    monkeypatch.setattr(prefetch, "MAX_SAVED_WORKING_SETS", 3)
    h = Harness(tmp_path / "c")
    driver = PrefetchDriver(pl.Planner(capacity=1 << 30), h.store, lambda *a: None,
                            lambda k: False, lambda ds: None)  # type: ignore[arg-type,return-value]
    for j in range(5):  # five jobs (names a client chose) finish an epoch each
        ws = pl.WorkingSet("ds", f"job{j}", "", [("a", "b")], files=1, bytes=1, epochs=1)
        driver.act([pl.WorkingSetLearned("ds", f"job{j}", ws)], "ds")
    kept = [k for k, _ in h.store.kv_items("workingset:")]
    assert kept == ["workingset:ds:job2", "workingset:ds:job3", "workingset:ds:job4"]
    h.close()
    h = Harness(tmp_path / "c")  # and on disk: a restart sees the same three
    assert [k for k, _ in h.store.kv_items("workingset:")] == kept
    h.close()


def test_the_cache_folder_is_private_to_its_user(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir(mode=0o755)
    h = Harness(tmp_path / "c")
    h.put(("v" * 32, 0), block(1, 8 * KiB))
    h.close()
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    for seg in (tmp_path / "c" / "segments").iterdir():
        assert seg.stat().st_mode & 0o077 == 0, seg
