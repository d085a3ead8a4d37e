"""The block index (spokefs.cache.index): its format stays readable, its batched writes keep
their order, and a cache folder written before this module existed opens and serves."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from spokefs.cache import index as block_index
from spokefs.cache.index import BlockIndex, BlockRow, committed_blocks
from spokefs.cache.inspect import store_check
from spokefs.cache.store import BlockStore
from spokefs.policy import make_policy

KiB = 1024
CHUNK = 256 * KiB

# -- a cache folder as the code before spokefs.cache.index wrote it ---------------------------
# Frozen copies of that code's statements (cache/worker.py and cache/store.py, 2026-12-04),
# not imports: the point is that a folder made by them opens, whatever the module says now.
_LEGACY_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    version TEXT, idx INTEGER, seg INTEGER, off INTEGER, size INTEGER, digest BLOB,
    chunks BLOB, dataset TEXT, last_access REAL, stored REAL, PRIMARY KEY (version, idx));
CREATE TABLE IF NOT EXISTS objects (version TEXT PRIMARY KEY, size INTEGER);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT);
"""
_LEGACY_INSERT = ("INSERT OR REPLACE INTO blocks (version, idx, seg, off, size, digest, chunks, "
                  "dataset, last_access, stored) VALUES (?,?,?,?,?,?,?,?,?,?)")
# The same index from before write times were kept (no ``stored``) and before the format note.
_OLDER_BLOCKS = ("CREATE TABLE blocks (version TEXT, idx INTEGER, seg INTEGER, off INTEGER, "
                 "size INTEGER, digest BLOB, chunks BLOB, dataset TEXT, last_access REAL, "
                 "PRIMARY KEY (version, idx))")


def block(i: int, size: int) -> bytes:
    return (f"{i:08d}".encode() * (size // 8 + 1))[:size]


def _chunks(data: bytes) -> bytes:
    return b"".join(xxhash.xxh3_64_digest(data[a:a + CHUNK]) for a in range(0, len(data), CHUNK))


def _aligned(n: int) -> int:
    return (n + 4095) // 4096 * 4096


SIZES = [0, 1, 4096, 100_000, CHUNK, CHUNK + 1, 700 * KiB]


def legacy_folder(root: Path, with_stored: bool = True) -> dict[tuple[str, int], bytes]:
    """A cache folder as that code left it after a clean close: one segment file (sparse,
    256 MiB), blocks at 4 KiB boundaries, an index in WAL mode. Returns the blocks."""
    (root / "segments").mkdir(parents=True)
    (root / "manifests").mkdir()
    blocks = {(f"{i:032x}", i % 3): block(i, size) for i, size in enumerate(SIZES)}
    rows = []
    seg = root / "segments" / f"{1:08x}.seg"
    fd = os.open(seg, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 256 << 20)
        off = 0
        for n, ((version, idx), data) in enumerate(blocks.items()):
            os.pwrite(fd, data, off)
            t = 1_800_000_000.0 + n
            rows.append((version, idx, 1, off, len(data), xxhash.xxh3_128_digest(data),
                         _chunks(data), "ds" if n % 2 else "other", t + 0.5, t))
            off += _aligned(max(len(data), 1))
    finally:
        os.close(fd)
    db = sqlite3.connect(root / "index.sqlite", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    if with_stored:
        db.executescript(_LEGACY_SCHEMA)
        db.executemany(_LEGACY_INSERT, rows)
        db.execute("INSERT OR REPLACE INTO kv VALUES ('store_format', '2')")
    else:
        db.executescript(_LEGACY_SCHEMA.replace(_LEGACY_SCHEMA.split(";")[0] + ";",
                                                _OLDER_BLOCKS + ";"))
        db.executemany("INSERT INTO blocks VALUES (?,?,?,?,?,?,?,?,?)",
                       [r[:9] for r in rows])
    db.execute("INSERT OR REPLACE INTO objects VALUES (?,?)", ("0" * 32, 12345))
    db.execute("INSERT OR REPLACE INTO kv VALUES (?,?)", ("workingset:ds:job", "{}"))
    db.close()
    return blocks


def _open(root: Path) -> BlockStore:
    return BlockStore(root, 1 << 30, make_policy("lru"), fsync=False).open()


def _read(store: BlockStore, key: tuple[str, int]) -> bytes | None:
    loc = store.get(key)
    if loc is None:
        return None
    got = store.read(key, 0, loc.size)
    return None if got is None else bytes(got)


@pytest.mark.parametrize("with_stored", [True, False])
def test_a_folder_written_by_the_earlier_code_opens_and_serves_every_block(
        tmp_path: Path, with_stored: bool) -> None:
    blocks = legacy_folder(tmp_path, with_stored)
    store = _open(tmp_path)
    try:
        assert len(store) == len(blocks)
        assert all(_read(store, key) == data for key, data in blocks.items())
        assert store.object_size("0" * 32) == 12345
        assert store.kv_items("workingset:") == [("workingset:ds:job", "{}")]
        first = store.get(next(iter(blocks)))
        assert first is not None
        # Write times are kept; an index from before them uses the last use instead.
        assert first.stored == (1_800_000_000.0 if with_stored else 1_800_000_000.5)
        assert set(store.use_times()) == {"ds", "other"}
    finally:
        store.close()
    assert store_check(tmp_path) == {"rows": len(blocks), "whole": len(blocks), "bad": 0,
                                     "missing": 0, "orphans": 0}
    db = sqlite3.connect(tmp_path / "index.sqlite")
    try:  # brought up to date in place: noted format, the stored column
        assert db.execute("SELECT value FROM kv WHERE key='store_format'").fetchone() == (
            block_index.FORMAT,)
        assert "stored" in {r[1] for r in db.execute("PRAGMA table_info(blocks)")}
    finally:
        db.close()


def test_the_schema_is_the_one_earlier_folders_have(tmp_path: Path) -> None:
    """The format does not drift: a new index has exactly the tables and columns of an index
    the earlier code made."""
    def columns(path: Path) -> dict[str, list[tuple]]:
        db = sqlite3.connect(path)
        try:
            return {t: db.execute(f"PRAGMA table_info({t})").fetchall()
                    for t in ("blocks", "objects", "kv")}
        finally:
            db.close()

    old = sqlite3.connect(tmp_path / "old.sqlite")
    old.executescript(_LEGACY_SCHEMA)
    old.close()
    block_index.connect(tmp_path / "new.sqlite").close()
    assert columns(tmp_path / "new.sqlite") == columns(tmp_path / "old.sqlite")


def test_a_torn_block_in_an_earlier_folder_is_never_served(tmp_path: Path) -> None:
    blocks = legacy_folder(tmp_path)
    torn_key = list(blocks)[-1]  # 700 KiB: three chunks
    row = next(r for r in committed_blocks(tmp_path) if r.key == torn_key)
    fd = os.open(tmp_path / "segments" / f"{row.seg:08x}.seg", os.O_RDWR)
    os.pwrite(fd, bytes(100 * KiB), row.off + 600 * KiB)  # the write stopped short
    os.close(fd)
    store = _open(tmp_path)
    try:
        assert torn_key in store
        assert store.read(torn_key, 0, 100) is not None  # the whole first chunk still checks
        assert store.read(torn_key, 0, row.size) is None  # the torn one never does
        assert torn_key not in store  # dropped: fetched again
        assert all(_read(store, key) == data for key, data in blocks.items()
                   if key != torn_key)
    finally:
        store.close()
    assert torn_key not in {r.key for r in committed_blocks(tmp_path)}  # and not at restart


# -- crash safety: kill -9 while blocks are written ------------------------------------------

_WRITER = """
import sys, xxhash
from pathlib import Path
from spokefs.cache.store import BlockStore
from spokefs.policy import make_policy
s = BlockStore(Path(sys.argv[1]), 1 << 30, make_policy("lru"), fsync=True).open()
i = 0
while True:
    data = (b"%08d" % i) * (40_000 + 997 * (i % 50))
    res = s.reserve((f"v{i}", 0), len(data), "ds")
    s.write(res, memoryview(data), xxhash.xxh3_128_digest(data))
    i += 1
    if i % 50 == 0:
        s.worker.flush()
        print(i, flush=True)
"""


def test_a_writer_killed_mid_stream_leaves_only_whole_blocks(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while int(proc.stdout.readline() or 0) < 300:  # some batches are committed
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the writer made no progress"
        proc.send_signal(signal.SIGKILL)  # mid-stream: rows and writes still queued
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    check = store_check(tmp_path)
    assert check["rows"] >= 300 and check["bad"] == 0 and check["missing"] == 0
    store = _open(tmp_path)
    try:
        assert len(store) == check["rows"]
        for version, idx in list(store.keys()):
            i = int(version[1:])
            assert _read(store, (version, idx)) == (b"%08d" % i) * (40_000 + 997 * (i % 50))
    finally:
        store.close()


# -- the index on its own ---------------------------------------------------------------------

def test_queued_writes_commit_in_order_in_one_batch(tmp_path: Path) -> None:
    index = BlockIndex.open(tmp_path)
    calls = []
    try:
        assert index.commit(before=lambda: calls.append("flush")) == 0
        assert calls == []  # nothing queued: no flush, no transaction
        key = ("a" * 32, 0)
        index.insert(key, 1, 0, 10, b"d" * 16, b"c" * 8, "ds", 5.0)
        index.delete(key)
        index.insert(key, 1, 4096, 20, b"d" * 16, b"c" * 8, "ds", 6.0)  # written again
        index.insert(("b" * 32, 1), 1, 8192, 30, b"e" * 16, b"f" * 8, "ds2", 7.0)
        index.delete(("b" * 32, 1))
        index.touch([(key, 9.0)])
        index.set_object_size("a" * 32, 99)
        index.set_kv("k", "v")
        index.set_kv("gone", "x")
        index.delete_kv("gone")
        assert index.commit(before=lambda: calls.append("flush")) == 10
        assert calls == ["flush"]
        loaded = index.load()
    finally:
        index.close()
    assert loaded.blocks == [BlockRow("a" * 32, 0, 1, 4096, 20, b"d" * 16, b"c" * 8, "ds",
                                      9.0, 6.0)]
    assert loaded.blocks[0].key == key and loaded.blocks[0].off == 4096
    assert loaded.object_sizes == {"a" * 32: 99}
    assert loaded.kv == {"store_format": block_index.FORMAT, "k": "v"}
    assert committed_blocks(tmp_path) == loaded.blocks
    assert block_index.use_times(tmp_path) == {"ds": (9.0, 9.0)}


def test_a_failed_commit_loses_its_batch_and_raises(tmp_path: Path) -> None:
    index = BlockIndex.open(tmp_path)
    try:
        index.insert(("a" * 32, 0), 1, 0, 10, b"d", b"c", "ds", 1.0)
        index.commit()
        index.db.execute("DROP TABLE objects")  # a statement of the batch cannot run
        index.set_object_size("v", 1)
        index.insert(("b" * 32, 0), 1, 4096, 10, b"d", b"c", "ds", 2.0)
        with pytest.raises(sqlite3.Error):
            index.commit()
        assert index.commit() == 0  # the batch is gone, not retried
        assert [r.version for r in committed_blocks(tmp_path)] == ["a" * 32]  # rolled back
    finally:
        index.close()


def test_an_index_of_another_format_has_its_block_rows_dropped(tmp_path: Path) -> None:
    legacy_folder(tmp_path)
    db = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
    db.execute("UPDATE kv SET value='9' WHERE key='store_format'")
    db.close()
    index = BlockIndex.open(tmp_path)
    try:
        assert index.old_format_dropped
        loaded = index.load()
        assert loaded.blocks == [] and loaded.object_sizes == {"0" * 32: 12345}
        assert loaded.kv["store_format"] == block_index.FORMAT
    finally:
        index.close()
    again = BlockIndex.open(tmp_path)
    assert not again.old_format_dropped
    again.close()


def test_a_fact_committed_soon_is_on_disk_before_the_next_commit_tick(tmp_path: Path) -> None:
    # A dataset's newest state is committed as the worker's next job (kv_set(soon=True)),
    # so a kill -9 just after it does not bring back an older one. With an hour between
    # ticks only commit_soon can put it on disk within the wait.
    from spokefs.cache.worker import StoreWorker
    index = BlockIndex.open(tmp_path)
    worker = StoreWorker(index, fsync=True, on_index_error=lambda exc: None,
                         commit_every=3600.0)
    worker.start()
    try:
        index.set_kv("dataset:ckpt", '{"latest": "s2"}')
        worker.commit_soon()
        other = block_index.connect(tmp_path / block_index.FILE)
        deadline = time.monotonic() + 10
        row = None
        while row is None and time.monotonic() < deadline:
            row = other.execute("SELECT value FROM kv WHERE key='dataset:ckpt'").fetchone()
            if row is None:
                time.sleep(0.01)
        other.close()
        assert row == ('{"latest": "s2"}',)
    finally:
        worker.close()
        index.close()
