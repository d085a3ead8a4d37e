"""Segment files: where the spoke's cached blocks live on disk.

Blocks are appended to segment files (``segments/<id>.seg``), each starting on a 4 KiB
boundary, so a block costs no file of its own: no create, rename or unlink per block, and a
directory of a few thousand files for a multi-terabyte cache. A read is one ``pread`` into
the reader's own buffer, checked there: what was checked is exactly what is served, whatever
happens to the file meanwhile (a mapping would crash the process with SIGBUS on a file cut
short, and a check in place could race a write). The exception is a spoke's read of 1 MiB or
more: checked on a copy, then sent with sendfile from the same region, held (not freed) until
sent (``BlockStore.hold``).

Space comes back without moving anything: an evicted block's bytes are freed at once by
punching a hole (``fallocate(PUNCH_HOLE)``), and a segment is unlinked when its last block
is gone. A region is never written twice -- new blocks only go to the tail of the newest
segment, and segment ids are never reused -- so a stale location (another process, a read
racing an eviction) can only read the block's own bytes or zeros, which its digest tells
apart.

Each segment is created at its full size as a sparse file (``ftruncate``); only written
blocks use disk.

Writes are gathered (``WriteGatherer``): the store's worker takes every block write queued so
far in one job, writes adjacent regions with one ``pwritev``, and reports them all back in
one call. A Python thread that wakes once per block pays a GIL handover per block while the
loop is busy (up to the 5 ms switch interval each); per batch it does not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from spokefs.cache.durable import ALIGN, aligned, open_direct

log = logging.getLogger(__name__)

SEGMENT_BYTES = 256 << 20  # address space of one segment; most blocks are far smaller
_ZEROS = memoryview(bytes(ALIGN))
_MAX_IOV = 1000  # pieces per pwritev (the kernel takes up to IOV_MAX, 1024)

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the disk space of [offset, offset+length) of an open file; it then reads zeros."""
    if length <= 0:
        return
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fallocate(PUNCH_HOLE): {os.strerror(e)}")


def check_hole_punching(folder: Path) -> None:
    """Raise OSError with a clear message if the cache's filesystem cannot punch holes. Needs
    no free space: the probe is an empty file (a full volume must not stop a restart)."""
    probe = folder / ".punch-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            return  # cannot tell now; a write failure later means pass-through anyway
        raise
    try:
        punch_hole(fd, 0, ALIGN)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(exc.errno, f"the filesystem of {folder} cannot free parts of a "
                          "file (fallocate PUNCH_HOLE); put the cache on ext4, xfs, btrfs "
                          "or tmpfs") from exc
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


class Segment:
    """One segment file: its descriptor, the append tail, its live blocks."""

    __slots__ = ("dfd", "fd", "file", "held", "id", "live", "live_bytes", "path", "size",
                 "tail")

    def __init__(self, seg_id: int, path: Path, fd: int, size: int, tail: int = 0,
                 direct: bool = False) -> None:
        self.id = seg_id
        self.path = path
        self.fd = fd
        # The same file opened for direct I/O (None where the filesystem cannot, or not
        # wanted): blocks are written with it from page-aligned buffers, not copied into the
        # page cache.
        self.dfd = open_direct(path) if direct else None
        # A file object over the same descriptor, for sendfile (which wants one).
        self.file = open(fd, "rb", buffering=0, closefd=False)  # noqa: SIM115
        self.size = size
        self.tail = tail
        self.live = 0          # blocks indexed in it
        self.live_bytes = 0    # their aligned bytes (disk they hold)
        self.held = 0          # blocks being sent from it (held, possibly evicted)

    def room(self) -> int:
        return self.size - self.tail

    def read(self, offset: int, into: memoryview) -> int:
        """Fill ``into`` from ``offset`` (any thread); the count read (short at the end of a
        file cut short)."""
        done = 0
        while done < len(into):
            n = os.preadv(self.fd, [into[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def close(self) -> None:
        self.file.close()
        os.close(self.fd)
        if self.dfd is not None:
            os.close(self.dfd)


class SegmentFiles:
    """The segment files of one cache folder; not thread-safe (the store's loop owns it),
    except ``write``, which a writer thread calls for a region it was given."""

    def __init__(self, folder: Path, segment_bytes: int = SEGMENT_BYTES,
                 direct: bool = False) -> None:
        self.folder = folder
        self.segment_bytes = segment_bytes
        self.direct = direct
        self.segments: dict[int, Segment] = {}
        self.current: Segment | None = None
        self.next_id = 1

    @staticmethod
    def name(seg_id: int) -> str:
        return f"{seg_id:08x}.seg"

    def existing(self) -> dict[int, Path]:
        out = {}
        for p in self.folder.iterdir():
            if p.suffix == ".seg" and len(p.stem) == 8:
                try:
                    out[int(p.stem, 16)] = p
                except ValueError:
                    continue
        return out

    def open_existing(self, seg_id: int, path: Path) -> Segment:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        seg = Segment(seg_id, path, fd, size, tail=size, direct=self.direct)  # full: no appends
        self.segments[seg_id] = seg
        self.next_id = max(self.next_id, seg_id + 1)
        return seg

    def allocate(self, nbytes: int) -> tuple[Segment, int]:
        """An unwritten, aligned region of ``nbytes`` (a new segment when the current one
        is full). Raises OSError if no segment can be made."""
        need = aligned(max(nbytes, 1))
        seg = self.current
        if seg is None or seg.room() < need:
            seg = self._new(max(self.segment_bytes, need))
        offset = seg.tail
        seg.tail += need
        return seg, offset

    def _new(self, size: int) -> Segment:
        seg_id = self.next_id
        self.next_id += 1
        path = self.folder / self.name(seg_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: costs no disk until written
            seg = Segment(seg_id, path, fd, size, direct=self.direct)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self.segments[seg_id] = seg
        self.current = seg
        return seg

    @staticmethod
    def write_many(seg: Segment, offset: int, pieces: list[memoryview],
                   direct: bool = False) -> None:
        """Write pieces back to back from ``offset`` with one ``pwritev`` (more if the kernel
        takes less); any thread. ``direct``: with direct I/O (every piece page-aligned in
        memory and a multiple of 4 KiB long). OSError on a full or failing disk (a short
        write on a full volume, which the kernel reports as a count, included)."""
        total = sum(len(p) for p in pieces)
        fd = seg.dfd if direct and seg.dfd is not None else seg.fd
        done = 0
        while done < total:
            n = os.pwritev(fd, pieces, offset + done)
            if n <= 0:
                raise OSError(errno.ENOSPC, f"short write: {done} of {total} bytes")
            done += n
            if done < total:  # drop what went out; go on with the rest
                while n >= len(pieces[0]):
                    n -= len(pieces[0])
                    pieces = pieces[1:]
                pieces = [pieces[0][n:], *pieces[1:]]

    @staticmethod
    def punch(seg: Segment, offset: int, nbytes: int) -> None:
        """Free a region (its block was evicted, dropped or never committed)."""
        try:
            punch_hole(seg.fd, offset, aligned(nbytes))
        except OSError as exc:
            log.debug("cache: cannot free %d bytes of %s: %s", nbytes, seg.path, exc)

    def forget(self, seg: Segment) -> None:
        """Stop using a segment (no block in it, none being written); ``remove`` it next."""
        self.segments.pop(seg.id, None)
        if self.current is seg:
            self.current = None

    @staticmethod
    def remove(seg: Segment) -> None:
        """Delete a forgotten segment's file (after every job that touched it)."""
        seg.path.unlink(missing_ok=True)
        seg.close()

    def disk_bytes(self) -> int:
        """Bytes the segment files hold on disk (st_blocks), for checks and status."""
        total = 0
        for seg in self.segments.values():
            try:
                total += os.fstat(seg.fd).st_blocks * 512
            except OSError:
                pass
        return total

    def close(self) -> None:
        for seg in list(self.segments.values()):
            seg.close()
        self.segments.clear()
        self.current = None


@dataclass(slots=True, eq=False)
class BlockWrite:
    """One block's bytes bound for its region of a segment (``SegmentFiles.allocate``)."""

    seg: Segment
    offset: int
    size: int
    data: memoryview            # must not change until the write is reported back
    # The same bytes in a page-aligned buffer, followed by whatever fills it up to the
    # region's 4 KiB boundary; given, the block is written with direct I/O (no copy into the
    # page cache, which measured 1.1-2.6 CPU-s per GiB on the VM these numbers come from,
    # against 0.04-0.3 direct).
    padded: memoryview | None
    error: OSError | None = None  # set when the write failed (its region is freed)


W = TypeVar("W", bound=BlockWrite)


class WriteGatherer(Generic[W]):
    """Block writes queued from the owner's loop and written by one worker thread, in
    batches: ``add`` from the loop (True: submit a ``write_queued`` job, none is pending),
    ``write_queued`` in the worker."""

    def __init__(self, files: SegmentFiles) -> None:
        self.files = files
        self._queued: list[W] = []
        self._lock = threading.Lock()
        self._pending = False  # a write_queued job was asked for and has not taken them yet

    def add(self, write: W) -> bool:
        """Queue ``write``; True when the caller must have the worker run ``write_queued``."""
        if write.padded is not None and len(write.padded) != aligned(write.size):
            write.padded = None  # not the region's length: written through the page cache
        with self._lock:
            self._queued.append(write)
            if self._pending:
                return False
            self._pending = True
            return True

    def write_queued(self, wrote: Callable[[int], None]) -> list[W]:
        """(worker) Write every queued block, adjacent regions of a segment together (one
        ``pwritev`` each); ``wrote(fd)`` hears each file written (to flush it before the
        index commits). Returns them in region order, ``error`` set on each whose write
        failed (its region freed)."""
        with self._lock:
            batch, self._queued = self._queued, []
            self._pending = False
        batch.sort(key=lambda w: (w.seg.id, w.offset))
        i = 0
        while i < len(batch):
            seg, start = batch[i].seg, batch[i].offset
            direct = seg.dfd is not None and batch[i].padded is not None
            j, end = i, start
            iov: list[memoryview] = []
            # A direct group takes only blocks given page-aligned (batch[i] always fits: j
            # moves on).
            while (j < len(batch) and batch[j].seg is seg and batch[j].offset == end
                   and (not direct or batch[j].padded is not None) and len(iov) < _MAX_IOV):
                w = batch[j]
                if direct:
                    assert w.padded is not None
                    iov.append(w.padded)
                else:
                    iov.append(w.data)
                    pad = aligned(w.size) - w.size
                    if pad and j + 1 < len(batch):
                        iov.append(_ZEROS[:pad])  # the gap to the next block's boundary
                end += aligned(w.size)
                j += 1
            try:
                self.files.write_many(seg, start, iov, direct)
                wrote(seg.fd)
            except OSError as exc:
                for w in batch[i:j]:
                    w.error = exc
                self.files.punch(seg, start, end - start)
            i = j
        return batch
