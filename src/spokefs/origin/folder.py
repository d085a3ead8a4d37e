"""A folder as an origin: the walk a snapshot lists, the hashing it does, and checked opens.

A file's identity is (device, inode, size, mtime, ctime): ctime cannot be set from user space,
so a rewrite that keeps the size and puts the mtime back (``cp -p``, ``rsync -t``) still
changes it. Nothing outside the root is ever published: symlinks are followed only when their
target is a file the walk publishes anyway (inside the root), and then the entry is that
file's content, read from the target. The tree may be hostile or changing while it is walked:
folders and files are opened without following symlinks and checked to be the inode the
listing showed, only regular files are read (a FIFO or device never blocks a scan), and names
that are not valid UTF-8 are left out with a warning (a manifest is JSON text). A folder named
``INCOMING`` at the root is the hub's (uploads to a writable dataset not yet committed,
``hub/uploads.py``) and is never published.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat as statmod
from collections.abc import Callable
from pathlib import Path

from spokefs import integrity
from spokefs.errors import ConfigError, VersionGone

log = logging.getLogger(__name__)

# Reads of published bytes: never through a symlink, never blocking on open (a FIFO or device
# swapped over a published file), never inherited by a child process.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# At a dataset's root: the hub's uploads before their commit; never walked, never published.
INCOMING = ".spokefs-incoming"

Identity = tuple[int, int, int, int, int]


def identity(s: os.stat_result) -> Identity:
    """What tells a file's content apart without reading it: device, inode, size, mtime, ctime.
    ctime cannot be set from user space, so a rewrite that keeps the size and puts the mtime
    back (``cp -p``, ``rsync -t``) still changes it."""
    return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


class NotRegularFile(OSError):
    """A published path that now names something other than a regular file."""


def _kind(mode: int) -> str:
    for test, name in ((statmod.S_ISFIFO, "a FIFO"), (statmod.S_ISCHR, "a character device"),
                       (statmod.S_ISBLK, "a block device"), (statmod.S_ISSOCK, "a socket"),
                       (statmod.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "something else"


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A descriptor of ``path`` and its stat, only if it is a regular file; NotRegularFile for a
    symlink, FIFO, device, socket or folder. The open cannot block (O_NONBLOCK) and the type is
    taken from the open descriptor (fstat), so nothing can be swapped in between."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink as the last component
            raise NotRegularFile("it is a symbolic link") from None
        raise
    try:
        s = os.fstat(fd)
        if not statmod.S_ISREG(s.st_mode):
            raise NotRegularFile(f"it is {_kind(s.st_mode)}, not a regular file")
        os.set_blocking(fd, True)  # no effect on a regular file; restored for plain semantics
    except BaseException:
        os.close(fd)
        raise
    return fd, s


def _is_utf8(name: str) -> bool:
    """False for a name os.fsdecode gave surrogate escapes (bytes that are not UTF-8)."""
    if name.isascii():
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# A file the walk found: its stat, and where its bytes are read from if the path is a symlink.
Found = tuple[os.stat_result, str | None]


class FolderOrigin:
    """A directory tree (``Origin``): listed by ``walk``, hashed by ``hash_file``, read by
    ``open_checked`` only while a file keeps the identity it was hashed under."""

    content_ids = True  # versions digest content: a snapshot hashes what changed

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.source = str(self.root)

    def check(self) -> None:
        if not self.root.is_dir():
            raise ConfigError(f"dataset directory {self.root} does not exist or is not a folder")

    def usable(self) -> str | None:
        return None if self.root.is_dir() else "a dataset's folder is gone"

    def identity(self, path: str) -> Identity | None:
        """The identity ``path`` has now (not following a symlink), None if it has none."""
        try:
            return identity(os.stat(os.path.join(self.root, path), follow_symlinks=False))
        except OSError:
            return None

    def open_checked(self, path: str, expected: tuple[int | None, int, int, int, int],
                     version: str) -> int:
        """A descriptor of ``path`` if it is still a regular file with the ``expected``
        identity; VersionGone otherwise (never another file's bytes). No realpath walk: the
        identity check refuses any other file, one reached through a folder swapped for a
        symlink to outside the dataset included."""
        try:
            fd, s = open_regular(os.path.join(self.root, path))
        except NotRegularFile as exc:
            raise VersionGone(f"{path!r} can no longer be served: {exc}; version "
                              f"{version} is no longer available: use a newer snapshot") from exc
        except OSError as exc:
            raise VersionGone(f"{path!r} can no longer be read: {exc.strerror}") from exc
        if identity(s) != expected:
            os.close(fd)
            raise VersionGone(f"{path!r} changed on the hub since its snapshot; version "
                              f"{version} is no longer available: use a newer snapshot")
        return fd

    async def read(self, path: str, expected: tuple[int | None, int, int, int, int],
                   version: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of ``path``, only while it has the ``expected`` identity (the
        hub's own reads send from the open file instead: ``hub/backend.py``)."""
        def read() -> bytes:
            fd = self.open_checked(path, expected, version)
            try:
                return os.pread(fd, end - start, start)
            finally:
                os.close(fd)

        return await asyncio.to_thread(read)

    def walk(self) -> tuple[dict[str, Found], list[str]]:
        """Every publishable file (path -> stat of its content, symlink target) and every
        directory. Each folder is opened without following symlinks and must be the inode its
        parent listed: a folder swapped for a symlink mid-walk never leads outside the root."""
        regular: dict[str, os.stat_result] = {}
        links: dict[str, str] = {}  # symlink path -> its target, relative to the root
        dirs = [""]
        stack: list[tuple[str, os.stat_result | None]] = [("", None)]
        root = str(self.root)
        while stack:
            rel, listed = stack.pop()
            try:
                fd = os.open(os.path.join(root, rel) if rel else root, _DIR_FLAGS)
            except OSError as exc:
                log.warning("skipping unreadable folder %r: %s", rel or ".", exc)
                continue
            try:
                opened = os.fstat(fd)
                if listed is not None and (opened.st_dev, opened.st_ino) != (listed.st_dev,
                                                                             listed.st_ino):
                    log.warning("skipping folder %r: it was replaced while the scan ran", rel)
                    continue
                with os.scandir(fd) as it:
                    for de in it:
                        if not rel and de.name == INCOMING:
                            continue
                        path = f"{rel}/{de.name}" if rel else de.name
                        if not _is_utf8(de.name):
                            log.warning("skipping %r: its name is not valid UTF-8, so it cannot "
                                        "be published (rename it to publish it)",
                                        os.fsencode(path))
                            continue
                        try:
                            if de.is_symlink():
                                target = os.path.realpath(os.path.join(root, path))
                                if os.path.commonpath([root, target]) != root or target == root:
                                    log.warning("skipping %r: symlink points outside the dataset",
                                                path)
                                    continue
                                links[path] = os.path.relpath(target, root)
                                continue
                            st = de.stat(follow_symlinks=False)
                        except OSError as exc:
                            log.warning("skipping %r: %s", path, exc)
                            continue
                        if statmod.S_ISDIR(st.st_mode):
                            dirs.append(path)
                            stack.append((path, st))
                        elif statmod.S_ISREG(st.st_mode):
                            regular[path] = st
            finally:
                os.close(fd)
        files: dict[str, Found] = {p: (st, None) for p, st in regular.items()}
        dirset = set(dirs)
        for path, target in links.items():
            # Only a file this scan publishes anyway: never a stat or read through the link.
            st = regular.get(target)
            if st is not None:
                files[path] = (st, target)
            elif target not in dirset:  # symlinked folders are not followed (no cycles)
                log.warning("skipping %r: its target %r is not a file of this dataset", path,
                            target)
        dirs.sort()
        return files, dirs

    def hash_file(self, path: str, listed: os.stat_result, block_size: int,
                  progress: Callable[[int], object]) -> tuple[os.stat_result, list[bytes]]:
        """Block digests of ``path`` (where the bytes are: a symlink's target) and the stat of
        the open file taken before reading, which is the identity reads are checked against.
        Only the regular file the walk listed is read (same device and inode)."""
        fd, st = open_regular(os.path.join(self.root, path))
        digests = []
        with open(fd, "rb", buffering=0) as f:
            if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino):
                raise OSError(f"{path} was replaced while the scan ran")
            remaining = st.st_size
            while remaining > 0:
                data = f.read(min(block_size, remaining))
                if not data:
                    raise OSError(f"{path} shrank while it was being read")
                digests.append(integrity.block_digest(data))
                remaining -= len(data)
                progress(len(data))
        return st, digests

