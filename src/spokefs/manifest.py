"""Snapshot manifests: the immutable list of every file in a dataset snapshot.

Stored and sent column-wise (one JSON list per field) and gzip-compressed: a million entries is
one ``json.loads`` of a few lists, not a million dicts. Paths are sorted, so lookups bisect and
a directory's entries are one contiguous run; directories are listed explicitly so empty ones
survive.
"""

from __future__ import annotations

import bisect
import gzip
import json
import stat as statmod
from collections.abc import Iterator
from dataclasses import dataclass

FORMAT = 1


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    mode: int
    mtime_ns: int
    version: str

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "type": "file", "size": self.size, "mode": self.mode,
                "mtime_ns": self.mtime_ns, "version": self.version}


@dataclass(frozen=True, slots=True)
class Manifest:
    dataset: str
    snapshot: str
    created: float
    block_size: int
    paths: list[str]
    sizes: list[int]
    modes: list[int]
    mtimes: list[int]
    versions: list[str]
    dirs: list[str]  # every directory, sorted; "" is the root

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def entry(self, i: int) -> FileEntry:
        return FileEntry(self.paths[i], self.sizes[i], self.modes[i], self.mtimes[i],
                         self.versions[i])

    def index(self, path: str) -> int | None:
        i = bisect.bisect_left(self.paths, path)
        return i if i < len(self.paths) and self.paths[i] == path else None

    def lookup(self, path: str) -> FileEntry | None:
        i = self.index(path)
        return None if i is None else self.entry(i)

    def is_dir(self, path: str) -> bool:
        i = bisect.bisect_left(self.dirs, path)
        return i < len(self.dirs) and self.dirs[i] == path

    def listdir(self, path: str) -> tuple[list[str], list[FileEntry]]:
        """(subdirectory names, file entries) directly inside directory ``path`` ("" = root)."""
        prefix = f"{path}/" if path else ""
        subdirs = []
        lo = bisect.bisect_left(self.dirs, prefix) if prefix else 0
        for d in self.dirs[lo:]:
            if not d.startswith(prefix):
                break
            rest = d[len(prefix):]
            if rest and "/" not in rest:
                subdirs.append(rest)
        files = []
        lo = bisect.bisect_left(self.paths, prefix)
        hi = bisect.bisect_left(self.paths, prefix + "\U0010ffff")
        for i in range(lo, hi):
            if "/" not in self.paths[i][len(prefix):]:
                files.append(self.entry(i))
        return subdirs, files

    def entries(self) -> Iterator[FileEntry]:
        for i in range(len(self.paths)):
            yield self.entry(i)

    def identity(self) -> bytes:
        """Canonical bytes of the content (not the creation time): the snapshot id's input."""
        return json.dumps([self.dataset, self.block_size, self.paths, self.sizes, self.modes,
                           self.mtimes, self.versions, self.dirs],
                          separators=(",", ":")).encode()

    def to_json(self) -> dict[str, object]:
        return {"format": FORMAT, "dataset": self.dataset, "snapshot": self.snapshot,
                "created": self.created, "block_size": self.block_size, "paths": self.paths,
                "sizes": self.sizes, "modes": self.modes, "mtimes": self.mtimes,
                "versions": self.versions, "dirs": self.dirs}

    def encode(self) -> bytes:
        """gzip'd JSON, as stored and sent (Content-Type application/vnd.spokefs.manifest)."""
        raw = json.dumps(self.to_json(), separators=(",", ":")).encode()
        return gzip.compress(raw, compresslevel=5, mtime=0)

    @classmethod
    def from_json(cls, doc: dict) -> Manifest:
        if doc.get("format") != FORMAT:
            raise ValueError(f"unsupported manifest format {doc.get('format')!r}")
        return cls(doc["dataset"], doc["snapshot"], doc["created"], doc["block_size"],
                   doc["paths"], doc["sizes"], doc["modes"], doc["mtimes"], doc["versions"],
                   doc["dirs"])

    @classmethod
    def decode(cls, blob: bytes) -> Manifest:
        """From gzip'd JSON, or plain JSON (an HTTP client may have decompressed it)."""
        raw = gzip.decompress(blob) if blob[:2] == b"\x1f\x8b" else blob
        return cls.from_json(json.loads(raw))


def dir_mode() -> int:
    return statmod.S_IFDIR | 0o555
