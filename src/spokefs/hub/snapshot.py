"""Building snapshots of a directory tree, remembering the work.

The hub's state directory holds an SQLite database and the encoded manifests:

- ``files``: what the last scan found per path, with the stat identity it was hashed under
  (inode, size, mtime, ctime) and its block digests. A rescan re-reads only files whose identity
  changed, so snapshotting a mostly unchanged tree of 100,000 files is a walk and some stats.
  The same table answers "which file holds version V" when a reader asks for V's bytes.
- ``snapshots``: the ordered list of snapshot ids; each id is a digest of the manifest's
  content, so an unchanged tree yields the same id and no new snapshot.

Nothing outside the root is ever published: symlinks are followed only when their target lies
inside the root, and then the entry is the target's content.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import stat as statmod
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from spokefs import integrity
from spokefs.errors import ConfigError, NotFound
from spokefs.manifest import Manifest

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY, ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER,
    mode INTEGER, version TEXT, digests BLOB);
CREATE INDEX IF NOT EXISTS files_version ON files(version);
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, created REAL, files INTEGER,
    bytes INTEGER);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT);
"""


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
    """Where a version's bytes live now, and the identity they were hashed under."""

    path: str
    ino: int
    size: int
    mtime_ns: int
    digests: bytes


@dataclass(frozen=True, slots=True)
class ScanResult:
    snapshot: SnapshotInfo
    created_new: bool
    files_hashed: int
    bytes_hashed: int


def default_state_dir(root: Path, name: str) -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    tag = hashlib.blake2b(str(root.resolve()).encode(), digest_size=4).hexdigest()
    return base / "spokefs" / "hub" / f"{name}-{tag}"


class HubState:
    """The hub's memory of one dataset: scanned files, snapshots, manifests (SQLite + files)."""

    def __init__(self, root: Path, state_dir: Path, name: str,
                 block_size: int = integrity.DEFAULT_BLOCK_SIZE) -> None:
        self.root = root.resolve()
        self.state_dir = state_dir
        self.name = name
        self.block_size = block_size
        self._db: sqlite3.Connection | None = None
        self._lock = threading.RLock()  # scans run in a worker thread; reads in the loop
        # What reads ask, kept in memory (a read by version is a dict lookup, not SQL):
        # replaced whole after a scan here, or when another process (``spokefs hub
        # snapshot``) committed to the state database (``refresh``).
        self._snaps: list[SnapshotInfo] = []
        self._by_version: dict[str, StoredFile] = {}
        self._data_version = -1

    # -- lifecycle ---------------------------------------------------------------------------
    def open(self) -> HubState:
        if not self.root.is_dir():
            raise ConfigError(f"dataset directory {self.root} does not exist or is not a folder")
        (self.state_dir / "manifests").mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.state_dir / "state.sqlite", check_same_thread=False,
                             isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        row = db.execute("SELECT value FROM settings WHERE key='block_size'").fetchone()
        if row is None:
            db.execute("INSERT INTO settings VALUES ('block_size', ?)", (str(self.block_size),))
        elif int(row[0]) != self.block_size:
            # Block digests depend on the block size: keep the one the state was built with.
            self.block_size = int(row[0])
        self._db = db
        self._load()
        return self

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("HubState.open() was not called")
        return self._db

    # -- queries -----------------------------------------------------------------------------
    def _load(self) -> None:
        with self._lock:
            version = self.db.execute("PRAGMA data_version").fetchone()[0]
            snaps = [SnapshotInfo(*r) for r in self.db.execute(
                "SELECT id, seq, created, files, bytes FROM snapshots ORDER BY seq")]
            by_version = {r[0]: StoredFile(*r[1:]) for r in self.db.execute(
                "SELECT version, path, ino, size, mtime_ns, digests FROM files")}
        self._snaps, self._by_version, self._data_version = snaps, by_version, version

    def refresh(self) -> bool:
        """Reload what reads use if another process committed a scan; True if it did."""
        with self._lock:
            version = self.db.execute("PRAGMA data_version").fetchone()[0]
        if version == self._data_version:
            return False
        self._load()
        return True

    def snapshots(self) -> list[SnapshotInfo]:
        return self._snaps

    def resolve(self, snap: str) -> SnapshotInfo:
        snaps = self._snaps
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

    def stored(self, version: str) -> StoredFile | None:
        return self._by_version.get(version)

    # -- scanning ----------------------------------------------------------------------------
    def _walk(self) -> tuple[dict[str, os.stat_result], list[str]]:
        """Every publishable file (path -> stat of its content) and every directory."""
        files: dict[str, os.stat_result] = {}
        dirs = [""]
        stack = [""]
        root = str(self.root)
        while stack:
            rel = stack.pop()
            try:
                it = os.scandir(os.path.join(root, rel) if rel else root)
            except OSError as exc:
                log.warning("skipping unreadable folder %r: %s", rel or ".", exc)
                continue
            with it:
                for de in it:
                    path = f"{rel}/{de.name}" if rel else de.name
                    try:
                        if de.is_symlink():
                            target = os.path.realpath(de.path)
                            if os.path.commonpath([root, target]) != root:
                                log.warning("skipping %r: symlink points outside the dataset", path)
                                continue
                            st = os.stat(target)
                            if statmod.S_ISREG(st.st_mode):
                                files[path] = st
                            continue  # symlinked folders are not followed (no cycles)
                        st = de.stat(follow_symlinks=False)
                    except OSError as exc:
                        log.warning("skipping %r: %s", path, exc)
                        continue
                    if statmod.S_ISDIR(st.st_mode):
                        dirs.append(path)
                        stack.append(path)
                    elif statmod.S_ISREG(st.st_mode):
                        files[path] = st
        dirs.sort()
        return files, dirs

    def _hash_file(self, path: str, size: int, progress: Callable[[int], object]) -> list[bytes]:
        digests = []
        with open(os.path.join(self.root, path), "rb", buffering=0) as f:
            remaining = size
            while remaining > 0:
                data = f.read(min(self.block_size, remaining))
                if not data:
                    raise OSError(f"{path} shrank while it was being read")
                digests.append(integrity.block_digest(data))
                remaining -= len(data)
                progress(len(data))
        return digests

    def scan(self, show_progress: bool = False) -> ScanResult:
        """Walk the tree, hash what changed, and record a snapshot if the content changed."""
        with self._lock:
            files, dirs = self._walk()
            known = {r[0]: r[1:] for r in self.db.execute(
                "SELECT path, ino, size, mtime_ns, ctime_ns, version FROM files")}
            todo = [p for p, st in files.items()
                    if known.get(p, (None,) * 5)[:4]
                    != (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)]
            todo_bytes = sum(files[p].st_size for p in todo)
            bar = tqdm(total=todo_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"hashing {len(todo)} files", disable=not show_progress or not todo,
                       leave=False)
            hashed_bytes = 0
            try:
                self.db.execute("BEGIN")
                for path in sorted(todo):
                    st = files[path]
                    try:
                        digests = self._hash_file(path, st.st_size, bar.update)
                    except OSError as exc:
                        log.warning("skipping %r: %s", path, exc)
                        files.pop(path)
                        continue
                    hashed_bytes += st.st_size
                    version = integrity.version_id(st.st_size, self.block_size, digests)
                    self.db.execute(
                        "INSERT OR REPLACE INTO files VALUES (?,?,?,?,?,?,?,?)",
                        (path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                         st.st_mode & 0o7777, version, b"".join(digests)))
                gone = [(p,) for p in known if p not in files]
                self.db.executemany("DELETE FROM files WHERE path=?", gone)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            finally:
                bar.close()
            result = self._record_snapshot(dirs, len(todo), hashed_bytes)
            self._load()
            return result

    def _record_snapshot(self, dirs: list[str], n_hashed: int, hashed_bytes: int) -> ScanResult:
        rows = self.db.execute(
            "SELECT path, size, mode, mtime_ns, version FROM files ORDER BY path").fetchall()
        paths = [r[0] for r in rows]
        m = Manifest(self.name, "", 0.0, self.block_size, paths, [r[1] for r in rows],
                     [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows], dirs)
        snap_id = hashlib.blake2b(m.identity(), digest_size=6).hexdigest()
        existing = self.db.execute("SELECT id, seq, created, files, bytes FROM snapshots "
                                   "WHERE id=?", (snap_id,)).fetchone()
        latest = self.db.execute("SELECT id FROM snapshots ORDER BY seq DESC LIMIT 1").fetchone()
        if existing is not None and latest is not None and latest[0] == snap_id:
            return ScanResult(SnapshotInfo(*existing), False, n_hashed, hashed_bytes)
        created = time.time()
        m = Manifest(self.name, snap_id, created, self.block_size, m.paths, m.sizes, m.modes,
                     m.mtimes, m.versions, m.dirs)
        target = self.manifest_path(snap_id)
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(m.encode())
        os.replace(tmp, target)  # manifest on disk before the snapshot is listed
        if existing is not None:  # the tree went back to an earlier state: list it again
            self.db.execute("DELETE FROM snapshots WHERE id=?", (snap_id,))
        cur = self.db.execute("INSERT INTO snapshots (id, created, files, bytes) VALUES (?,?,?,?)",
                              (snap_id, created, len(paths), m.total_bytes))
        info = SnapshotInfo(snap_id, int(cur.lastrowid or 0), created, len(paths), m.total_bytes)
        log.info("snapshot %s of %s: %d files, %d bytes (%d files hashed)", snap_id, self.name,
                 len(paths), m.total_bytes, n_hashed)
        return ScanResult(info, True, n_hashed, hashed_bytes)
