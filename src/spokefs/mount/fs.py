"""The FUSE operations of a read-only snapshot mount (pyfuse3, asyncio mode).

Metadata comes from the inode table only, so ``ls``, ``stat``, ``find`` and ``open`` never
cross the link. A snapshot never changes, which licenses aggressive kernel caching: day-long
entry and attribute timeouts, cached negative lookups, and ``keep_cache`` so a file's pages
survive close and reopen. Reads become ranged reads of the file's version from the source;
a read the source cannot answer within the deadline fails with EIO and a log line.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import pyfuse3

from spokefs.errors import ReadFailed
from spokefs.mount.inodes import Attr, InodeTable, Perms

log = logging.getLogger(__name__)

CACHE_TIMEOUT = 86400.0    # seconds the kernel may trust entries and attributes: immutable
BLKSIZE = 128 * 1024       # st_blksize: the I/O size tools pick; one FUSE request's worth


@dataclass
class Counters:
    reads: int = 0
    read_bytes: int = 0
    read_errors: int = 0
    read_seconds: float = 0.0
    lookups: int = 0
    started: float = field(default_factory=time.monotonic)


class Reader(Protocol):
    """Bytes [start, end) of a file version of ``size`` bytes (a Coalescer over a Source)."""

    async def read(self, version: str, size: int, start: int, end: int
                   ) -> bytes | memoryview: ...


def _erofs() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


class SnapshotFS(pyfuse3.Operations):
    """pyfuse3 handlers over an ``InodeTable`` (metadata) and a ``Reader`` (bytes)."""

    def __init__(self, table: InodeTable, reader: Reader, perms: Perms | None = None) -> None:
        super().__init__()
        self.table = table
        self.reader = reader
        self.counters = Counters()
        self.perms = perms or Perms(os.getuid(), os.getgid())

    # -- metadata ----------------------------------------------------------------------------
    def _entry(self, ino: int) -> pyfuse3.EntryAttributes:
        try:
            a: Attr = self.table.attr(ino)
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = CACHE_TIMEOUT
        e.attr_timeout = CACHE_TIMEOUT
        e.st_mode = self.perms.mode(a)
        e.st_nlink = a.nlink
        e.st_uid = self.perms.uid
        e.st_gid = self.perms.gid
        e.st_rdev = 0
        e.st_size = a.size
        e.st_blksize = BLKSIZE
        e.st_blocks = (a.size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = a.mtime_ns
        return e

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        self.counters.lookups += 1
        ino = self.table.lookup(parent_inode, os.fsdecode(name))
        if ino is None:
            # st_ino 0 is a negative entry the kernel caches: a miss is as final as a hit.
            e = pyfuse3.EntryAttributes()
            e.st_ino = 0
            e.entry_timeout = CACHE_TIMEOUT
            return e
        return self._entry(ino)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext
                      ) -> pyfuse3.EntryAttributes:
        return self._entry(inode)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        pass  # inodes are positions in the table: nothing to free

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self.table.is_dir(inode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        kids = self.table.children(fh)
        # next_id is the position in the (immutable) child list, so resuming is exact.
        for pos in range(start_id, len(kids)):
            ino = kids[pos]
            if not pyfuse3.readdir_reply(token, os.fsencode(self.table.name(ino)),
                                         self._entry(ino), pos + 1):
                break

    async def releasedir(self, fh: int) -> None:
        pass

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLKSIZE
        s.f_frsize = 4096
        s.f_blocks = (self.table.total_bytes + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = self.table.inode_count
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK:
            raise _erofs()
        return True

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []

    # -- data --------------------------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        if not self.table.is_file(inode):
            raise pyfuse3.FUSEError(errno.EISDIR if self.table.is_dir(inode) else errno.ENOENT)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise _erofs()
        # keep_cache: pages read once stay valid across opens (the bytes can never change).
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        return await self._read_file(self.table, self.reader, fh, off, size, "")

    async def _read_file(self, t: InodeTable, reader: Reader, fh: int, off: int, size: int,
                         where: str) -> bytes | memoryview:
        """Bytes [off, off + size) of file inode ``fh`` of table ``t`` through ``reader``;
        EIO (counted, logged) when the reader gives up. ``where`` names a namespace member."""
        i = t.file_index(fh)
        file_size = t.sizes[i]
        if off >= file_size or size <= 0:
            return b""
        end = min(off + size, file_size)
        t0 = time.monotonic()
        try:
            data = await reader.read(t.version(fh), file_size, off, end)
        except ReadFailed as exc:
            self.counters.read_errors += 1
            log.error("read of %r%s [%d, %d) failed, answering EIO: %s", t.paths[i], where,
                      off, end, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        c = self.counters
        c.reads += 1
        c.read_bytes += len(data)
        c.read_seconds += time.monotonic() - t0
        return data

    async def release(self, fh: int) -> None:
        pass

    # -- everything that would change the tree: a snapshot is read-only ----------------------
    # (the mount is "ro", so the kernel refuses most of these before asking; belt and braces)
    async def setattr(self, *_: object) -> NoReturn:
        raise _erofs()

    async def mknod(self, *_: object) -> NoReturn:
        raise _erofs()

    async def mkdir(self, *_: object) -> NoReturn:
        raise _erofs()

    async def unlink(self, *_: object) -> NoReturn:
        raise _erofs()

    async def rmdir(self, *_: object) -> NoReturn:
        raise _erofs()

    async def symlink(self, *_: object) -> NoReturn:
        raise _erofs()

    async def rename(self, *_: object) -> NoReturn:
        raise _erofs()

    async def link(self, *_: object) -> NoReturn:
        raise _erofs()

    async def create(self, *_: object) -> NoReturn:
        raise _erofs()

    async def write(self, *_: object) -> NoReturn:
        raise _erofs()

    async def setxattr(self, *_: object) -> NoReturn:
        raise _erofs()

    async def removexattr(self, *_: object) -> NoReturn:
        raise _erofs()
