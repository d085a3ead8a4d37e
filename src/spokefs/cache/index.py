"""The block index: what a cache folder holds, in SQLite (``index.sqlite``, WAL mode).

This module is the one place that knows the file: its schema, how an older one is brought up
to date, loading it at open, the statements that write it (queued, then committed in
batches) and the queries other processes run against it. Rows come back as ``BlockRow``.

Tables::

    blocks   one row per resident block: where it is (segment id, offset, size), what its
             bytes must hash to (xxh3-128 of the block, xxh3-64 of each chunk), its dataset,
             its last use and when it was written
    objects  version -> object size (what a read past the blocks needs)
    kv       small facts: the format, working sets, ...

``FORMAT`` (kept in ``kv`` as ``store_format``) names the layout of the blocks: 2 is
segment files. An index of another format has its block rows dropped (their bytes are
fetched again); objects and kv are kept. The ``stored`` column came later than format 2: it
is added where missing, and rows without it use their last use instead.

Who writes. The store's event loop queues rows (``insert``, ``delete``, ``touch``, facts)
and never waits on SQL; the store's worker thread commits what is queued in one transaction
(``commit``) every few tens of milliseconds, after flushing the segment files those rows
point into. A crash therefore loses at most the rows of the last moments (their blocks are
fetched again; their regions, written but never indexed, are freed at the next open) and
never makes a row durable before its bytes. Rows whose bytes are torn anyway (a power loss
without fsync) are caught by the digest check on every read.
"""

from __future__ import annotations

import itertools
import operator
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

FILE = "index.sqlite"
FORMAT = "2"  # 1: a file per block under blocks/

_BLOCKS = """CREATE TABLE IF NOT EXISTS blocks (
    version TEXT, idx INTEGER, seg INTEGER, off INTEGER, size INTEGER, digest BLOB,
    chunks BLOB, dataset TEXT, last_access REAL, stored REAL, PRIMARY KEY (version, idx))"""
SCHEMA = f"""
{_BLOCKS};
CREATE TABLE IF NOT EXISTS objects (version TEXT PRIMARY KEY, size INTEGER);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT);
"""

_INSERT = ("INSERT OR REPLACE INTO blocks (version, idx, seg, off, size, digest, chunks, "
           "dataset, last_access, stored) VALUES (?,?,?,?,?,?,?,?,?,?)")
_DELETE = "DELETE FROM blocks WHERE version=? AND idx=?"
_TOUCH = "UPDATE blocks SET last_access=? WHERE version=? AND idx=?"
_SET_OBJECT = "INSERT OR REPLACE INTO objects VALUES (?,?)"
_SET_KV = "INSERT OR REPLACE INTO kv VALUES (?,?)"
_DELETE_KV = "DELETE FROM kv WHERE key=?"
# Every block row, in the columns (and order) of BlockRow; a row from before write times were
# kept has its last use stand in (it can only be later: a time-to-live never runs shorter).
_ROWS = ("SELECT version, idx, seg, off, size, digest, chunks, dataset, "
         "COALESCE(last_access, 0), COALESCE(stored, last_access, 0) FROM blocks")

# SQLite's primary result codes that mean the index file itself is damaged or is not an index.
_CORRUPT_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
_NO_SPACE_CODES = (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)
_FULL_BELOW = 1 << 20  # free bytes under which a volume counts as full


class BlockRow(NamedTuple):
    """One row of ``blocks``."""

    version: str
    idx: int
    seg: int          # segment id (segments/<id>.seg)
    off: int          # offset in the segment (4 KiB-aligned)
    size: int
    digest: bytes     # xxh3-128 of the whole block, as the upstream sent it
    chunks: bytes     # xxh3-64 of each chunk, concatenated
    dataset: str
    last_access: float
    stored: float     # when it was written (time.time())

    @property
    def key(self) -> tuple[str, int]:
        return (self.version, self.idx)


@dataclass(slots=True)
class Loaded:
    """Everything an index holds, read at open."""

    blocks: list[BlockRow] = field(default_factory=list)  # least recently used first
    object_sizes: dict[str, int] = field(default_factory=dict)
    kv: dict[str, str] = field(default_factory=dict)


def connect(path: Path, busy_timeout: float = 30.0) -> sqlite3.Connection:
    """The index, in WAL mode, its tables made if missing. ``busy_timeout``: how long a
    statement waits for a lock another connection holds before it fails with "database is
    locked" (never a reason to wipe)."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                         timeout=busy_timeout)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
    except sqlite3.Error:
        db.close()
        raise
    return db


def _migrate(db: sqlite3.Connection) -> bool:
    """Bring an index to ``FORMAT``; True if block rows of an older format were dropped (the
    caller removes that format's files)."""
    fmt = db.execute("SELECT value FROM kv WHERE key='store_format'").fetchone()
    dropped = False
    if fmt is None or fmt[0] != FORMAT:
        cols = {r[1] for r in db.execute("PRAGMA table_info(blocks)")}
        # No format noted and segment columns there: a format 2 index from before the note.
        if "seg" not in cols or fmt is not None:
            db.execute("DROP TABLE IF EXISTS blocks")
            db.execute(_BLOCKS)
            dropped = True
        db.execute("INSERT OR REPLACE INTO kv VALUES ('store_format', ?)", (FORMAT,))
    if "stored" not in {r[1] for r in db.execute("PRAGMA table_info(blocks)")}:
        db.execute("ALTER TABLE blocks ADD COLUMN stored REAL")
    return dropped


def why_unusable(exc: sqlite3.Error, root: Path) -> str | None:
    """Why an index that failed to open must be dropped, or None to leave it alone. Only two
    reasons: it is damaged, or the volume is too full for SQLite to open it at all (WAL needs
    a -shm file), where dropping it frees the space to start rather than not start (the
    documented behaviour, ``disk_full`` in the chaos suite). Busy or locked (another
    connection, past the busy timeout), an I/O error with space left, or a permission error
    say nothing about the index and never cost the cache."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        text = str(exc)
        return "damaged" if "malformed" in text or "not a database" in text else None
    primary = code & 0xFF  # extended codes carry the primary one in the low byte
    if primary in _CORRUPT_CODES:
        return "damaged"
    if primary in _NO_SPACE_CODES:
        try:
            st = os.statvfs(root)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < _FULL_BELOW:
            return "on a volume too full to open it"
    return None


def remove(root: Path) -> None:
    """Delete a folder's index file (and its WAL and shared-memory files)."""
    for name in (FILE, f"{FILE}-wal", f"{FILE}-shm"):
        (root / name).unlink(missing_ok=True)


class BlockIndex:
    """A cache folder's index, opened by its one owner: loaded at open, then written in
    batches. The queueing methods are for the owner's event loop (cheap: a list append under
    a lock); ``commit`` is for the worker thread."""

    def __init__(self, db: sqlite3.Connection, old_format_dropped: bool = False) -> None:
        self.db = db
        self.old_format_dropped = old_format_dropped  # rows of an older format were dropped
        self._ops: list[tuple[str, tuple[Any, ...]]] = []
        self._lock = threading.Lock()

    @classmethod
    def open(cls, root: Path, busy_timeout: float = 30.0) -> BlockIndex:
        """Open (or make) ``root``'s index and bring it to ``FORMAT``. sqlite3.Error if it
        cannot be (``why_unusable`` says whether to drop it)."""
        db = connect(root / FILE, busy_timeout)
        try:
            dropped = _migrate(db)
        except sqlite3.Error:
            db.close()
            raise
        return cls(db, dropped)

    def load(self) -> Loaded:
        """Every row (blocks least recently used first); sqlite3.Error if the file is
        damaged."""
        db = self.db
        blocks = list(map(BlockRow._make, db.execute(_ROWS + " ORDER BY last_access")))
        sizes = {str(v): int(s) for v, s in db.execute("SELECT version, size FROM objects")}
        kv = {str(k): str(v) for k, v in db.execute("SELECT key, value FROM kv")}
        return Loaded(blocks, sizes, kv)

    # -- queued writes (the owner's loop) ----------------------------------------------------
    def insert(self, key: tuple[str, int], seg: int, off: int, size: int, digest: bytes,
               chunks: bytes, dataset: str, now: float) -> None:
        """A block became resident (written at ``now``, which is also its last use)."""
        params = (key[0], key[1], seg, off, size, digest, chunks, dataset, now, now)
        with self._lock:
            self._ops.append((_INSERT, params))

    def delete(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._ops.append((_DELETE, key))

    def touch(self, used: Iterable[tuple[tuple[str, int], float]]) -> None:
        """Last uses of blocks ((key, time.time()) pairs)."""
        ops = [(_TOUCH, (t, k[0], k[1])) for k, t in used]
        with self._lock:
            self._ops.extend(ops)

    def set_object_size(self, version: str, size: int) -> None:
        with self._lock:
            self._ops.append((_SET_OBJECT, (version, size)))

    def set_kv(self, key: str, value: str) -> None:
        with self._lock:
            self._ops.append((_SET_KV, (key, value)))

    def delete_kv(self, key: str) -> None:
        with self._lock:
            self._ops.append((_DELETE_KV, (key,)))

    # -- commits (the worker thread) ---------------------------------------------------------
    def commit(self, before: Callable[[], None] = lambda: None) -> int:
        """Commit every queued write in one transaction, in the order queued; how many.
        ``before()`` runs first when there is any (the worker flushes the segment files
        there, so no row becomes durable before its bytes). sqlite3.Error if the
        transaction failed: its writes are lost, which costs refetches only (a row missing
        for bytes written is an orphan region, freed at the next open)."""
        with self._lock:
            ops, self._ops = self._ops, []
        if not ops:
            return 0
        before()
        db = self.db
        db.execute("BEGIN")
        try:
            # Runs of one statement go in one executemany (the order between them is kept:
            # a block deleted and written again ends written).
            for sql, run in itertools.groupby(ops, key=operator.itemgetter(0)):
                db.executemany(sql, [params for _, params in run])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return len(ops)

    def close(self) -> None:
        self.db.close()


# -- queries from other connections (any thread, any process) --------------------------------

def use_times(root: Path, busy_timeout: float = 30.0) -> dict[str, tuple[float, float]]:
    """dataset -> (least, most recent use) of its committed blocks (a connection of its own:
    safe in a thread)."""
    db = connect(root / FILE, busy_timeout)
    try:
        rows = db.execute("SELECT dataset, MIN(last_access), MAX(last_access) FROM blocks "
                          "GROUP BY dataset").fetchall()
    finally:
        db.close()
    return {str(ds): (float(lo), float(hi)) for ds, lo, hi in rows}


def committed_blocks(root: Path, timeout: float = 30.0) -> list[BlockRow]:
    """Every committed block row, by segment and offset: read-only, from any process, while
    the owner runs (WAL). Rows the owner has not committed yet are not seen."""
    db = sqlite3.connect(f"file:{root / FILE}?mode=ro", uri=True, timeout=timeout)
    try:
        sql = _ROWS
        if "stored" not in {r[1] for r in db.execute("PRAGMA table_info(blocks)")}:
            sql = sql.replace("stored", "NULL")  # not opened by its owner since (read-only)
        return list(map(BlockRow._make, db.execute(sql + " ORDER BY seg, off")))
    finally:
        db.close()
