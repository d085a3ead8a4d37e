"""The mount's inode table: numbering, lookup, listings, attributes, memory (no FUSE needed)."""

from __future__ import annotations

import stat
import time
import tracemalloc

import pytest

from spokefs.manifest import Manifest
from spokefs.mount.inodes import ROOT, InodeTable

FILES = {  # path -> (size, mode)
    "a-b/x": (3, 0o644),
    "a.txt": (5, 0o600),
    "a/b/c.txt": (7, 0o755),
    "a/b/d/e.bin": (11, 0o644),
    "a/z": (0, 0o444),
    "caf\u00e9 \u2713/na\u00efve file.txt": (13, 0o644),
    "top": (17, 0o644),
}
DIRS = ["", "a", "a-b", "a/b", "a/b/d", "a/empty", "caf\u00e9 \u2713", "e"]


def manifest(files: dict[str, tuple[int, int]] = FILES, dirs: list[str] = DIRS,
             versions: list[str] | None = None) -> Manifest:
    paths = sorted(files)
    return Manifest(
        dataset="ds", snapshot="0123456789ab", created=1_700_000_000.5, block_size=4 << 20,
        paths=paths, sizes=[files[p][0] for p in paths], modes=[files[p][1] for p in paths],
        mtimes=[1_600_000_000_000_000_000 + i for i in range(len(paths))],
        versions=versions or [f"{i:032x}" for i in range(len(paths))], dirs=sorted(dirs))


def walk(t: InodeTable, path: str) -> int | None:
    ino: int | None = ROOT
    for part in path.split("/") if path else []:
        assert ino is not None
        ino = t.lookup(ino, part)
        if ino is None:
            return None
    return ino


def names(t: InodeTable, ino: int) -> list[str]:
    return [t.name(k) for k in t.children(ino)]


def test_numbering_root_dirs_then_files() -> None:
    t = InodeTable(manifest())
    assert t.lookup_path("") == ROOT == 1
    assert t.is_dir(ROOT) and not t.is_file(ROOT)
    assert t.inode_count == len(DIRS) + len(FILES)
    for k, d in enumerate(sorted(DIRS)):
        assert t.lookup_path(d) == k + 1 and t.path(k + 1) == d
    for i, p in enumerate(sorted(FILES)):
        ino = t.lookup_path(p)
        assert ino == len(DIRS) + 1 + i and t.is_file(ino) and t.path(ino) == p


def test_lookup_by_walking_every_path() -> None:
    t = InodeTable(manifest())
    for p in [*FILES, *DIRS]:
        ino = walk(t, p)
        assert ino is not None and t.path(ino) == p
    assert walk(t, "a/b/nope") is None
    assert walk(t, "a/b/c.txt/under-a-file") is None
    assert t.lookup(ROOT, "") is None and t.lookup(ROOT, "a/b") is None
    a, ab = t.lookup_path("a"), t.lookup_path("a/b")
    assert a is not None and ab is not None
    assert t.lookup(ab, "..") == a and t.lookup(a, "..") == ROOT and t.lookup(ROOT, "..") == ROOT
    assert t.lookup(ab, ".") == ab
    assert t.parent(t.lookup_path("a/b/d/e.bin") or 0) == t.lookup_path("a/b/d")


def test_children_are_direct_only_and_complete() -> None:
    t = InodeTable(manifest())
    assert sorted(names(t, ROOT)) == sorted(
        ["a", "a-b", "caf\u00e9 \u2713", "e", "a.txt", "top"])
    assert sorted(names(t, t.lookup_path("a") or 0)) == ["b", "empty", "z"]
    assert sorted(names(t, t.lookup_path("a/b") or 0)) == ["c.txt", "d"]
    assert names(t, t.lookup_path("a/empty") or 0) == []
    assert names(t, t.lookup_path("e") or 0) == []
    assert names(t, t.lookup_path("caf\u00e9 \u2713") or 0) == ["na\u00efve file.txt"]
    with pytest.raises(NotADirectoryError):
        t.children(t.lookup_path("top") or 0)
    # Every entry is listed exactly once across the tree.
    seen, stack = [], [ROOT]
    while stack:
        for k in t.children(stack.pop()):
            seen.append(t.path(k))
            if t.is_dir(k):
                stack.append(k)
    assert sorted(seen) == sorted([*FILES, *(d for d in DIRS if d)])


def test_attributes() -> None:
    t = InodeTable(manifest())
    for p, (size, mode) in FILES.items():
        a = t.attr(t.lookup_path(p) or 0)
        assert stat.S_ISREG(a.mode) and stat.S_IMODE(a.mode) == mode and a.size == size
    d = t.attr(t.lookup_path("a") or 0)
    assert stat.S_ISDIR(d.mode) and d.nlink == 1 and d.mtime_ns == 1_700_000_000_500_000_000
    assert t.total_bytes == sum(s for s, _ in FILES.values())
    with pytest.raises(KeyError):
        t.attr(t.inode_count + 1)
    with pytest.raises(KeyError):
        t.attr(0)


def test_setuid_setgid_and_sticky_bits_are_never_shown() -> None:
    t = InodeTable(manifest(files={"suid": (1, 0o4755), "sgid": (1, 0o2711), "t": (1, 0o1644)},
                            dirs=[""]))
    modes = {p: stat.S_IMODE(t.attr(t.lookup_path(p) or 0).mode) for p in ("suid", "sgid", "t")}
    assert modes == {"suid": 0o755, "sgid": 0o711, "t": 0o644}


def test_versions_packed_and_unusual_ids_kept() -> None:
    m = manifest()
    t = InodeTable(m)
    for i, p in enumerate(m.paths):
        assert t.version(t.lookup_path(p) or 0) == m.versions[i]
    odd = ["token-size-mtime"] + [f"{i:032X}" for i in range(1, len(m.paths))]
    t2 = InodeTable(manifest(versions=odd))
    for i, p in enumerate(m.paths):
        assert t2.version(t2.lookup_path(p) or 0) == odd[i]


def test_manifest_without_root_dir_still_has_a_root() -> None:
    t = InodeTable(manifest(files={"f": (1, 0o644)}, dirs=[]))
    assert t.is_dir(ROOT) and names(t, ROOT) == ["f"]


def test_a_million_files_compact_and_fast() -> None:
    """1,000,000 files in 1,000 folders: build, list and look up without an object per file."""
    n_dirs, per_dir = 1000, 1000
    dirs = [""] + [f"class{d:04d}" for d in range(n_dirs)]
    paths = [f"class{d:04d}/img{i:04d}.jpg" for d in range(n_dirs) for i in range(per_dir)]
    n = len(paths)
    m = Manifest("big", "0" * 12, 0.0, 4 << 20, paths, [100_000] * n, [0o644] * n,
                 [1_600_000_000_000_000_000] * n, [f"{i:032x}" for i in range(n)], dirs)
    tracemalloc.start()
    t0 = time.perf_counter()
    t = InodeTable(m)
    built = time.perf_counter() - t0
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert used / n < 48, f"{used / n:.1f} bytes per file"  # packed columns, nothing per file
    assert built < 5.0
    t0 = time.perf_counter()
    assert len(t.children(ROOT)) == n_dirs  # skips each folder's 1000 files with one bisect
    ino = t.lookup_path("class0999/img0999.jpg")
    assert ino is not None and t.size(ino) == 100_000
    assert len(t.children(t.lookup_path("class0500") or 0)) == per_dir
    assert time.perf_counter() - t0 < 1.0
