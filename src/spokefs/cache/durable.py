"""Metadata a spoke keeps on disk (manifests), written so a crash never leaves a bad copy and
read back only after a check.

Blocks need no fsync of their own (every read checks them against their digests, see
spokefs.cache.store); a manifest file is different: a spoke serves it as it is and plans from
it, so it must be whole. ``write_durably`` writes a temporary file, flushes it, renames it into
place and flushes the folder: after a crash the name holds the old file, the new one or
nothing, never a torn one. ``load_manifest_checked`` still checks what it reads (a disk can
lose what it acknowledged, a person can edit a file): a copy that does not decode or does not
match its snapshot id is deleted and reported missing, and the caller fetches it again.

Paths are built from names that may come from upstream (a dataset's ``latest`` snapshot id):
``manifest_file`` checks both names right before it joins them, so nothing can lead out of the
folder.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

from spokefs.errors import BadRequest, ManifestError
from spokefs.manifest import MAX_MANIFEST_BLOB, is_snapshot_id, verify
from spokefs.wire.paths import check_dataset_name

log = logging.getLogger(__name__)

ALIGN = 4096  # direct I/O's alignment of memory, offsets and lengths (and of cache regions)


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class DirectReader:
    """Reads of one file past the page cache: direct I/O into one reused page-aligned
    buffer, then copied out, so a large file read once (an upload's part on its way to the
    hub, or into the cache) fills no page cache and pushes none of the node's own pages out.
    Where the filesystem offers no direct I/O, plain ``pread``. Not thread-safe: one reader
    at a time."""

    def __init__(self, path: Path, most: int) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.dfd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:
            self.dfd = None
        self._buf: mmap.mmap | None = None
        self._most = most

    def read(self, at: int, n: int) -> bytes:
        """Up to ``n`` (at most ``most``) bytes from ``at``; short only at the file's end."""
        if self.dfd is None:
            return os.pread(self.fd, n, at)
        lo = at - at % ALIGN
        span = aligned(at + n - lo)  # whole pages covering [at, at + n)
        if self._buf is None or len(self._buf) < span:
            if self._buf is not None:
                self._buf.close()
            self._buf = mmap.mmap(-1, max(span, aligned(self._most) + ALIGN))
        view = memoryview(self._buf)
        try:
            got = 0
            while got < span:  # the kernel may take a direct read in parts
                k = os.preadv(self.dfd, [view[got:span]], lo + got)
                if k <= 0 or k % ALIGN:
                    got += max(k, 0)
                    break  # the file's end (a last, partial page)
                got += k
            return bytes(view[at - lo:min(got, at - lo + n)])
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # A device whose direct I/O wants more than 4 KiB alignment: plain reads.
            os.close(self.dfd)
            self.dfd = None
            return os.pread(self.fd, n, at)
        finally:
            view.release()

    def close(self) -> None:
        os.close(self.fd)
        if self.dfd is not None:
            os.close(self.dfd)
        if self._buf is not None:
            self._buf.close()


def open_direct(path: Path) -> int | None:
    """``path`` opened for writing with direct I/O (writes skip the page cache: page-aligned
    memory, 4 KiB-aligned offsets and lengths), or None where the filesystem offers none
    (EINVAL: tmpfs before Linux 6.6); the caller then writes through its buffered descriptor."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return None

# Files checked since they were last changed, so a manifest a spoke serves to every mount that
# starts is decoded once per process, not once per request (a million-file manifest takes ~1 s
# to check). Any write through the filesystem changes the ctime (which no one can set back),
# so a changed file is checked again; rot below the filesystem is caught at the next start.
_Stat = tuple[int, int, int, int, int]
_checked: dict[str, _Stat] = {}
_checked_lock = threading.Lock()
_CHECKED_KEEP = 256


def write_durably(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old content or the new, whole:
    temporary file, fsync, rename, fsync of the folder (and of any folder made for it)."""
    folder = path.parent
    _make_dirs(folder)
    # A name of its own per process and thread: two loads may write one file at once.
    tmp = folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)


def manifest_file(root: Path, dataset: str, snapshot_id: str) -> Path:
    """``root/manifests/<dataset>/<snapshot_id>.json.gz``, after checking that the dataset is a
    dataset name and the id a snapshot id (12 lower-case hex digits): ManifestError otherwise,
    so an id from upstream such as ``../../x`` never becomes a path."""
    try:
        check_dataset_name(dataset)
    except BadRequest as exc:
        raise ManifestError(f"refusing a manifest path: {exc}") from None
    if not is_snapshot_id(snapshot_id):
        raise ManifestError(f"refusing a manifest path: {snapshot_id[:80]!r} is not a "
                            "snapshot id (12 lower-case hex digits)")
    return root / "manifests" / dataset / f"{snapshot_id}.json.gz"


def store_manifest(path: Path, blob: bytes, snapshot_id: str, dataset: str | None = None
                   ) -> None:
    """Check ``blob`` is the manifest of ``snapshot_id`` (ManifestError if not: nothing is
    written), then write it durably."""
    verify(blob, snapshot_id, dataset)
    write_durably(path, blob)
    try:
        _remember(path, os.stat(path))
    except OSError:
        pass


def load_manifest_checked(path: Path, snapshot_id: str, dataset: str | None = None
                          ) -> bytes | None:
    """The manifest kept at ``path`` if it decodes and matches ``snapshot_id`` (and
    ``dataset``); None if there is none, or if it fails the check -- then it is deleted (and
    logged), and the caller fetches it again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        # Larger than any manifest is kept: not read at all (it would only fail the check).
        blob = _read_all(fd, st.st_size) if st.st_size <= MAX_MANIFEST_BLOB else None
    except OSError as exc:
        log.warning("cannot read the kept manifest %s (%s); fetching it again", path, exc)
        return None
    finally:
        os.close(fd)
    if blob is not None and _was_checked(path, st):
        return blob
    try:
        if blob is None:
            raise ManifestError(f"{st.st_size} bytes, more than {MAX_MANIFEST_BLOB}")
        verify(blob, snapshot_id, dataset)
    except ManifestError as exc:
        log.warning("kept manifest %s is damaged (%s); deleted, fetching it again", path, exc)
        _forget(path)
        try:  # only the file we read: a good copy renamed in meanwhile stays
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                path.unlink()
        except OSError:
            pass
        return None
    _remember(path, st)
    return blob


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    while True:
        piece = os.read(fd, max(size, 1 << 20))
        if not piece:
            return b"".join(chunks)
        chunks.append(piece)


def _key(st: os.stat_result) -> _Stat:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _was_checked(path: Path, st: os.stat_result) -> bool:
    with _checked_lock:
        return _checked.get(str(path)) == _key(st)


def _remember(path: Path, st: os.stat_result) -> None:
    with _checked_lock:
        _checked[str(path)] = _key(st)
        while len(_checked) > _CHECKED_KEEP:
            _checked.pop(next(iter(_checked)))


def _forget(path: Path) -> None:
    with _checked_lock:
        _checked.pop(str(path), None)


def _make_dirs(folder: Path) -> None:
    """``mkdir -p``, flushing the parent of each folder made (its entry is metadata too)."""
    missing = []
    at = folder
    while not at.is_dir():
        missing.append(at)
        at = at.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue  # made meanwhile by another thread, which flushes it
        _fsync_dir(d.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # cannot flush a folder here
            raise
    finally:
        os.close(fd)
