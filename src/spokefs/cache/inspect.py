"""A cache folder seen from outside the spoke: the committed index against the segment files.

For the chaos suite, tests and benchmarks (read-only; works while the spoke runs, since the
index is in WAL mode). Rows the spoke has not committed yet (it commits every 50 ms) are not
seen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import xxhash

from spokefs.cache.index import committed_blocks
from spokefs.cache.segments import SegmentFiles


@dataclass(frozen=True, slots=True)
class OnDisk:
    version: str
    index: int
    path: Path       # the segment file
    offset: int
    size: int
    digest: bytes    # xxh3-128 of the block

    def read(self) -> bytes:
        with open(self.path, "rb", buffering=0) as f:
            return os.pread(f.fileno(), self.size, self.offset)


def blocks_on_disk(cache_dir: Path) -> list[OnDisk]:
    """Every committed block, by segment and offset."""
    seg_dir = cache_dir / "segments"
    return [OnDisk(r.version, r.idx, seg_dir / SegmentFiles.name(r.seg), r.off, r.size,
                   r.digest) for r in committed_blocks(cache_dir)]


def store_check(cache_dir: Path) -> dict[str, int]:
    """``rows``: indexed blocks; ``whole``: rows whose bytes match their digest; ``bad``:
    rows whose segment is there but whose bytes do not match (after a power loss without
    fsync these are possible, and reads treat them as misses; after ``kill -9`` they must
    not happen); ``missing``: rows whose segment is gone; ``orphans``: segment files no row
    points into."""
    rows = blocks_on_disk(cache_dir)
    whole = bad = missing = 0
    used: set[Path] = set()
    for b in rows:
        if not b.path.exists():
            missing += 1
            continue
        used.add(b.path)
        if xxhash.xxh3_128_digest(b.read()) == b.digest:
            whole += 1
        else:
            bad += 1
    segs = set((cache_dir / "segments").glob("*.seg")) if (cache_dir / "segments").exists() \
        else set()
    return {"rows": len(rows), "whole": whole, "bad": bad, "missing": missing,
            "orphans": len(segs - used)}


def cached_versions(cache_dir: Path) -> dict[str, int]:
    """version -> cached bytes, from a spoke's committed index."""
    out: dict[str, int] = {}
    for b in blocks_on_disk(cache_dir):
        out[b.version] = out.get(b.version, 0) + b.size
    return out
