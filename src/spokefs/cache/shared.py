"""Reading a spoke's cache from another process on the same host: a replica worker of the
spoke, or a mount (the short circuit).

Only the spoke's owner process writes the cache; others ask it where a block is (``POST
/v1/datasets/{ds}/locate``: segment, offset, size, digests) and read the segment file
themselves, checking every byte against the digests of the chunks they read, in their own
buffer. A location can go stale (the block was evicted: its region reads as zeros; the
segment was deleted: the file is gone or cut), and a stale read fails its check and is
treated as a miss, never served: regions are never rewritten, so old bytes or zeros are
the only things a stale location can show.

``SharedCache.usable()`` proves this process reads the very folder the spoke writes (a
random id the spoke keeps in ``instance`` must match the one it announced), so a mount on
another host, where the same path may name another folder or none, falls back to HTTP.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from spokefs.cache.segments import SegmentFiles
from spokefs.cache.store import CHUNK, INSTANCE_FILE, KEY_FILE, read_loc, read_loc_into


class _Segment:
    """A segment file opened read-only, by id."""

    __slots__ = ("fd", "id")

    def __init__(self, seg_id: int, fd: int) -> None:
        self.id = seg_id
        self.fd = fd

    def read(self, offset: int, into: memoryview) -> int:
        done = 0
        while done < len(into):
            n = os.preadv(self.fd, [into[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done


@dataclass(slots=True, eq=False)
class SharedLoc:
    """Where the spoke said a block is (the fields ``read_loc`` needs)."""

    seg: _Segment
    offset: int
    size: int
    digest: bytes
    chunks: bytes
    object_size: int


class SharedCache:
    def __init__(self, cache_dir: Path, cache_id: str, chunk_size: int = CHUNK) -> None:
        self.dir = cache_dir
        self.id = cache_id
        self.chunk_size = chunk_size
        self._segs: dict[int, _Segment] = {}

    def usable(self) -> bool:
        """Whether this process can read the spoke's own cache folder (same host, same
        folder, permission to read)."""
        try:
            fd = os.open(self.dir / INSTANCE_FILE, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                return f.read().strip() == self.id
        except (OSError, UnicodeDecodeError):
            return False

    def trusted_key(self) -> bytes | None:
        """The folder's internal key (``cache.store.internal_key``) if the folder is one a
        spoke keeps: a real folder (no symlink) that nobody but its owner can read or write
        (mode 0700 or less), holding a key file of the same owner, private to it. A reader
        that presents the key and is answered knows the folder is the spoke's own; anything
        else and the short circuit stays off. None when not so."""
        try:
            st = os.lstat(self.dir)
            fd = os.open(self.dir / KEY_FILE, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                kst = os.fstat(f.fileno())
                key = f.read(256).strip()
        except OSError:
            return None
        if (not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077 or not stat.S_ISREG(kst.st_mode)
                or kst.st_uid != st.st_uid or kst.st_mode & 0o077 or not key):
            return None
        return key

    def _segment(self, seg_id: int) -> _Segment | None:
        seg = self._segs.get(seg_id)
        if seg is None:
            try:
                fd = os.open(self.dir / "segments" / SegmentFiles.name(seg_id),
                             os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return None
            seg = self._segs[seg_id] = _Segment(seg_id, fd)
        return seg

    def loc(self, entry: dict[str, object]) -> SharedLoc | None:
        """A location from a locate answer (None if its segment cannot be opened)."""
        seg = self._segment(int(entry["seg"]))  # type: ignore[call-overload]
        if seg is None:
            return None
        return SharedLoc(seg, int(entry["offset"]), int(entry["size"]),  # type: ignore
                         bytes.fromhex(str(entry["digest"])), bytes.fromhex(str(entry["chunks"])),
                         int(entry.get("object_size") or 0))  # type: ignore[call-overload]

    def read(self, loc: SharedLoc, lo: int, hi: int,
             scratch: bytearray | None = None) -> memoryview | None:
        """Checked bytes [lo, hi) of a block, or None (stale or damaged: ask the spoke)."""
        return read_loc(loc, lo, hi, self.chunk_size, scratch)  # type: ignore[arg-type]

    def read_into(self, loc: SharedLoc, lo: int, out: memoryview,
                  scratch: bytearray | None = None) -> bool:
        """Fill ``out`` with checked bytes of a block from ``lo``; False: stale or damaged."""
        return read_loc_into(loc, lo, out, self.chunk_size, scratch)  # type: ignore[arg-type]

    def sweep(self) -> int:
        """Close segments the spoke deleted (an open descriptor keeps the file); how many."""
        gone = []
        for seg_id, seg in self._segs.items():
            try:
                if os.fstat(seg.fd).st_nlink == 0:
                    gone.append(seg_id)
            except OSError:
                gone.append(seg_id)
        for seg_id in gone:
            seg = self._segs.pop(seg_id)
            try:
                os.close(seg.fd)
            except OSError:
                pass
        return len(gone)

    def close(self) -> None:
        for seg in self._segs.values():
            try:
                os.close(seg.fd)
            except OSError:
                pass
        self._segs.clear()
