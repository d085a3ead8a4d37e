"""The hub's one ledger of a dataset (``SnapshotLedger``), whatever its origin, and the
folder's kind of it (``HubState``: snapshots of a directory tree, remembering the work).

A state directory holds an SQLite database and the encoded manifests. One schema for every
origin (a state folder written by any earlier version opens as it was: each table is created
if missing, columns added since are added, nothing is rewritten):

- ``files``: what the last scan found per path, with the stat identity it was hashed under
  (device, inode, size, mtime, ctime) and its block digests. A rescan re-reads only files
  whose identity changed, so snapshotting a mostly unchanged tree of 100,000 files is a walk
  and some stats. The same table answers "which file holds version V" when a reader asks for
  V's bytes.
- ``objects``, ``digests``: an object store's listed objects by version id, and the block
  digests made as blocks are read (``hub/bucket.py``).
- ``snapshots``: the ordered list of snapshot ids; each id is a digest of the manifest's
  content, so an unchanged tree yields the same id and no new snapshot.
- ``settings``: the block size the state was built with (digests depend on it: kept), and an
  object store's URL (a state folder serves the source it was made for).

What a folder's walk publishes, and how it treats a hostile tree: ``origin/folder.py``.

A scan holds no lock that reads need: it walks and hashes with its own database connection, then
commits in one short transaction and swaps what reads use in one assignment. Scans of one state
folder take turns, in this process and across processes (``scan.lock``, a flock): a hub's
commit of uploads (``hub/uploads.py``) and ``spokefs hub snapshot`` never walk the tree at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from spokefs import integrity
from spokefs.cache.durable import write_durably
from spokefs.errors import ConfigError, Conflict, NotFound
from spokefs.hub.uploads import Incoming, Row
from spokefs.manifest import Manifest
from spokefs.origin.folder import (  # noqa: F401  (re-exported: the hub's names for them)
    READ_FLAGS,
    FolderOrigin,
    Found,
    Identity,
    NotRegularFile,
    identity,
    open_regular,
)

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY, ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER,
    mode INTEGER, version TEXT, digests BLOB, dev INTEGER, src TEXT);
CREATE INDEX IF NOT EXISTS files_version ON files(version);
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, created REAL, files INTEGER,
    bytes INTEGER);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS objects (
    version TEXT PRIMARY KEY, key TEXT, size INTEGER, etag TEXT, version_id TEXT,
    mtime_ns INTEGER);
CREATE TABLE IF NOT EXISTS digests (
    version TEXT, idx INTEGER, digest BLOB, PRIMARY KEY (version, idx)) WITHOUT ROWID;
"""
# Columns added since the first format (``ALTER TABLE`` on an older state, see ``open``). A row
# from before ``dev`` was kept has it NULL: the next scan fills it in without re-hashing.
_ADDED_COLUMNS = {"dev": "INTEGER", "src": "TEXT"}
_INSERT_FILE = ("INSERT OR REPLACE INTO files (path, dev, ino, size, mtime_ns, ctime_ns, mode, "
                "version, digests, src) VALUES (?,?,?,?,?,?,?,?,?,?)")

@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    id: str
    seq: int
    created: float
    files: int
    bytes: int

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "seq": self.seq, "created": self.created, "files": self.files,
                "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class StoredFile:
    """Where a version's bytes live now (a symlink's target for an entry published through
    one), and the identity they were hashed under (``dev`` is None in a state from before it
    was kept, until the next scan: such a row matches no file, so it is refused, never
    misread)."""

    path: str
    dev: int | None
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    digests: bytes

    @property
    def identity(self) -> tuple[int | None, int, int, int, int]:
        return (self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns)


@dataclass(frozen=True, slots=True)
class LedgerView:
    """What reads use, replaced whole in one assignment (never seen half updated)."""

    snaps: list[SnapshotInfo]
    by_version: dict[str, Any]  # version -> what the source holds for it (a file, an object)
    data_version: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    snapshot: SnapshotInfo
    created_new: bool
    files_hashed: int
    bytes_hashed: int


def default_state_dir(source: bytes, name: str) -> Path:
    """``~/.local/state/spokefs/hub/NAME-TAG``, TAG a digest of the source (a folder's
    resolved path; an object store's endpoint and URL: ``state_tag``)."""
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    tag = hashlib.blake2b(source, digest_size=4).hexdigest()
    return base / "spokefs" / "hub" / f"{name}-{tag}"


def folder_tag(root: Path) -> bytes:
    # fsencode: the same bytes as str.encode() for a UTF-8 path, and no error for others.
    return os.fsencode(root.resolve())


@contextlib.contextmanager
def write_transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` (the write lock now, so two processes writing the same state wait
    for each other rather than fail at commit), then COMMIT, or ROLLBACK on any error. For
    connections opened with ``isolation_level=None``."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


class SnapshotLedger:
    """What a hub keeps of a dataset in its state folder, whatever its origin (a folder:
    ``HubState``, an object store: ``hub.bucket.BucketState``): snapshots in SQLite, their
    manifests as files, and a view of both that reads use. One schema and one ``open`` for
    every kind; a kind says what its rows are (``_load_rows``) and how it scans (``scan``,
    recording the snapshot with ``_publish``)."""

    kind = ""                 # "folder" or "bucket": what status and a mismatch name
    content_ids = False       # whether its version ids digest content (DatasetInfo)
    root: object              # what status shows as the source (a path, a URL)

    def __init__(self, state_dir: Path, name: str, block_size: int) -> None:
        self.state_dir = state_dir
        self.name = name
        self.block_size = block_size
        # The readers' connection (``refresh`` on the event loop, loads after a scan). A scan
        # holds this lock only to commit and reload; ``refresh`` never waits for it.
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()
        # What reads ask, kept in memory (a read by version is a dict lookup, not SQL):
        # replaced whole after a scan here, or when another process (``spokefs hub
        # snapshot``) committed to the state database (``refresh``).
        self._view = LedgerView([], {}, -1)

    # -- lifecycle ---------------------------------------------------------------------------
    def _source_key(self) -> str | None:
        """What the state folder is pinned to (an object store's URL), or None (a folder: a
        state may follow its folder when it moves, as it always could)."""
        return None

    def _connect(self, check_same_thread: bool = True) -> sqlite3.Connection:
        db = sqlite3.connect(self.state_dir / "state.sqlite", check_same_thread=check_same_thread,
                             isolation_level=None, timeout=30)
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def open(self) -> SnapshotLedger:
        (self.state_dir / "manifests").mkdir(parents=True, exist_ok=True)
        db = self._connect(check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        source = self._source_key()
        try:
            with write_transaction(db):  # another process may be upgrading the same state
                have = {r[1] for r in db.execute("PRAGMA table_info(files)")}
                for col, kind in _ADDED_COLUMNS.items():
                    if col not in have:
                        db.execute(f"ALTER TABLE files ADD COLUMN {col} {kind}")
                db.execute("INSERT OR IGNORE INTO settings VALUES ('block_size', ?)",
                           (str(self.block_size),))
                # Block digests depend on the block size: keep the one the state was built with.
                self.block_size = int(db.execute(
                    "SELECT value FROM settings WHERE key='block_size'").fetchone()[0])
                if source is not None:
                    db.execute("INSERT OR IGNORE INTO settings VALUES ('source', ?)", (source,))
                    row = db.execute("SELECT value FROM settings WHERE key='source'").fetchone()
                    if row[0] != source:
                        raise ConfigError(f"state folder {self.state_dir} belongs to {row[0]}, "
                                          f"not {source}: give another --state-dir")
                    if db.execute("SELECT 1 FROM files LIMIT 1").fetchone() is not None:
                        raise ConfigError(f"state folder {self.state_dir} belongs to a folder "
                                          f"dataset, not {source}: give another --state-dir")
                elif db.execute("SELECT 1 FROM objects LIMIT 1").fetchone() is not None:
                    raise ConfigError(f"state folder {self.state_dir} belongs to a bucket "
                                      "dataset, not a folder: give another --state-dir")
        except BaseException:
            db.close()
            raise
        self._db = db
        with self._db_lock:
            self._load_locked()
        return self

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"{type(self).__name__}.open() was not called")
        return self._db

    def _load_rows(self, db: sqlite3.Connection) -> dict[str, Any]:
        """version -> what the source holds for it, in the caller's read transaction."""
        raise NotImplementedError

    def _load_locked(self) -> None:
        """Read what reads use from the database and publish it (caller holds ``_db_lock``)."""
        db = self.db
        db.execute("BEGIN")  # snapshots and rows from one commit
        try:
            version = db.execute("PRAGMA data_version").fetchone()[0]
            snaps = [SnapshotInfo(*r) for r in db.execute(
                "SELECT id, seq, created, files, bytes FROM snapshots ORDER BY seq")]
            by_version = self._load_rows(db)
        finally:
            db.execute("COMMIT")
        self._view = LedgerView(snaps, by_version, version)

    def stored(self, version: str) -> Any:
        """What the source holds for ``version`` (a file, an object), None if not known."""
        return self._view.by_version.get(version)

    def status(self) -> dict[str, object]:
        snaps = self.snapshots()
        return {"name": self.name, "root": str(self.root), "snapshots": len(snaps),
                "latest": snaps[-1].to_json() if snaps else None}

    def refresh(self) -> bool:
        """Reload what reads use if another process committed a scan; True if it did. Never
        waits: while a scan in this process commits, it publishes what it wrote itself."""
        if self._db is None or not self._db_lock.acquire(blocking=False):
            return False  # closed (a dataset removed from the namespace), or a scan commits
        try:
            version = self.db.execute("PRAGMA data_version").fetchone()[0]
            if version == self._view.data_version:
                return False
            self._load_locked()
            return True
        finally:
            self._db_lock.release()

    def usable(self) -> str | None:
        """None when reads can use this ledger (``/readyz``): its database is open and
        answers, and its manifests' folder is there; else a generic reason. Blocking (a
        stat and a query): for a thread."""
        if self._db is None:
            return "a dataset's state is not open"
        if not (self.state_dir / "manifests").is_dir():
            return "a dataset's state folder is gone"
        if self._db_lock.acquire(blocking=False):  # held: a scan commits, so it answers
            try:
                self._db.execute("PRAGMA data_version").fetchone()
            except sqlite3.Error:
                return "a dataset's state database fails"
            finally:
                self._db_lock.release()
        return None

    def snapshots(self) -> list[SnapshotInfo]:
        return self._view.snaps

    def resolve(self, snap: str) -> SnapshotInfo:
        snaps = self._view.snaps
        if snap == "latest":
            if snaps:
                return snaps[-1]
        else:
            for s in snaps:
                if s.id == snap:
                    return s
        raise NotFound(f"dataset {self.name!r} has no snapshot {snap!r}")

    def manifest_path(self, snap_id: str) -> Path:
        return self.state_dir / "manifests" / f"{snap_id}.json.gz"

    def _publish(self, db: sqlite3.Connection, m: Manifest) -> tuple[SnapshotInfo, bool]:
        """Record ``m`` (no id, no creation time yet) as the latest snapshot, in the caller's
        transaction; (the snapshot, whether it is new). The same content as the latest is
        not new; content equal to an earlier snapshot's is listed again as the latest."""
        snap_id = m.content_id()
        existing = db.execute("SELECT id, seq, created, files, bytes FROM snapshots "
                              "WHERE id=?", (snap_id,)).fetchone()
        latest = db.execute("SELECT id FROM snapshots ORDER BY seq DESC LIMIT 1").fetchone()
        if existing is not None and latest is not None and latest[0] == snap_id:
            return SnapshotInfo(*existing), False
        created = time.time()
        m = Manifest(self.name, snap_id, created, m.block_size, m.paths, m.sizes, m.modes,
                     m.mtimes, m.versions, m.dirs)
        # The manifest durable (fsync'd, renamed in, folder fsync'd) before the snapshot is
        # listed: a crash never leaves a listed snapshot without its manifest.
        write_durably(self.manifest_path(snap_id), m.encode())
        if existing is not None:
            db.execute("DELETE FROM snapshots WHERE id=?", (snap_id,))
        cur = db.execute("INSERT INTO snapshots (id, created, files, bytes) VALUES (?,?,?,?)",
                         (snap_id, created, len(m.paths), m.total_bytes))
        return SnapshotInfo(snap_id, int(cur.lastrowid or 0), created, len(m.paths),
                            m.total_bytes), True


class HubState(SnapshotLedger):
    """A folder's ledger: scanned files, snapshots, manifests (SQLite + files)."""

    kind = "folder"
    content_ids = True  # a folder's version ids digest its content (integrity.version_id)

    def __init__(self, root: Path, state_dir: Path, name: str,
                 block_size: int = integrity.DEFAULT_BLOCK_SIZE, writable: bool = False) -> None:
        super().__init__(state_dir, name, block_size)
        self.origin = FolderOrigin(root)
        self.root = self.origin.root
        self.writable = writable  # takes uploads and commits (hub/uploads.py)
        self._scan_lock = threading.Lock()  # one scan at a time in this process
        self.uploads: Incoming | None = None  # after open(): the block size is the state's

    def open(self) -> HubState:
        self.origin.check()
        super().open()
        self.uploads = Incoming(self.root, self.state_dir, self.block_size)
        return self

    @contextlib.contextmanager
    def _scanning(self) -> Iterator[None]:
        """This state's scan turn: one thread here, one process on the state folder."""
        with self._scan_lock:
            fd = os.open(self.state_dir / "scan.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def usable(self) -> str | None:
        """The ledger's check, and the dataset's folder still a folder."""
        return self.origin.usable() or super().usable()

    def _load_rows(self, db: sqlite3.Connection) -> dict[str, Any]:
        return {r[0]: StoredFile(*r[1:]) for r in db.execute(
            "SELECT version, COALESCE(src, path), dev, ino, size, mtime_ns, ctime_ns, "
            "digests FROM files")}

    def stored(self, version: str) -> StoredFile | None:
        return self._view.by_version.get(version)

    # -- scanning ----------------------------------------------------------------------------
    def _walk(self) -> tuple[dict[str, Found], list[str]]:
        return self.origin.walk()

    def _hash_file(self, path: str, listed: os.stat_result, progress: Callable[[int], object]
                   ) -> tuple[os.stat_result, list[bytes]]:
        return self.origin.hash_file(path, listed, self.block_size, progress)

    def scan(self, show_progress: bool = False) -> ScanResult:
        """Walk the tree, hash what changed, and record a snapshot if the content changed.
        Reads go on meanwhile: the walk and the hashing hold nothing they use."""
        _ = self.db  # raises if open() was not called
        with self._scanning():
            return self._scan_turn(show_progress)[0]

    def commit(self, paths: list[str] | None, prefix: str | None
               ) -> tuple[ScanResult, list[str]]:
        """Publish whole uploads (``paths``, or every one under ``prefix``) together: their
        journal, then a scan that places and records them (``hub/uploads.py``)."""
        assert self.uploads is not None, "open() was not called"
        with self._scanning():
            journal, chosen = self.uploads.prepare(paths, prefix)
            result, failed = self._scan_turn(False)
        if journal.name in failed:
            raise Conflict(f"nothing was published: {failed[journal.name]}")
        return result, chosen

    def _scan_turn(self, show_progress: bool) -> tuple[ScanResult, dict[str, str]]:
        """A scan, in this state's turn: commits journalled (a crash's left included) are
        finished first; the scan, and the commits that published nothing, with why."""
        assert self.uploads is not None
        placed = self.uploads.place()
        db = self._connect()
        try:
            result = self._scan(db, show_progress, placed.rows)
        finally:
            db.close()
        self.uploads.retire(placed.done)
        self.uploads.expire()
        return result, placed.failed

    def _scan(self, db: sqlite3.Connection, show_progress: bool,
              placed: list[Row] | None = None) -> ScanResult:
        """``placed``: rows of files a commit put in place now, digested as they came in:
        recorded as they are when the walk finds them so (no second hashing)."""
        files, dirs = self._walk()
        known = {r[0]: r[1:] for r in db.execute(
            "SELECT path, dev, ino, size, mtime_ns, ctime_ns, src FROM files")}
        todo: list[str] = []
        refill: list[tuple[int, str | None, str]] = []  # unchanged, but dev or src to record
        digested = {r[0]: r for r in placed or ()}
        rows: list[tuple[object, ...]] = []
        for p, (st, src) in files.items():
            r = digested.get(p)
            if r is not None and src is None and r[1:6] == identity(st):
                rows.append(r)
                continue
            k = known.get(p)
            if (k is None or k[1:5] != (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                    or k[0] not in (None, st.st_dev)):
                todo.append(p)
            elif k[0] is None or k[5] != src:
                refill.append((st.st_dev, src, p))
        todo_bytes = sum(files[p][0].st_size for p in todo)
        bar = tqdm(total=todo_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"hashing {len(todo)} files", disable=not show_progress or not todo,
                   leave=False)
        n_placed = len(rows)
        hashed_bytes = 0
        try:
            for path in sorted(todo):
                listed, src = files[path]
                try:
                    st, digests = self._hash_file(src or path, listed, bar.update)
                except OSError as exc:
                    log.warning("skipping %r: %s", path, exc)
                    files.pop(path)
                    continue
                hashed_bytes += st.st_size
                version = integrity.version_id(st.st_size, self.block_size, digests)
                rows.append((path, *identity(st), st.st_mode & 0o7777, version,
                             b"".join(digests), src))
        finally:
            bar.close()
        gone = [(p,) for p in known if p not in files]
        # Reads skip their refresh while this holds the lock, and see the new state at once.
        with self._db_lock:
            with write_transaction(db):
                db.executemany(_INSERT_FILE, rows)
                db.executemany("UPDATE files SET dev=?, src=? WHERE path=?", refill)
                db.executemany("DELETE FROM files WHERE path=?", gone)
                result = self._record_snapshot(db, dirs, len(rows) - n_placed, hashed_bytes)
            self._load_locked()
        if result.created_new:
            s = result.snapshot
            log.info("snapshot %s of %s: %d files, %d bytes (%d files hashed, %d committed)",
                     s.id, self.name, s.files, s.bytes, len(rows) - n_placed, n_placed)
        return result

    def _record_snapshot(self, db: sqlite3.Connection, dirs: list[str], n_hashed: int,
                         hashed_bytes: int) -> ScanResult:
        rows = db.execute(
            "SELECT path, size, mode, mtime_ns, version FROM files ORDER BY path").fetchall()
        paths = [r[0] for r in rows]
        m = Manifest(self.name, "", 0.0, self.block_size, paths, [r[1] for r in rows],
                     [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows], dirs)
        info, new = self._publish(db, m)
        return ScanResult(info, new, n_hashed, hashed_bytes)
