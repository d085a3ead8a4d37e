"""The block store on real files: segments, checks on every read, capacity, crash recovery."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import pytest
import xxhash

from spokefs.cache.store import BlockStore
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
