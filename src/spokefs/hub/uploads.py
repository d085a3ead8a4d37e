"""A writable folder dataset's way in: uploads received beside the tree, checked whole
against the version their writer declared, and published together by a commit as one new
snapshot. A reader anywhere sees a committed set of files whole or not at all.

Where things are (the folder's own filesystem, so publishing a file is a link, not a copy):

    ROOT/.spokefs-incoming/KEY.part    the bytes received so far (KEY: a digest of the path)
    ROOT/.spokefs-incoming/KEY.json    path, size, version declared; once whole and checked,
                                       its block digests and the identity they were made on
    STATE/commits/ID.json              a commit under way (durable before its first link)

The walk never publishes ``INCOMING`` (``origin/folder.py``). An upload resumes from the
bytes received (``received``: the part's length, flushed before each answer); the last
byte makes the hub read the part back and digest it with the dataset's block size: bytes
that are not the version declared are dropped (``DigestMismatch``), and the writer sends
the file again. A commit names whole uploads (paths, or every one under a prefix), is
written to its journal, then each part is linked to its path (``link``: never replaces a
file that is there, so a published version stays readable) and the state scans, recording
the files with the digests made here (nothing is hashed twice). A state with a journal left
by a crash finishes it in its next scan, before the walk: a snapshot holds all of a
commit's files or none.

A writable dataset only grows: a commit may not name a path the folder has. One writer
region per dataset (docs/checkpoints.md); the hub serialises uploads of one path.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import stat as statmod
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spokefs import integrity
from spokefs.cache.durable import write_durably
from spokefs.errors import BadRequest, Conflict, DigestMismatch, NoSpace, NotFound
from spokefs.origin.folder import INCOMING
from spokefs.wire.paths import clean_path

log = logging.getLogger(__name__)

MAX_FILE = 1 << 44          # bytes of one uploaded file (16 TiB): a bound, not a quota
MAX_PATH = 4096             # bytes of a path, as Linux's PATH_MAX
MAX_NAME = 255              # bytes of one component, as Linux's NAME_MAX
WRITE_CHUNK = 4 << 20       # bytes gathered before one write (a thread hop each)
COMMIT_MOST = 100_000       # uploads one commit publishes
ABANDONED_AFTER = 7 * 86400  # seconds an upload may sit untouched, uncommitted, before the
                             # next scan drops it (as S3 lifecycles abort multipart uploads)

Row = tuple[str, int, int, int, int, int, int, str, bytes, None]  # snapshot.py's files row


def check_upload_path(raw: str) -> str:
    """A path an upload may publish: relative, no ``.``/``..``, within Linux's bounds, not
    the hub's own folder."""
    path = clean_path(raw)
    if not path:
        raise BadRequest("an upload needs a file path inside the dataset")
    if len(path.encode()) > MAX_PATH or any(len(p.encode()) > MAX_NAME for p in path.split("/")):
        raise BadRequest(f"path {path[:80]!r}... is longer than {MAX_PATH} bytes or has a "
                         f"part longer than {MAX_NAME}")
    if path.split("/")[0] == INCOMING:
        raise BadRequest(f"{INCOMING} is the hub's own folder; pick another path")
    return path


@dataclass(slots=True)
class Upload:
    """What an upload declared, and once whole and checked, what it digests to."""

    path: str
    size: int
    version: str
    digests: bytes | None = None           # None until whole and checked
    identity: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) when checked

    @property
    def whole(self) -> bool:
        return self.digests is not None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "version": self.version,
                "digests": self.digests.hex() if self.digests is not None else None,
                "identity": list(self.identity) if self.identity is not None else None}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Upload:
        digests = doc.get("digests")
        ident = doc.get("identity")
        return cls(str(doc["path"]), int(doc["size"]), str(doc["version"]),
                   bytes.fromhex(digests) if digests is not None else None,
                   (int(ident[0]), int(ident[1]), int(ident[2])) if ident else None)


def _key(path: str) -> str:
    return hashlib.blake2b(path.encode(), digest_size=16).hexdigest()


def _fsync_dir(fd: int) -> None:
    os.fsync(fd)


def _fsync_dir_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Incoming:
    """One writable dataset's uploads (``root``: its folder; ``state_dir``: its ledger's
    folder, where commits are journalled). Receiving is async (a thread per gathered write);
    a commit's links are blocking (``place``, called by the ledger's scan)."""

    def __init__(self, root: Path, state_dir: Path, block_size: int) -> None:
        self.root = root
        self.dir = root / INCOMING
        self.journals = state_dir / "commits"
        self.block_size = block_size
        self._busy: set[str] = set()   # paths being received now: one writer each

    # -- what is held -------------------------------------------------------------------------
    def _meta(self, key: str) -> Upload | None:
        try:
            return Upload.from_json(json.loads((self.dir / f"{key}.json").read_bytes()))
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, IndexError):  # torn by hand: start over
            self._drop(key)
            return None

    def _received(self, key: str) -> int:
        try:
            return os.stat(self.dir / f"{key}.part").st_size
        except FileNotFoundError:
            return 0

    def _drop(self, key: str) -> None:
        for suffix in (".part", ".json"):
            (self.dir / f"{key}{suffix}").unlink(missing_ok=True)

    def state(self, path: str) -> dict[str, Any]:
        key = _key(path)
        up = self._meta(key)
        if up is None or up.path != path:
            raise NotFound(f"no upload of {path!r} under way")
        return {**up.to_json(), "digests": None, "identity": None,
                "received": self._received(key), "whole": up.whole}

    def listing(self) -> list[dict[str, Any]]:
        out = []
        if self.dir.is_dir():
            for meta in sorted(self.dir.glob("*.json")):
                up = self._meta(meta.stem)
                if up is not None:
                    out.append({"path": up.path, "size": up.size, "version": up.version,
                                "received": self._received(meta.stem), "whole": up.whole})
        return sorted(out, key=lambda u: u["path"])

    def discard(self, path: str) -> None:
        key = _key(path)
        up = self._meta(key)
        if up is None or up.path != path:
            raise NotFound(f"no upload of {path!r} under way")
        if path in self._busy:
            raise Conflict(f"an upload of {path!r} is being received; discard it after")
        self._drop(key)

    def expire(self, now: float | None = None) -> list[str]:
        """Uploads not written to for ``ABANDONED_AFTER`` and not committed, dropped (a
        writer that went away for good); their paths. Called in the ledger's scan turn,
        after the commits journalled were finished."""
        if not self.dir.is_dir():
            return []
        cutoff = (time.time() if now is None else now) - ABANDONED_AFTER
        dropped = []
        for meta in self.dir.glob("*.json"):
            up = self._meta(meta.stem)
            if up is None or up.path in self._busy:
                continue
            try:
                touched = max(os.stat(self.dir / f"{meta.stem}{sfx}").st_mtime
                              for sfx in (".json", ".part")
                              if (self.dir / f"{meta.stem}{sfx}").exists())
            except (FileNotFoundError, ValueError):
                continue
            if touched < cutoff:
                self._drop(meta.stem)
                dropped.append(up.path)
        if dropped:
            log.warning("dropped %d uploads untouched for %d days and never committed: %s",
                        len(dropped), ABANDONED_AFTER // 86400, ", ".join(sorted(dropped)[:10]))
        return dropped

    # -- receiving ----------------------------------------------------------------------------
    async def receive(self, path: str, size: int, version: str, offset: int,
                      body: AsyncIterator[bytes],
                      wrote: Callable[[int], object] = lambda n: None) -> dict[str, Any]:
        """Bytes of ``path`` from ``offset`` (the bytes received so far), flushed before it
        returns; the last byte checks the whole file against ``version``. ``wrote``: told
        the count of each gathered write."""
        if not 0 <= size <= MAX_FILE:
            raise BadRequest(f"an upload's size must be 0..{MAX_FILE} bytes, not {size}")
        if path in self._busy:
            raise Conflict(f"an upload of {path!r} is already being received")
        self._busy.add(path)
        try:
            return await self._receive(path, size, version, offset, body, wrote)
        finally:
            self._busy.discard(path)

    async def _receive(self, path: str, size: int, version: str, offset: int,
                       body: AsyncIterator[bytes], wrote: Callable[[int], object]
                       ) -> dict[str, Any]:
        key = _key(path)
        up = await asyncio.to_thread(self._meta, key)
        if up is not None and (up.path, up.size, up.version) != (path, size, version):
            if offset != 0:
                raise Conflict(f"an upload of {path!r} with another size or version is under "
                               "way; send this one from offset 0 to replace it", 0)
            await asyncio.to_thread(self._drop, key)
            up = None
        received = await asyncio.to_thread(self._received, key)
        if up is not None and up.whole:
            if offset != size:
                raise Conflict(f"{path!r} was received whole already", size)
            return self._answer(up, size)
        if offset != received:
            raise Conflict(f"{path!r}: {received} bytes were received, not {offset}; resume "
                           f"from {received}", received)
        if up is None:
            up = Upload(path, size, version)
            await asyncio.to_thread(self._begin, key, up)
        received = await self._write(key, size, offset, body, wrote)
        if received == size:
            up = await asyncio.to_thread(self._check, key, up)
        return self._answer(up, received)

    def _answer(self, up: Upload, received: int) -> dict[str, Any]:
        return {"path": up.path, "size": up.size, "version": up.version,
                "received": received, "whole": up.whole}

    def _begin(self, key: str, up: Upload) -> None:
        self.dir.mkdir(mode=0o700, exist_ok=True)
        free = os.statvfs(self.dir)
        if free.f_bavail * free.f_frsize < up.size:
            raise NoSpace(f"no room on the hub for {up.path!r}: {up.size} bytes, "
                          f"{free.f_bavail * free.f_frsize} free")
        write_durably(self.dir / f"{key}.json", json.dumps(up.to_json()).encode())

    async def _write(self, key: str, size: int, offset: int, body: AsyncIterator[bytes],
                     wrote: Callable[[int], object]) -> int:
        """The body appended at ``offset``, gathered into large writes, flushed; the bytes
        now held. A body past ``size`` is refused and leaves what was held before it."""
        fd = await asyncio.to_thread(os.open, self.dir / f"{key}.part",
                                     os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        at = offset
        pending = bytearray()
        try:
            try:
                async for chunk in body:
                    if at + len(pending) + len(chunk) > size:
                        pending.clear()
                        await asyncio.to_thread(os.ftruncate, fd, offset)
                        raise BadRequest(f"the body runs past the upload's size ({size} "
                                         f"bytes); {offset} bytes are held")
                    pending += chunk
                    if len(pending) >= WRITE_CHUNK:
                        at += await asyncio.to_thread(_pwrite_all, fd, bytes(pending), at)
                        wrote(len(pending))
                        pending.clear()
            finally:
                # The bytes that arrived count, a body cut short included: its writer
                # resumes from them.
                if pending:
                    at += await asyncio.to_thread(_pwrite_all, fd, bytes(pending), at)
                    wrote(len(pending))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpace(f"the hub's disk filled while receiving: {exc.strerror}; "
                              f"resume from the bytes held") from exc
            raise
        finally:
            # What was written is flushed before any answer counts it (a client gone midway
            # included: it resumes from the length, and the last byte's check catches a
            # torn tail).
            await asyncio.to_thread(_flush_close, fd)
        return at

    def _check(self, key: str, up: Upload) -> Upload:
        """Read the whole part back and digest it; the upload, whole, or DigestMismatch."""
        part = self.dir / f"{key}.part"
        with open(part, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            size, digests = integrity.stream_digests(f, self.block_size)
        got = integrity.version_id(size, self.block_size, digests)
        if size != st.st_size or size != up.size or got != up.version:
            self._drop(key)
            raise DigestMismatch(f"{up.path!r}: the {st.st_size} bytes received digest to "
                                 f"version {got}, not {up.version} as declared (block size "
                                 f"{self.block_size}); dropped: send it again")
        up.digests = b"".join(digests)
        up.identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        write_durably(self.dir / f"{key}.json", json.dumps(up.to_json()).encode())
        return up

    # -- committing ---------------------------------------------------------------------------
    def prepare(self, paths: list[str] | None, prefix: str | None) -> tuple[Path, list[str]]:
        """A commit's journal, written durably, for the whole uploads named (``paths``) or
        under ``prefix``. Conflict when one is not whole or its path is taken (or a folder
        on its way is not a folder); the ledger's next scan (``place``) publishes it."""
        held = {u.path: u for u in (self._meta(m.stem) for m in self.dir.glob("*.json"))
                if u is not None} if self.dir.is_dir() else {}
        if paths is not None:
            missing = [p for p in paths if p not in held]
            if missing:
                raise NotFound(f"no upload of {missing[0]!r} to commit"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            chosen = [held[p] for p in dict.fromkeys(paths)]
        else:
            assert prefix is not None
            chosen = [u for p, u in sorted(held.items()) if p.startswith(prefix)]
            if not chosen:
                raise NotFound(f"no upload under {prefix!r} to commit")
        if len(chosen) > COMMIT_MOST:
            raise BadRequest(f"a commit publishes at most {COMMIT_MOST} files")
        for u in chosen:
            if not u.whole:
                raise Conflict(f"{u.path!r} is not received whole yet "
                               f"({self._received(_key(u.path))} of {u.size} bytes)")
            self._check_free(u)
        names = {u.path for u in chosen}
        for u in chosen:  # "a" and "a/b" cannot both be files
            parts = u.path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in names:
                    raise Conflict(f"{'/'.join(parts[:i])!r} would be a file and a folder")
        journal = self.journals / f"{time.time_ns()}-{os.getpid()}.json"
        write_durably(journal, json.dumps({"uploads": [u.to_json() for u in chosen]}).encode())
        return journal, [u.path for u in chosen]

    def _check_free(self, up: Upload) -> None:
        """Conflict unless ``up``'s path is free in the folder (or holds ``up``'s own part:
        a commit a crash or an error left unfinished) and every folder on its way is one."""
        parts = up.path.split("/")
        for i in range(1, len(parts)):
            try:
                st = os.lstat(self.root.joinpath(*parts[:i]))
            except FileNotFoundError:
                break
            if not statmod.S_ISDIR(st.st_mode):
                raise Conflict(f"{up.path!r}: {'/'.join(parts[:i])!r} on its way is not a "
                               "folder on the hub")
        try:
            there = os.lstat(self.root / up.path)
        except FileNotFoundError:
            return
        if up.identity is None or there.st_ino != up.identity[0]:
            raise Conflict(f"{up.path!r} exists in the dataset already; a writable dataset "
                           "only grows (write a new path)")

    def place(self) -> tuple[list[Row], list[Path]]:
        """Finish every journalled commit: each part linked to its path (idempotent: a
        crash between two links is finished here), the folders made flushed. The rows to
        record for the files placed now, and the journals done (``retire`` once the scan
        recorded them). Blocking; the ledger's scan lock is held."""
        rows: list[Row] = []
        done = sorted(self.journals.glob("*.json")) if self.journals.is_dir() else []
        for journal in done:
            try:
                doc = json.loads(journal.read_bytes())
                ups = [Upload.from_json(u) for u in doc["uploads"]]
            except (OSError, ValueError, KeyError, TypeError):  # written durably: never torn
                continue
            for up in ups:
                try:
                    row = self._link(up)
                except Conflict as exc:  # the folder changed under the hub since prepare
                    log.error("commit %s: %s; not published", journal.name, exc)
                    continue
                if row is not None:
                    rows.append(row)
        return rows, done

    def retire(self, journals: list[Path]) -> None:
        """After the scan recorded them: the journals and their uploads' records go."""
        for journal in journals:
            try:
                ups = [Upload.from_json(u) for u in json.loads(journal.read_bytes())["uploads"]]
            except (OSError, ValueError, KeyError, TypeError):
                ups = []
            for up in ups:
                self._drop(_key(up.path))
            journal.unlink(missing_ok=True)

    def _link(self, up: Upload) -> Row | None:
        """``up``'s part at its path (a hard link: never over a file that is there), and its
        row when this call placed it; None when it was placed before (the scan hashes
        what is there) or is gone."""
        key = _key(up.path)
        src = self.dir / f"{key}.part"
        try:
            st = os.stat(src)
        except FileNotFoundError:
            return self._placed_before(up)
        if up.identity is None or (st.st_ino, st.st_size, st.st_mtime_ns) != up.identity:
            return None  # changed since it was checked: not published with these digests
        *folders, leaf = up.path.split("/")
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in folders:
                child = _enter(fd, name, up.path)
                os.close(fd)
                fd = child
            try:
                os.link(src, leaf, dst_dir_fd=fd)
            except FileExistsError:
                there = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
                if (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
                    return None  # another file took the path meanwhile: it stays, unrecorded
            _fsync_dir(fd)
            # The part goes now, not after the scan: dropping a link changes the file's
            # ctime, and the row must hold the identity the file keeps (a read checks it).
            os.unlink(src)
            _fsync_dir_path(self.dir)
            placed = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)
        return _row(up, placed)

    def _placed_before(self, up: Upload) -> Row | None:
        """The row of ``up`` linked and its part unlinked before a crash, when the file at
        its path is still the one checked; None (the walk hashes what is there) if not."""
        try:
            there = os.lstat(self.root / up.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if (up.identity is None or not statmod.S_ISREG(there.st_mode)
                or (there.st_ino, there.st_size, there.st_mtime_ns) != up.identity):
            return None
        return _row(up, there)


def _row(up: Upload, placed: os.stat_result) -> Row:
    assert up.digests is not None
    return (up.path, placed.st_dev, placed.st_ino, placed.st_size, placed.st_mtime_ns,
                placed.st_ctime_ns, statmod.S_IMODE(placed.st_mode), up.version, up.digests,
                None)


def _enter(parent: int, name: str, path: str) -> int:
    """The folder ``name`` of ``parent`` (made if missing, never through a symlink), open;
    the caller closes ``parent``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
                _fsync_dir(parent)
            except FileExistsError:
                pass
            return os.open(name, flags, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise Conflict(f"{path!r}: {name!r} on its way is not a folder on the hub") from exc
        raise


def _pwrite_all(fd: int, data: bytes, at: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    return len(data)


def _flush_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
