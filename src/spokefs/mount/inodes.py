"""The mount's inode table, built once from a snapshot manifest (sans-I/O).

Inode numbers are positions: directory ``k`` of ``manifest.dirs`` is inode ``1 + k`` (the root
"" sorts first, so it is inode 1, FUSE's ROOT_INODE), file ``i`` of ``manifest.paths`` is inode
``1 + len(dirs) + i``. Lookups bisect the sorted path columns, so no object per file is ever
made: a million files cost the manifest's own lists plus a few packed arrays. A directory's
child list (an array of inode numbers) is built the first time it is listed, by walking its
contiguous run of descendants and skipping each subfolder's subtree with one bisect.
"""

from __future__ import annotations

import bisect
import stat as statmod
from array import array
from dataclasses import dataclass

from spokefs.manifest import Manifest

ROOT = 1                 # FUSE's ROOT_INODE
_MAX = "\U0010ffff"      # sorts after every character a path can hold: end of a prefix run
_VERSION_BYTES = 16      # a version id is 32 hex digits


@dataclass(frozen=True, slots=True)
class Attr:
    """What stat shows for an inode (the FUSE layer copies it into EntryAttributes)."""

    ino: int
    mode: int
    size: int
    mtime_ns: int
    nlink: int


@dataclass(frozen=True, slots=True)
class Perms:
    """The owner and permission bits stat shows for every inode (``--uid``, ``--gid``,
    ``--file-mode``, ``--dir-mode``); with ``default_permissions`` the kernel checks access
    against them. ``file_mode`` None: each file's own bits from the snapshot."""

    uid: int
    gid: int
    file_mode: int | None = None
    dir_mode: int = 0o555

    def mode(self, a: Attr) -> int:
        """``a``'s mode with these permission bits."""
        if statmod.S_ISDIR(a.mode):
            return statmod.S_IFDIR | self.dir_mode
        if self.file_mode is not None:
            return statmod.S_IFREG | self.file_mode
        return a.mode


class InodeTable:
    """Read-only view of one snapshot as inodes: lookup, attributes, directory listings."""

    def __init__(self, manifest: Manifest) -> None:
        dirs = manifest.dirs
        if not dirs or dirs[0] != "":  # the root always exists, even in an odd manifest
            dirs = ["", *dirs]
        self.dataset = manifest.dataset
        self.snapshot = manifest.snapshot
        self.block_size = manifest.block_size
        self.created_ns = int(manifest.created * 1e9)
        self.dirs: list[str] = dirs
        self.paths: list[str] = manifest.paths
        # Packed columns: 8 bytes per number instead of a boxed int and a list slot.
        self.sizes = array("q", manifest.sizes)
        self.mtimes = array("q", manifest.mtimes)
        self.modes = array("I", manifest.modes)
        self._versions_packed, self._versions_list = _pack_versions(manifest.versions)
        self.total_bytes = sum(self.sizes)
        self._ndirs = len(dirs)
        self._children: dict[int, array] = {}

    # -- numbering ---------------------------------------------------------------------------
    @property
    def file_count(self) -> int:
        return len(self.paths)

    @property
    def inode_count(self) -> int:
        return self._ndirs + len(self.paths)

    def is_dir(self, ino: int) -> bool:
        return 1 <= ino <= self._ndirs

    def is_file(self, ino: int) -> bool:
        return self._ndirs < ino <= self._ndirs + len(self.paths)

    def file_index(self, ino: int) -> int:
        return ino - 1 - self._ndirs

    def file_inode(self, index: int) -> int:
        return index + 1 + self._ndirs

    def path(self, ino: int) -> str:
        if self.is_dir(ino):
            return self.dirs[ino - 1]
        if self.is_file(ino):
            return self.paths[self.file_index(ino)]
        raise KeyError(ino)

    def name(self, ino: int) -> str:
        return self.path(ino).rpartition("/")[2]

    def version(self, ino: int) -> str:
        i = self.file_index(ino)
        if self._versions_list is not None:
            return self._versions_list[i]
        return self._versions_packed[i * _VERSION_BYTES:(i + 1) * _VERSION_BYTES].hex()

    def size(self, ino: int) -> int:
        return self.sizes[self.file_index(ino)] if self.is_file(ino) else 0

    # -- attributes --------------------------------------------------------------------------
    def attr(self, ino: int) -> Attr:
        if self.is_dir(ino):
            # nlink 1 tells find/fts "subdirectory count unknown", so they never skip a folder.
            return Attr(ino, statmod.S_IFDIR | 0o555, 0, self.created_ns, 1)
        i = self.file_index(ino)
        if not 0 <= i < len(self.paths):
            raise KeyError(ino)
        # Permission bits only: a mount must never hand out setuid or setgid (nor sticky).
        return Attr(ino, statmod.S_IFREG | (self.modes[i] & 0o777), self.sizes[i],
                    self.mtimes[i], 1)

    # -- lookup ------------------------------------------------------------------------------
    def _dir_index(self, path: str) -> int | None:
        k = bisect.bisect_left(self.dirs, path)
        return k if k < self._ndirs and self.dirs[k] == path else None

    def _file_index(self, path: str) -> int | None:
        i = bisect.bisect_left(self.paths, path)
        return i if i < len(self.paths) and self.paths[i] == path else None

    def lookup_path(self, path: str) -> int | None:
        """The inode of ``path`` ("" = root; no leading or trailing slash), or None."""
        k = self._dir_index(path)
        if k is not None:
            return k + 1
        i = self._file_index(path)
        return None if i is None else self.file_inode(i)

    def lookup(self, parent: int, name: str) -> int | None:
        """The inode named ``name`` inside directory ``parent``, or None."""
        if not self.is_dir(parent) or not name or "/" in name:
            return None
        base = self.dirs[parent - 1]
        if name == ".":
            return parent
        if name == "..":
            return self.parent(parent)
        return self.lookup_path(f"{base}/{name}" if base else name)

    def parent(self, ino: int) -> int:
        if ino == ROOT:
            return ROOT
        head = self.path(ino).rpartition("/")[0]
        k = self._dir_index(head)
        return ROOT if k is None else k + 1

    # -- listing -----------------------------------------------------------------------------
    def children(self, ino: int) -> array:
        """Inode numbers directly inside directory ``ino``: folders first, then files."""
        kids = self._children.get(ino)
        if kids is None:
            if not self.is_dir(ino):
                raise NotADirectoryError(ino)
            base = self.dirs[ino - 1]
            prefix = f"{base}/" if base else ""
            kids = array("q", [k + 1 for k in _direct(self.dirs, prefix)])
            kids.extend(self.file_inode(i) for i in _direct(self.paths, prefix))
            self._children[ino] = kids
        return kids


def _direct(column: list[str], prefix: str) -> list[int]:
    """Indexes of the entries of sorted ``column`` that lie directly under ``prefix``.

    Entries sharing a prefix are one contiguous run of a sorted list, so each deeper subtree
    is skipped with a single bisect: the cost is per child, not per descendant.
    """
    out = []
    i = bisect.bisect_left(column, prefix)
    hi = bisect.bisect_left(column, prefix + _MAX, i)
    n = len(prefix)
    while i < hi:
        entry = column[i]
        slash = entry.find("/", n)
        if slash < 0:
            if len(entry) > n:  # not the folder itself (the root "" under prefix "")
                out.append(i)
            i += 1
        else:
            i = bisect.bisect_left(column, entry[:slash + 1] + _MAX, i + 1, hi)
    return out


def _pack_versions(versions: list[str]) -> tuple[bytes, list[str] | None]:
    """16 bytes per version instead of an 81-byte str; the list is kept if any id is not 32
    hex digits (a hub may use other tokens)."""
    joined = "".join(versions)
    # .hex() gives lower case back, so only lower-case ids round-trip exactly.
    if joined != joined.lower() or any(len(v) != 2 * _VERSION_BYTES for v in versions):
        return b"", versions
    try:
        return bytes.fromhex(joined), None
    except ValueError:
        return b"", versions
