"""The spoke's block store: verified blocks on local disk, indexed in SQLite.

Layout of ``cache_dir``::

    index.sqlite        what is resident (WAL mode), object sizes, settings, learned state
    blocks/ab/<version>-<index>    one file per block
    tmp/                blocks being written
    manifests/<dataset>/<snapshot>.json.gz

Crash safety, in this order: write to tmp/, fsync (``fsync=True``), rename into blocks/, then
index. Eviction deletes the index row first, then the file. So a ``kill -9`` anywhere leaves
only (a) temp files, removed at open, and (b) block files with no index row, also removed at
open. A block is served only when its index row exists and its bytes match the digest in that
row. An index that cannot be opened at all (corrupt, or on a volume too full for SQLite's WAL
files) is replaced by an empty one and the block files go with it: the spoke starts empty
rather than not at all. The digest (xxh3, memory speed) is checked before a block is put,
on its first read after a restart, again whenever the block file's identity (inode, size,
mtime, ctime) changed, and at least every ``reverify_after`` seconds while it is read; so
bit rot, a torn write or a stray write is caught and the block refetched, without hashing
4 MiB for every 128 KiB read.

``capacity`` is a hard bound on the bytes of resident plus reserved blocks; the eviction policy
(spokefs.policy) chooses victims. When nothing can be evicted (all pinned) or the disk refuses
a write, ``put`` returns None and the caller passes the bytes through uncached.

Thread-safety: ``put`` runs in worker threads (disk writes), lookups in the event loop; one
lock guards the index, the policy and the counters.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from spokefs.integrity import block_digest
from spokefs.policy import BlockKey, EvictionPolicy

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    version TEXT, idx INTEGER, size INTEGER, digest BLOB, dataset TEXT, last_access REAL,
    PRIMARY KEY (version, idx));
CREATE TABLE IF NOT EXISTS objects (version TEXT PRIMARY KEY, size INTEGER);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT);
"""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    key: BlockKey
    size: int
    digest: bytes
    dataset: str


class StoreEvents:
    """Counters the store bumps; the service maps them onto Prometheus metrics."""

    def __init__(self) -> None:
        self.on_evict: Callable[[int], None] = lambda n: None
        self.on_corrupt: Callable[[], None] = lambda: None
        self.on_write_error: Callable[[str], None] = lambda reason: None


class BlockStore:
    def __init__(self, root: Path, capacity: int, policy: EvictionPolicy,
                 fsync: bool = True) -> None:
        self.root = root
        self.capacity = capacity
        self.policy = policy
        self.fsync = fsync
        self.events = StoreEvents()
        self.used = 0          # bytes of indexed blocks
        self.reserved = 0      # bytes being written
        self.writable = True   # False after a write failed (disk full, read-only): pass-through
        self._records: dict[BlockKey, BlockRecord] = {}
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._touched: dict[BlockKey, float] = {}
        self._last_flush = 0.0
        self._write_error_logged = False
        # Blocks whose digest was checked in this process, with the file identity (inode,
        # size, mtime, ctime) it was checked under: any write to the file changes it.
        self._verified: dict[BlockKey, tuple[tuple[int, int, int, int], float]] = {}
        self.reverify_after = 60.0

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self) -> BlockStore:
        for sub in ("blocks", "tmp", "manifests"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for leftover in (self.root / "tmp").iterdir():  # writes a crash interrupted
            leftover.unlink(missing_ok=True)
        try:
            self._db = self._connect()
            rows = self.db.execute("SELECT version, idx, size, digest, dataset FROM blocks "
                                   "ORDER BY last_access").fetchall()
        except sqlite3.DatabaseError as exc:
            # A corrupt index, or a volume too full for SQLite's WAL files: without the index
            # no block can be trusted, so start empty rather than fail to start (a crash
            # loop needs an operator). Removing the blocks also frees the space.
            log.error("cache: index %s is unusable (%s); starting with an empty cache",
                      self.root / "index.sqlite", exc)
            if self._db is not None:
                self._db.close()
                self._db = None
            for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
                (self.root / name).unlink(missing_ok=True)
            shutil.rmtree(self.root / "blocks", ignore_errors=True)
            (self.root / "blocks").mkdir()
            self._db = self._connect()
            rows = []
        self._recover(rows)
        return self

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False,
                             isolation_level=None, timeout=30)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
        except sqlite3.Error:
            db.close()
            raise
        return db

    def _recover(self, rows: list[tuple[str, int, int, bytes, str]]) -> None:
        present = set()
        for sub in (self.root / "blocks").iterdir():
            for f in sub.iterdir():
                present.add(f.name)
        missing = []
        for version, idx, size, digest, dataset in rows:
            name = f"{version}-{idx}"
            if name not in present:
                missing.append((version, idx))
                continue
            present.discard(name)
            key = (version, idx)
            self._records[key] = BlockRecord(key, size, digest, dataset)
            self.policy.insert(key, size)
            self.used += size
        if missing:
            self._index_write("DELETE FROM blocks WHERE version=? AND idx=?", missing)
        for name in present:  # written but never indexed: a crash between rename and index
            self.path_for(tuple(name.rsplit("-", 1))).unlink(missing_ok=True)  # type: ignore[arg-type]
        if rows or present:
            log.info("cache: %d blocks (%d bytes) resident; %d orphans removed, %d rows dropped",
                     len(self._records), self.used, len(present), len(missing))
        self._evict_to(self.capacity)

    def close(self) -> None:
        if self._db is not None:
            self.flush_access_times(force=True)
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("BlockStore.open() was not called")
        return self._db

    # -- paths -------------------------------------------------------------------------------
    def path_for(self, key: BlockKey) -> Path:
        version, idx = key
        return self.root / "blocks" / version[:2] / f"{version}-{int(idx)}"

    # -- reads -------------------------------------------------------------------------------
    def get(self, key: BlockKey) -> BlockRecord | None:
        return self._records.get(key)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._records

    def open_verified(self, key: BlockKey) -> BinaryIO | None:
        """An open file of the block after checking its bytes; None if absent or corrupt
        (a corrupt block is dropped and counted, and the caller fetches it again)."""
        rec = self._records.get(key)
        if rec is None:
            return None
        try:
            f = open(self.path_for(key), "rb", buffering=0)  # noqa: SIM115 (caller closes)
        except FileNotFoundError:
            self.drop(key, "file missing")
            return None
        try:
            st = os.fstat(f.fileno())
            ident = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            seen = self._verified.get(key)
            now = time.monotonic()
            if (seen is not None and seen[0] == ident and st.st_size == rec.size
                    and now - seen[1] < self.reverify_after):
                ok = True  # same file, unchanged since we checked it moments ago
            else:
                ok = st.st_size == rec.size and _digest_of(f, rec.size) == rec.digest
                if ok:
                    self._verified[key] = (ident, now)
        except OSError as exc:
            log.warning("cache: reading block %s-%d failed: %s", key[0], key[1], exc)
            ok = False
        if not ok:
            f.close()
            self.events.on_corrupt()
            log.warning("cache: block %s-%d failed its integrity check; dropped, will refetch",
                        key[0], key[1])
            self.drop(key, "corrupt")
            return None
        self.touch(key)
        return f

    def touch(self, key: BlockKey) -> None:
        with self._lock:
            if key in self._records:
                self.policy.access(key)
                self._touched[key] = time.time()

    def flush_access_times(self, force: bool = False) -> None:
        """Persist recent access times (batched: eviction order survives a restart)."""
        now = time.monotonic()
        if not force and now - self._last_flush < 5.0:
            return
        with self._lock:
            touched, self._touched = self._touched, {}
            self._last_flush = now
        if touched:
            with self._lock:
                self._index_write("UPDATE blocks SET last_access=? WHERE version=? AND idx=?",
                                  [(t, k[0], k[1]) for k, t in touched.items()])

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: BlockKey, data: bytes, digest: bytes, dataset: str) -> bool:
        """Persist a verified block. False when it could not be cached (pass it through)."""
        size = len(data)
        with self._lock:
            if key in self._records:
                return True
            if not self.writable or size > self.capacity:
                return False
            if not self._evict_to_locked(self.capacity - size):
                return False
            self.reserved += size
        tmp = self.root / "tmp" / f"{key[0]}-{key[1]}.{threading.get_ident()}"
        final = self.path_for(key)
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb", buffering=0) as f:
                # An unbuffered write may write part of the block on a full volume and
                # return the count instead of raising: a short block must never be indexed.
                written = f.write(data)
                if written != size:
                    raise OSError(errno.ENOSPC, f"short write: {written} of {size} bytes")
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            st = os.stat(final)  # after the rename: it moves ctime on ext4
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            with self._lock:
                self.reserved -= size
            self._write_failed(exc)
            return False
        with self._lock:
            self.reserved -= size
            try:
                self.db.execute("INSERT OR REPLACE INTO blocks VALUES (?,?,?,?,?,?)",
                                (key[0], key[1], size, digest, dataset, time.time()))
            except sqlite3.Error as exc:  # index volume full: the block stays uncached
                with contextlib.suppress(OSError):
                    final.unlink(missing_ok=True)
                self._write_failed(OSError(errno.ENOSPC, str(exc)))
                return False
            self._records[key] = BlockRecord(key, size, digest, dataset)
            self.used += size
            self.policy.insert(key, size)
            # The caller verified these bytes: their first read need not hash them again.
            self._verified[key] = ((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                                   time.monotonic())
        return True

    def _index_write(self, sql: str, rows: list[tuple[object, ...]]) -> bool:
        """An index write that may fail without failing the caller: on a full volume SQLite
        cannot even delete (its WAL grows first). A dropped deletion leaves a row without a
        file, which a read treats as missing and the next open drops; a dropped access time
        or kv fact only costs a hint."""
        try:
            self.db.executemany(sql, rows)
            return True
        except sqlite3.Error as exc:
            self._write_failed(OSError(errno.ENOSPC, f"index: {exc}"))
            return False

    def _write_failed(self, exc: OSError) -> None:
        reason = errno.errorcode.get(exc.errno or 0, str(exc))
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
            # The volume refuses writes: stop trying, serve by passing data through.
            self.writable = False
        if not self._write_error_logged:
            log.error("cache: cannot write to %s (%s); serving by passing data through "
                      "until the cache is writable again", self.root, exc)
            self._write_error_logged = True
        self.events.on_write_error(reason)

    def retry_writable(self) -> None:
        """Called periodically: after space was freed, try caching again."""
        if not self.writable:
            self.writable = True
            self._write_error_logged = False

    # -- eviction ----------------------------------------------------------------------------
    def _evict_to(self, limit: int) -> bool:
        with self._lock:
            return self._evict_to_locked(limit)

    def _evict_to_locked(self, limit: int) -> bool:
        """Evict until used + reserved <= limit. False if pinned blocks prevent it."""
        victims = []
        while self.used + self.reserved > limit:
            key = self.policy.victim()
            if key is None:
                break
            rec = self._records.pop(key)
            self.policy.remove(key)
            self.used -= rec.size
            victims.append(key)
        if victims:
            # Index first, files second: a crash between leaves orphan files, never rows
            # without bytes.
            self._index_write("DELETE FROM blocks WHERE version=? AND idx=?", victims)
            for key in victims:
                self.path_for(key).unlink(missing_ok=True)
                self._touched.pop(key, None)
                self._verified.pop(key, None)
            self.events.on_evict(len(victims))
        return self.used + self.reserved <= limit

    def drop(self, key: BlockKey, reason: str) -> None:
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is None:
                return
            self.policy.remove(key)
            self.used -= rec.size
            self._touched.pop(key, None)
            self._verified.pop(key, None)
            self._index_write("DELETE FROM blocks WHERE version=? AND idx=?", [key])
        self.path_for(key).unlink(missing_ok=True)
        log.debug("cache: dropped %s-%d (%s)", key[0], key[1], reason)

    def purge(self, dataset: str | None = None, keep: Container[str] = ()) -> int:
        """Drop every block (of ``dataset``) but those of the versions in ``keep``; returns
        bytes freed."""
        with self._lock:  # puts in worker threads add records meanwhile
            keys = [k for k, r in self._records.items()
                    if (dataset is None or r.dataset == dataset) and k[0] not in keep]
        freed = 0
        for k in keys:
            freed += self._records[k].size if k in self._records else 0
            self.drop(k, "purge")
        return freed

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        self._evict_to(capacity)

    # -- small persistent facts --------------------------------------------------------------
    def object_size(self, version: str) -> int | None:
        with self._lock:
            row = self.db.execute("SELECT size FROM objects WHERE version=?",
                                  (version,)).fetchone()
        return None if row is None else int(row[0])

    def set_object_size(self, version: str, size: int) -> None:
        with self._lock:
            self._index_write("INSERT OR REPLACE INTO objects VALUES (?,?)", [(version, size)])

    def kv_get(self, key: str) -> str | None:
        with self._lock:
            row = self.db.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def kv_set(self, key: str, value: str) -> None:
        with self._lock:
            self._index_write("INSERT OR REPLACE INTO kv VALUES (?,?)", [(key, value)])

    @property
    def lock(self) -> threading.Lock:
        """Held while changing the policy from outside the store (the policy is not
        thread-safe and the store's worker threads use it)."""
        return self._lock

    def kv_items(self, prefix: str) -> list[tuple[str, str]]:
        with self._lock:
            rows = self.db.execute("SELECT key, value FROM kv WHERE key >= ? AND key < ?",
                                   (prefix, prefix + "\uffff")).fetchall()
        return [(str(k), str(v)) for k, v in rows]

    def pin(self, key: BlockKey) -> None:
        with self._lock:
            self.policy.pin(key)

    def unpin(self, key: BlockKey) -> None:
        with self._lock:
            self.policy.unpin(key)

    def stats(self) -> dict[str, object]:
        return {"blocks": len(self._records), "used_bytes": self.used,
                "capacity_bytes": self.capacity, "reserved_bytes": self.reserved,
                "writable": self.writable, "policy": self.policy.name}


def _digest_of(f: BinaryIO, size: int) -> bytes:
    if size == 0:
        return block_digest(b"")
    # mmap: hash the page cache in place, no copy into Python.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # one fault, not 1024
    with mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ) as mm:
        return block_digest(mm)
