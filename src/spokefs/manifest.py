"""Snapshot manifests: the immutable list of every file in a dataset snapshot.

Stored and sent column-wise (one JSON list per field) and gzip-compressed: a million entries is
one ``json.loads`` of a few lists, not a million dicts. Paths are sorted, so lookups bisect and
a directory's entries are one contiguous run; directories are listed explicitly so empty ones
survive.

A manifest comes from the upstream (or from a file a spoke kept) and is trusted by nothing that
reads it: ``decode``/``from_json`` check every field (see ``_validate``) and raise
``ManifestError`` (spokefs.errors; a ValueError too) naming the first rule broken, and
``verify`` checks a blob against the snapshot id it was asked for. The rules are what the hub
produces (spokefs.hub.snapshot), no looser:

- ``format`` 1; ``dataset`` a dataset name (spokefs.wire.paths); ``snapshot`` a snapshot id
  (``SNAPSHOT_ID``: 12 lower-case hex digits); ``created`` a finite number >= 0;
  ``block_size`` an int in [1, ``MAX_BLOCK_SIZE``].
- ``paths``, ``sizes``, ``modes``, ``mtimes``, ``versions``: lists of one length. Paths are
  clean relative paths (no empty, "." or ".." component, no leading or trailing "/", no NUL,
  no lone surrogate: the hub publishes UTF-8 names only), strictly increasing (lookups
  bisect). Sizes are ints in [0, 2**63); modes ints in
  [0, 0o7777] (the hub keeps permission bits only); mtimes ints in the int64 range (a file
  older than 1970 has a negative one). Versions are ``VERSION_ID``: 32 lower-case hex digits,
  what ``integrity.version_id`` makes -- never anything that could be a path.
- ``dirs``: clean paths, strictly increasing, starting with the root ""; the parent of every
  file and folder is listed, and no folder is also a file.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import json
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

from spokefs.errors import BadRequest, ManifestError
from spokefs.wire.paths import check_dataset_name

FORMAT = 1
# The snapshot id is a digest of the content (``content_id``): blake2b, 6 bytes, as hex.
SNAPSHOT_ID_BYTES = 6
SNAPSHOT_ID = re.compile(r"[0-9a-f]{12}")
# A file version id (``integrity.version_id``): blake2b, 16 bytes, as hex.
VERSION_ID = re.compile(r"[0-9a-f]{32}")
VERSION_ID_LEN = 32
MAX_BLOCK_SIZE = 1 << 30  # a spoke holds whole blocks in memory
# Bound on a manifest's JSON, decompressed: ~100 bytes a file, so ~40 million files. A gzip
# bomb stops here instead of growing memory without bound.
MAX_MANIFEST_BYTES = 4 << 30
# Bound on a manifest as sent and kept (gzip'd): what a spoke reads from upstream or disk.
MAX_MANIFEST_BLOB = 1 << 30
_INT64 = 1 << 63
_MAX_MODE = 0o7777
_GZIP_MAGIC = b"\x1f\x8b"
_LOWER_HEX = re.compile(r"[0-9a-f]*")


def is_version_id(v: object) -> bool:
    """Whether ``v`` has the exact form of a file version id (safe in a key, URL or name)."""
    return isinstance(v, str) and len(v) == VERSION_ID_LEN and VERSION_ID.fullmatch(v) is not None


def is_snapshot_id(s: object) -> bool:
    return isinstance(s, str) and len(s) == 2 * SNAPSHOT_ID_BYTES and (
        SNAPSHOT_ID.fullmatch(s) is not None)


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

    def content_id(self) -> str:
        """The snapshot id this content has: what the hub names the snapshot
        (spokefs.hub.snapshot computes the same digest of ``identity``)."""
        return hashlib.blake2b(self.identity(), digest_size=SNAPSHOT_ID_BYTES).hexdigest()

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
    def from_json(cls, doc: object) -> Manifest:
        """A manifest from its decoded JSON; ManifestError if any rule is broken."""
        if not isinstance(doc, dict):
            raise ManifestError(f"a manifest is a JSON object, not {type(doc).__name__}")
        fmt = doc.get("format")
        if type(fmt) is not int or fmt != FORMAT:
            raise ManifestError(f"unsupported manifest format {_short(fmt)}")
        fields = {}
        for name, kind in (("dataset", str), ("snapshot", str), ("block_size", int),
                           ("paths", list), ("sizes", list), ("modes", list),
                           ("mtimes", list), ("versions", list), ("dirs", list)):
            value = doc.get(name)
            if type(value) is not kind:  # exact: a bool is no int
                raise ManifestError(f"manifest field {name!r} must be {_KINDS[kind]}, not "
                                    f"{_short(value)}")
            fields[name] = value
        created = doc.get("created")
        if type(created) not in (int, float):
            raise ManifestError(f"manifest field 'created' must be a number, not "
                                f"{_short(created)}")
        m = cls(fields["dataset"], fields["snapshot"], created, fields["block_size"],
                fields["paths"], fields["sizes"], fields["modes"], fields["mtimes"],
                fields["versions"], fields["dirs"])
        _validate(m)
        return m

    @classmethod
    def decode(cls, blob: bytes, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
        """From gzip'd JSON, or plain JSON (an HTTP client may have decompressed it), of at
        most ``max_bytes`` decompressed; ManifestError if it is not a valid manifest."""
        raw = gunzip(blob, max_bytes) if blob[:2] == _GZIP_MAGIC else blob
        if len(raw) > max_bytes:
            raise ManifestError(f"manifest is {len(raw)} bytes, more than {max_bytes}")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise ManifestError(f"manifest is not JSON: {str(exc)[:200]}") from exc
        return cls.from_json(doc)


def verify(blob: bytes, snapshot_id: str, dataset: str | None = None,
           max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Decode ``blob`` and check it is the manifest of ``snapshot_id`` (of ``dataset`` if
    given): it names that snapshot and its content digests to that id, as the hub computed
    it. ManifestError otherwise. A truncated or changed blob fails here (gzip's CRC, the
    JSON, the rules or the digest), so a kept copy can be checked before it is served."""
    if not is_snapshot_id(snapshot_id):
        raise ManifestError(f"{_short(snapshot_id)} is not a snapshot id (12 lower-case hex "
                            "digits)")
    m = Manifest.decode(blob, max_bytes)
    if dataset is not None and m.dataset != dataset:
        raise ManifestError(f"manifest is of dataset {m.dataset!r}, not {dataset!r}")
    if m.snapshot != snapshot_id:
        raise ManifestError(f"manifest names snapshot {m.snapshot!r}, not {snapshot_id!r}")
    actual = m.content_id()
    if actual != snapshot_id:
        raise ManifestError(f"manifest content digests to {actual!r}, not to its snapshot id "
                            f"{snapshot_id!r}: changed or damaged")
    return m


def gunzip(blob: bytes, max_bytes: int = MAX_MANIFEST_BYTES) -> bytearray:
    """gzip data decompressed, never more than ``max_bytes`` held (a small blob can inflate
    a thousandfold); ManifestError if it is damaged, cut short or too large. Inflated in
    pieces of at most 64 MiB into one buffer, which is returned (no copy of the whole)."""
    out = bytearray()
    data = blob
    try:
        while True:  # one gzip member after another, as gzip.decompress
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            while not d.eof:
                piece = d.decompress(data, min(max_bytes + 1 - len(out), 1 << 26))
                out += piece
                if len(out) > max_bytes:
                    raise ManifestError(f"manifest decompresses to more than {max_bytes} bytes")
                data = d.unconsumed_tail
                if not piece and not data:
                    raise ManifestError("manifest gzip data is cut short")
            data = d.unused_data
            if not data:
                return out
            if data[:2] != _GZIP_MAGIC:
                raise ManifestError("manifest has bytes after its gzip data")
    except zlib.error as exc:
        raise ManifestError(f"manifest gzip data is damaged: {exc}") from exc


_KINDS = {str: "a string", int: "an integer", list: "a list"}


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _validate(m: Manifest) -> None:
    """Every rule of the module docstring. Column-wise passes in C where they can be: a
    million entries is well under a second."""
    try:
        check_dataset_name(m.dataset)
    except BadRequest as exc:
        raise ManifestError(f"manifest dataset name: {exc}") from None
    if not is_snapshot_id(m.snapshot):
        raise ManifestError(f"manifest snapshot id {_short(m.snapshot)} is not 12 lower-case "
                            "hex digits")
    # An int is compared as it is: a huge one would overflow math.isfinite.
    if not (0 <= m.created < _INT64 if type(m.created) is int
            else math.isfinite(m.created) and m.created >= 0):
        raise ManifestError(f"manifest 'created' {_short(m.created)} is not a time")
    if not 1 <= m.block_size <= MAX_BLOCK_SIZE:
        raise ManifestError(f"manifest block_size {m.block_size} is not in [1, "
                            f"{MAX_BLOCK_SIZE}]")
    n = len(m.paths)
    for name in ("sizes", "modes", "mtimes", "versions"):
        if len(getattr(m, name)) != n:
            raise ManifestError(f"manifest has {n} paths but {len(getattr(m, name))} {name}")
    _check_ints("sizes", m.sizes, 0, _INT64 - 1)
    _check_ints("modes", m.modes, 0, _MAX_MODE)
    _check_ints("mtimes", m.mtimes, -_INT64, _INT64 - 1)
    if n and set(map(type, m.versions)) != {str}:
        raise ManifestError("manifest versions must all be strings")
    if n and (set(map(len, m.versions)) != {VERSION_ID_LEN}
              or not _LOWER_HEX.fullmatch("".join(m.versions))):
        bad = next(v for v in m.versions if not is_version_id(v))
        raise ManifestError(f"manifest version id {_short(bad)} is not {VERSION_ID_LEN} "
                            "lower-case hex digits")
    _check_paths("paths", m.paths)
    if not m.dirs or m.dirs[0] != "":
        raise ManifestError('manifest dirs must start with the root ""')
    _check_paths("dirs", m.dirs[1:])  # a clean path sorts after "": the order holds
    dirs = set(m.dirs)
    clash = dirs.intersection(m.paths)
    if clash:
        raise ManifestError(f"manifest lists {_short(min(clash))} as a file and a folder")
    for name, column in (("file", m.paths), ("folder", m.dirs[1:])):
        orphans = {p.rpartition("/")[0] for p in column} - dirs
        if orphans:
            raise ManifestError(f"manifest lists a {name} in folder {_short(min(orphans))}, "
                                "which it does not list")


def _check_ints(name: str, column: list, lo: int, hi: int) -> None:
    if not column:
        return
    if set(map(type, column)) != {int}:  # exact: no bool, no float
        bad = next(x for x in column if type(x) is not int)
        raise ManifestError(f"manifest {name} must be integers, not {_short(bad)}")
    if min(column) < lo or max(column) > hi:
        bad = next(x for x in column if not lo <= x <= hi)
        raise ManifestError(f"manifest {name} value {bad} is outside [{lo}, {hi}]")


def _check_paths(name: str, column: list) -> None:
    """Strings, clean relative paths, strictly increasing."""
    if not column:
        return
    if set(map(type, column)) != {str}:
        raise ManifestError(f"manifest {name} must all be strings")
    # Between consecutive "/" of this string lie exactly the components of every path (an
    # empty path gives an empty one): four substring searches in C check them all.
    joined = "/" + "/".join(column) + "/"
    if "//" in joined or "/./" in joined or "/../" in joined or "\x00" in joined:
        bad = next(p for p in column if not _clean(p))
        raise ManifestError(f"manifest {name} entry {_short(bad)} is not a clean relative path "
                            "(empty, '.' or '..' component, leading or trailing '/', or NUL)")
    if not joined.isascii():
        try:  # a lone surrogate from a JSON escape: no file name the hub publishes
            joined.encode("utf-8")
        except UnicodeEncodeError:
            bad = next(p for p in column if not _utf8(p))
            raise ManifestError(f"manifest {name} entry {_short(bad)} is not valid Unicode "
                                "text") from None
    for a, b in pairwise(column):
        if not a < b:
            raise ManifestError(f"manifest {name} are not sorted and unique: {_short(a)} "
                                f"then {_short(b)}")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _clean(path: str) -> bool:
    return "\x00" not in path and all(c not in ("", ".", "..") for c in path.split("/"))

