"""A writable folder dataset's way in: uploads received beside the tree, checked whole
against the version their writer declared, and published together by a commit as one new
snapshot. A reader anywhere sees a committed set of files whole or not at all.

Where things are (the folder's own filesystem, so publishing a file is a link, not a copy):

    ROOT/.spokefs-incoming/KEY.part    the bytes received so far (KEY: a digest of the path)
    ROOT/.spokefs-incoming/KEY.json    path, size, version declared; once whole and checked,
                                       its block digests and the identity they were made on
    STATE/commits/ID.json              a commit under way (durable before its first link)
    STATE/commits/failed/ID.json       one that could not be finished, with why

The walk never publishes ``INCOMING`` (``origin/folder.py``). An upload resumes from the
bytes received (``received``: the part's length, flushed before each answer); the last
byte makes the hub read the part back and digest it with the dataset's block size: bytes
that are not the version declared are dropped (``DigestMismatch``), and the writer sends
the file again. A commit names whole uploads (paths, or every one under a prefix) and is
written to its journal. Then (``place``) every one is checked to be still the file checked
on arrival, its path free, before any is linked; each part is linked to its path (never
over a file that is there, so a published version stays readable), and the state scans,
recording the files with the digests made here (nothing is hashed twice). A commit that
cannot be finished undoes its links and is set aside in ``commits/failed`` with its reason,
its uploads kept; a journal left by a crash is finished by the next scan, before the walk.
A snapshot holds all of a commit's files or none. While a commit is journalled, its paths
are neither received again nor discarded.

A writable dataset only grows: a commit may not name a path the folder has. One writer
region per dataset (docs/checkpoints.md); the hub serialises uploads of one path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import mmap
import os
import stat as statmod
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spokefs import integrity
from spokefs.cache.durable import ALIGN, open_direct, write_durably
from spokefs.errors import BadRequest, Conflict, DigestMismatch, NoSpace, NotFound
from spokefs.origin.folder import INCOMING
from spokefs.wire.paths import clean_path

log = logging.getLogger(__name__)

MAX_FILE = 1 << 44          # bytes of one uploaded file (16 TiB): a bound, not a quota
MAX_PATH = 4096             # bytes of a path, as Linux's PATH_MAX
MAX_NAME = 255              # bytes of one component, as Linux's NAME_MAX
WRITE_CHUNK = 4 << 20       # bytes gathered before one write (a thread hop each)
COMMIT_MOST = 100_000       # uploads one commit publishes
ADOPTING = "adopting"        # an adopted upload's version until its bytes are digested
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


def _no_space(exc: OSError, doing: str) -> NoSpace | None:
    """``exc`` as NoSpace (507, ENOSPC at a writer) if the disk filled while ``doing``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"the disk filled while {doing}: {exc.strerror}")
    return None


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
        self._committing: set[str] = set()  # paths of journalled commits not yet retired:
                                            # not received, discarded or dropped meanwhile

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

    def upload(self, path: str) -> Upload | None:
        """What is held of an upload of ``path``, None if none."""
        up = self._meta(_key(path))
        return up if up is not None and up.path == path else None

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
                                "received": self._received(meta.stem), "whole": up.whole,
                                "committing": up.path in self._committing})
        return sorted(out, key=lambda u: u["path"])

    def discard(self, path: str) -> None:
        key = _key(path)
        up = self._meta(key)
        if up is None or up.path != path:
            raise NotFound(f"no upload of {path!r} under way")
        if path in self._busy:
            raise Conflict(f"an upload of {path!r} is being received; discard it after")
        if path in self._committing:
            raise Conflict(f"{path!r} is being committed: it is published or kept, not "
                           "discarded")
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
            if up is None or up.path in self._busy or up.path in self._committing:
                continue
            try:
                touched = max(os.stat(self.dir / f"{meta.stem}{sfx}").st_mtime
                              for sfx in (".json", ".part")
                              if (self.dir / f"{meta.stem}{sfx}").exists())
            except (FileNotFoundError, ValueError):
                continue
            # Asked again just before: a writer may have come back since the loop began.
            if touched < cutoff and up.path not in self._busy | self._committing:
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
        with self._receiving(path, size):
            return await self._receive(path, size, version, offset, body, wrote)

    @contextlib.contextmanager
    def _receiving(self, path: str, size: int) -> Iterator[None]:
        """``path`` marked as being received (one writer at a time, none while a commit
        publishes it) while the ``with`` body runs: a ``receive`` or an ``adopt``."""
        if not 0 <= size <= MAX_FILE:
            raise BadRequest(f"an upload's size must be 0..{MAX_FILE} bytes, not {size}")
        if path in self._busy:
            raise Conflict(f"an upload of {path!r} is already being received")
        # Marked busy, then asked about commits; ``prepare`` marks, then asks about
        # receives (another thread): one of the two sees the other.
        self._busy.add(path)
        try:
            if path in self._committing:
                raise Conflict(f"{path!r} is being committed; write another path, or this "
                               "one again once the commit answered")
            yield
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
        received, digests = await self._write(key, size, offset, body, wrote)
        if received == size:
            up = await asyncio.to_thread(self._check, key, up, digests)
        return self._answer(up, received)

    def adopt(self, path: str, fd: int, size: int) -> dict[str, Any]:
        """A whole file copied in from ``fd`` (a same-host writer's finished file, handed over
        by descriptor: ``spoke.handoff``) and checked; blocking (a thread). The version is
        the one its bytes digest to: nothing crossed a wire to be checked against. All or
        nothing: a copy that fails, or a file that changed while it was read (409), leaves no
        upload of ``path`` held; the writer hands it over again, or sends it."""
        with self._receiving(path, size):
            return self._adopt(path, fd, size)

    def _adopt(self, path: str, fd: int, size: int) -> dict[str, Any]:
        key = _key(path)
        before = os.fstat(fd)
        if before.st_size != size:
            raise Conflict(f"{path!r}: the file handed over holds {before.st_size} bytes, not "
                           f"{size}; is it still being written?")
        self._drop(key)
        # Written down first, with a version no writer declares: a kill mid-copy leaves an
        # upload that is never whole, that a send from 0 or the next handoff replaces.
        self._begin(key, Upload(path, size, ADOPTING))
        try:
            digests = self._copy_in(key, fd, size)
            after = os.fstat(fd)
            if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                raise Conflict(f"{path!r} changed while it was copied in; hand it over once "
                               "its writer is done")
            up = Upload(path, size, integrity.version_id(size, self.block_size, digests))
            up = self._check(key, up, digests)
        except BaseException:
            self._drop(key)
            raise
        return self._answer(up, size)

    def _copy_in(self, key: str, fd: int, size: int) -> list[bytes]:
        """``fd``'s first ``size`` bytes written into the part and flushed; their digests."""
        part = _PartWriter.open(self.dir / f"{key}.part", 0, self.block_size)
        try:
            while part.at + part.held < size:
                if not part.fill(fd, size - part.at - part.held):
                    raise Conflict(f"the file handed over ended at {part.at + part.held} "
                                   f"bytes, before its {size}")
                if part.full:
                    part.flush()
            if part.held:
                part.flush()
        except OSError as exc:
            if (full := _no_space(exc, "copying a file in")) is None:
                raise
            raise full from exc
        finally:
            part.close()
        digests = part.digests()
        assert digests is not None
        return digests

    def _answer(self, up: Upload, received: int) -> dict[str, Any]:
        return {"path": up.path, "size": up.size, "version": up.version,
                "received": received, "whole": up.whole}

    def _begin(self, key: str, up: Upload) -> None:
        self._own_dir()
        free = os.statvfs(self.dir)
        if free.f_bavail * free.f_frsize < up.size:
            raise NoSpace(f"no room on the hub for {up.path!r}: {up.size} bytes, "
                          f"{free.f_bavail * free.f_frsize} free")
        write_durably(self.dir / f"{key}.json", json.dumps(up.to_json()).encode())

    async def _write(self, key: str, size: int, offset: int, body: AsyncIterator[bytes],
                     wrote: Callable[[int], object]) -> tuple[int, list[bytes] | None]:
        """The body appended at ``offset``, gathered into large writes, flushed; the bytes
        now held, and (for a body from 0) the block digests of what was written. A body past
        ``size`` is refused and leaves what was held before it."""
        part = await asyncio.to_thread(
            _PartWriter.open, self.dir / f"{key}.part", offset,
            self.block_size if offset == 0 else None)
        try:
            try:
                async for chunk in body:
                    if part.at + part.held + len(chunk) > size:
                        part.held = 0
                        await asyncio.to_thread(os.ftruncate, part.fd, offset)
                        raise BadRequest(f"the body runs past the upload's size ({size} "
                                         f"bytes); {offset} bytes are held")
                    view = memoryview(chunk)
                    while view := part.take(view):
                        wrote(await asyncio.to_thread(part.flush))
            finally:
                # The bytes that arrived count, a body cut short included: its writer
                # resumes from them.
                if part.held:
                    wrote(await asyncio.to_thread(part.flush))
        except OSError as exc:
            if (full := _no_space(exc, "receiving; resume from the bytes held")) is None:
                raise
            raise full from exc
        finally:
            # What was written is flushed before any answer counts it (a client gone midway
            # included: it resumes from the length, and the last byte's check catches a
            # torn tail).
            await asyncio.to_thread(part.close)
        return part.at, part.digests()

    def _check(self, key: str, up: Upload, digests: list[bytes] | None = None) -> Upload:
        """The part checked against its declared version: digested as it arrived
        (``digests``: a body received from 0 in one piece), else read back whole. The upload,
        whole, or DigestMismatch."""
        part = self.dir / f"{key}.part"
        with open(part, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            if digests is None:
                size, digests = integrity.stream_digests(f, self.block_size)
            else:
                size = st.st_size
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
    def _own_dir(self) -> None:
        """``INCOMING`` made if missing, and checked to be the hub's own folder on the
        dataset's filesystem: not a symlink (a link would publish what it points at) and
        not another mount (a hard link cannot cross one: every commit would fail)."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        here, root = os.lstat(self.dir), os.stat(self.root)
        if not statmod.S_ISDIR(here.st_mode):
            raise Conflict(f"{self.dir} is not a folder (a symlink?): the hub keeps uploads "
                           "there; move it away")
        if here.st_dev != root.st_dev:
            raise Conflict(f"{self.dir} is on another filesystem than {self.root}: a commit "
                           "links uploads into place, which cannot cross filesystems")

    def prepare(self, paths: list[str] | None, prefix: str | None,
                refuse: Callable[[str], str | None] | None = None) -> tuple[Path, list[str]]:
        """A commit's journal, written durably, for the whole uploads named (``paths``) or
        under ``prefix``. Conflict when one is not whole, is being received or committed,
        or its path is taken (or a folder on its way is not a folder); the ledger's next
        scan (``place``) publishes it. ``refuse``: why a path is taken elsewhere (a spoke asks
        its hub's latest snapshot), or None."""
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
        self._own_dir()
        names = {u.path for u in chosen}
        taken = names & self._committing
        if taken:
            raise Conflict(f"{sorted(taken)[0]!r} is being committed already")
        # Marked first, then asked about receives (``receive`` does the reverse): no receive
        # starts on a path from here on, and one under way is seen.
        self._committing.update(names)
        try:
            for u in chosen:
                if u.path in self._busy:
                    raise Conflict(f"{u.path!r} is being received; commit it once it is whole")
                # Read again: a receive that ended meanwhile may have replaced it.
                now = self.upload(u.path)
                if now is None or now.identity != u.identity or not now.whole:
                    raise Conflict(f"{u.path!r} is not received whole yet "
                                   f"({self._received(_key(u.path))} of {u.size} bytes)")
                self._check_free(u)
                why = refuse(u.path) if refuse is not None else None
                if why is not None:
                    raise Conflict(why)
            for u in chosen:  # "a" and "a/b" cannot both be files
                parts = u.path.split("/")
                for i in range(1, len(parts)):
                    if "/".join(parts[:i]) in names:
                        raise Conflict(f"{'/'.join(parts[:i])!r} would be a file and a folder")
            journal = self.journals / f"{time.time_ns()}-{os.getpid()}.json"
            write_durably(journal, json.dumps({"uploads": [u.to_json() for u in chosen]})
                          .encode())
        except BaseException:
            self._committing.difference_update(names)
            raise
        return journal, [u.path for u in chosen]

    def pending(self) -> list[tuple[Path, list[Upload]]]:
        """The commits journalled and not yet finished, oldest first, their paths marked as
        being committed (after a restart too); a journal not readable now is left out."""
        out = []
        for journal in sorted(self.journals.glob("*.json")) if self.journals.is_dir() else []:
            try:
                ups = [Upload.from_json(u) for u in json.loads(journal.read_bytes())["uploads"]]
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                continue
            self._committing.update(u.path for u in ups)
            out.append((journal, ups))
        return out

    def _check_free(self, up: Upload) -> None:
        """Conflict unless ``up``'s path is free in the folder (or holds ``up``'s own part:
        a commit a crash or an error left unfinished) and every folder on its way is one."""
        try:
            fd = self._folder_of(up.path, make=False)
        except FileNotFoundError:
            return  # a folder on its way is missing: the path is free
        try:
            there = os.stat(up.path.rsplit("/", 1)[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise Conflict(f"{up.path!r} cannot be placed in the dataset's folder: "
                           f"{exc.strerror}") from exc
        finally:
            os.close(fd)
        if up.identity is None or there.st_ino != up.identity[0]:
            raise Conflict(f"{up.path!r} exists in the dataset already; a writable dataset "
                           "only grows (write a new path)")

    def _folder_of(self, path: str, make: bool) -> int:
        """The folder ``path`` lies in, open (the caller closes it), entered from the root
        one name at a time, never through a symlink; missing folders made when ``make``
        (FileNotFoundError when not). Conflict when a name on the way is not a folder."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in path.split("/")[:-1]:
                child = _enter(fd, name, path, make)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def place(self) -> Placed:
        """Finish every journalled commit, each all or nothing: every upload it names is
        checked to be as it was checked on arrival (or placed by a crashed run of this
        call) before any is linked; then each part is linked to its path (never over a
        file that is there), and only once all are, the parts go. A commit that cannot be
        finished (the folder changed under the hub, a link refused) publishes nothing,
        keeps its uploads, and is moved to ``commits/failed`` with its reason; the others
        go on. Blocking; the ledger's scan lock is held."""
        out = Placed()
        journals = sorted(self.journals.glob("*.json")) if self.journals.is_dir() else []
        for journal in journals:
            try:
                ups = [Upload.from_json(u) for u in json.loads(journal.read_bytes())["uploads"]]
            except OSError as exc:  # could be passing (EIO, EMFILE): the next scan tries
                log.warning("commit %s: its journal cannot be read now (%s); tried again at "
                            "the next scan", journal.name, exc)
                continue
            except (ValueError, KeyError, TypeError, IndexError) as exc:  # not ours
                self._fail(journal, [], f"the journal is not one this hub wrote: {exc}", out)
                continue
            self._committing.update(u.path for u in ups)  # a journal a crash left
            try:
                out.rows += self._place_all(ups)
            except (Conflict, OSError) as exc:
                self._fail(journal, ups, str(exc), out)
                continue
            out.done.append((journal, ups))
        return out

    def _place_all(self, ups: list[Upload]) -> list[Row]:
        todo = []
        for up in ups:  # every one checked before any is linked
            try:
                st = os.stat(self.dir / f"{_key(up.path)}.part")
            except FileNotFoundError:
                if self._placed_before(up) is None:
                    self._unplace(ups)
                    raise Conflict(f"{up.path!r}: its upload is gone and the path does not "
                                   "hold it") from None
                continue
            if up.identity is None or (st.st_ino, st.st_size, st.st_mtime_ns) != up.identity:
                self._unplace(ups)
                raise Conflict(f"{up.path!r}: its upload changed since it was checked")
            try:
                self._check_free(up)
            except Conflict:
                self._unplace(ups)
                raise
            todo.append(up)
        linked: list[Upload] = []
        try:
            for up in todo:
                self._link(up)
                linked.append(up)
        except BaseException:
            self._unplace(linked)
            raise
        # All are in place, so the commit is done: the parts go now, not after the scan
        # (dropping a link changes the file's ctime, and the row must hold the identity the
        # file keeps). A part that cannot go is logged and its file left for the walk to
        # hash; nothing is undone.
        stuck = set()
        for up in todo:
            try:
                os.unlink(self.dir / f"{_key(up.path)}.part")
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.error("%r is placed, but its upload's part cannot be removed: %s",
                          up.path, exc)
                stuck.add(up.path)
        if todo:
            try:
                _fsync_dir_path(self.dir)
            except OSError as exc:
                log.error("cannot flush %s: %s", self.dir, exc)
        rows = []
        for up in ups:
            row = None if up.path in stuck else self._placed_before(up)
            if row is not None:
                rows.append(row)
        return rows

    def _fail(self, journal: Path, ups: list[Upload], why: str, out: Placed) -> None:
        """``journal`` set aside in ``commits/failed`` with ``why``; its uploads stay."""
        log.error("commit %s: %s; nothing of it was published, its uploads are kept (commit "
                  "them again once the cause is gone)", journal.name, why)
        out.failed[journal.name] = why
        failed = self.journals / "failed"
        try:
            failed.mkdir(exist_ok=True)
            doc = {"uploads": [u.to_json() for u in ups], "error": why}
            write_durably(failed / journal.name, json.dumps(doc).encode())
            journal.unlink()
        except OSError as exc:
            log.error("commit %s: cannot set its journal aside: %s", journal.name, exc)
        self._committing.difference_update(u.path for u in ups)

    def retire(self, journals: list[tuple[Path, list[Upload]]]) -> None:
        """After the scan recorded them: the journals and their uploads' records go (a
        record only if it is still the one the journal named)."""
        for journal, ups in journals:
            for up in ups:
                key = _key(up.path)
                held = self._meta(key)
                if held is not None and (held.path, held.identity) == (up.path, up.identity):
                    self._drop(key)
            journal.unlink(missing_ok=True)
            self._committing.difference_update(u.path for u in ups)

    def _link(self, up: Upload) -> None:
        """``up``'s part linked at its path (never over a file that is there), the folder
        flushed; Conflict when another file holds the path."""
        src = self.dir / f"{_key(up.path)}.part"
        fd = self._folder_of(up.path, make=True)
        try:
            leaf = up.path.rsplit("/", 1)[-1]
            try:
                os.link(src, leaf, dst_dir_fd=fd)
            except FileExistsError:
                there = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
                if up.identity is None or there.st_ino != up.identity[0]:
                    raise Conflict(f"{up.path!r}: another file took the path") from None
            _fsync_dir(fd)
        finally:
            os.close(fd)

    def _unplace(self, ups: list[Upload]) -> None:
        """Undo what a run of ``place`` linked of ``ups`` (best effort, logged): a path that
        holds an upload's file loses it, and a part a crashed run unlinked gets it back."""
        for up in ups:
            if up.identity is None:
                continue
            part = self.dir / f"{_key(up.path)}.part"
            try:
                fd = self._folder_of(up.path, make=False)
            except (FileNotFoundError, Conflict):
                continue
            leaf = up.path.rsplit("/", 1)[-1]
            try:
                there = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
                if there.st_ino != up.identity[0]:
                    continue
                if part.exists():
                    os.unlink(leaf, dir_fd=fd)
                else:
                    os.rename(leaf, part, src_dir_fd=fd)
                _fsync_dir(fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.error("%r: cannot undo its placing: %s", up.path, exc)
            finally:
                os.close(fd)

    def _placed_before(self, up: Upload) -> Row | None:
        """The row of ``up`` when the file at its path is the one checked (linked by this
        or a crashed run); None if not."""
        try:
            fd = self._folder_of(up.path, make=False)
        except (FileNotFoundError, Conflict):
            return None
        try:
            there = os.stat(up.path.rsplit("/", 1)[-1], dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        finally:
            os.close(fd)
        if (up.identity is None or not statmod.S_ISREG(there.st_mode)
                or (there.st_ino, there.st_size, there.st_mtime_ns) != up.identity):
            return None
        return _row(up, there)


@dataclass(slots=True)
class Placed:
    """What ``place`` did: the rows of files placed (digested on arrival), the journals
    finished (``retire`` them once the scan recorded the rows), and those set aside, by
    name, with why."""

    rows: list[Row] = field(default_factory=list)
    done: list[tuple[Path, list[Upload]]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def _row(up: Upload, placed: os.stat_result) -> Row:
    assert up.digests is not None
    return (up.path, placed.st_dev, placed.st_ino, placed.st_size, placed.st_mtime_ns,
                placed.st_ctime_ns, statmod.S_IMODE(placed.st_mode), up.version, up.digests,
                None)


def _enter(parent: int, name: str, path: str, make: bool) -> int:
    """The folder ``name`` of ``parent`` (made if missing and ``make``, never through a
    symlink), open; the caller closes ``parent``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            if not make:
                raise
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


class _PartWriter:
    """An upload's part, written from one reused page-aligned buffer of ``WRITE_CHUNK``
    bytes: each full buffer is one write (a thread hop), with direct I/O where the
    filesystem offers it, so a checkpoint of many GB costs no copy into the page cache and
    does not push the node's own pages out (it is read once more, by the upload onwards or
    the commit's link, not served from memory). Bytes off a 4 KiB boundary (a short tail, a
    resume at an odd offset) go through the buffered descriptor. ``digest``: the block size
    to digest the bytes with as they are written (a body from 0), so the last byte's check
    needs no read-back."""

    def __init__(self, fd: int, dfd: int | None, at: int, digest: int | None) -> None:
        self.fd, self.dfd, self.at = fd, dfd, at
        self.held = 0  # bytes in the buffer, not yet written
        self._buf = mmap.mmap(-1, WRITE_CHUNK)  # anonymous: page-aligned
        self._view = memoryview(self._buf)
        # Until the file offset is 4 KiB-aligned, gather only up to the next boundary.
        self._limit = -at % ALIGN or WRITE_CHUNK
        self._digests = integrity.BlockDigests(digest) if digest else None

    @classmethod
    def open(cls, path: Path, at: int, digest: int | None) -> _PartWriter:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return cls(fd, open_direct(path), at, digest)

    @property
    def full(self) -> bool:
        return self.held == self._limit

    def fill(self, fd: int, most: int) -> int:
        """Up to ``most`` bytes read from ``fd`` (at the part's offset: a file copied whole)
        straight into the buffer, as far as it has room; the count read, 0 at its end."""
        room = min(most, self._limit - self.held)
        n = os.preadv(fd, [self._view[self.held:self.held + room]], self.at + self.held)
        self.held += n
        return n

    def take(self, data: memoryview) -> memoryview:
        """As much of ``data`` as fits copied into the buffer; the rest, empty unless the
        buffer is full (``flush`` it, then take the rest)."""
        n = min(len(data), self._limit - self.held)
        self._view[self.held:self.held + n] = data[:n]
        self.held += n
        return data[n:]

    def flush(self) -> int:
        """The buffer written at ``at`` (any thread); the count written."""
        n, data = self.held, self._view[:self.held]
        if self._digests is not None:
            self._digests.update(data)
        done = 0
        if self.dfd is not None and self.at % ALIGN == 0 and n >= ALIGN:
            try:
                done = _pwrite_direct(self.dfd, data[:n - n % ALIGN], self.at)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # A device whose direct I/O wants more than 4 KiB alignment: buffered
                # from here on (nothing was written by the refused call).
                os.close(self.dfd)
                self.dfd = None
        _pwrite_all(self.fd, data[done:], self.at + done)
        self.at += n
        self.held, self._limit = 0, WRITE_CHUNK
        return n

    def digests(self) -> list[bytes] | None:
        return self._digests.digests() if self._digests is not None else None

    def close(self) -> None:
        """Flushed to the disk and closed (what was not flushed from the buffer is dropped:
        never counted as held)."""
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            if self.dfd is not None:
                os.close(self.dfd)
            self._view.release()
            self._buf.close()


def _pwrite_direct(fd: int, data: memoryview, at: int) -> int:
    """``data`` written at ``at`` with direct I/O, stopping early only where the kernel took
    a count off a 4 KiB boundary (the rest must go buffered); the count written."""
    done = 0
    while done < len(data) and done % ALIGN == 0:
        n = os.pwrite(fd, data[done:], at + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"short write: {done} of {len(data)} bytes")
        done += n
    return done


def _pwrite_all(fd: int, data: bytes | memoryview, at: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"short write at {at}")
        view, at = view[n:], at + n
    return len(data)
