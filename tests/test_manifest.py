from __future__ import annotations

import time

from spokefs.manifest import Manifest


def _manifest(n: int) -> Manifest:
    paths = sorted(f"d{i % 100:02d}/f{i:07d}.jpg" for i in range(n))
    dirs = ["", *sorted({p.split("/")[0] for p in paths})]
    return Manifest("ds", "snap", 0.0, 4 << 20, paths, [100] * n, [0o644] * n, [1] * n,
                    ["ab" * 16] * n, dirs)


def test_roundtrip_lookup_and_listdir() -> None:
    m = _manifest(1000)
    m2 = Manifest.decode(m.encode())
    assert m2 == m
    assert m2.lookup("d03/f0000003.jpg") is not None
    assert m2.lookup("d03") is None and m2.is_dir("d03")
    dirs, files = m2.listdir("")
    assert len(dirs) == 100 and files == []
    _, files = m2.listdir("d03")
    assert len(files) == 10 and all(f.path.startswith("d03/") for f in files)


def test_million_entries_is_practical() -> None:
    m = _manifest(1_000_000)
    t0 = time.perf_counter()
    blob = m.encode()
    m2 = Manifest.decode(blob)
    elapsed = time.perf_counter() - t0
    assert len(m2) == 1_000_000
    assert m2.lookup("d42/f0000042.jpg") is not None
    # A loose bound: this is a correctness test that the format scales, not a benchmark.
    assert elapsed < 30, elapsed
    assert len(blob) < 40 * 2**20
