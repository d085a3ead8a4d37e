"""Synthetic training datasets of random bytes, built once per parameter set and reused.

Two shapes:
- ``files``: many small files (~100 KB "images") in class folders, ``n0003/000123.bin``;
- ``shards``: WebDataset-style tar shards (``shard-00000.tar``), each sample a ``KEY.cls``
  member (its label) and a ``KEY.bin`` member (its bytes). The loop reads the ``.bin`` member
  by (shard, offset, size), as an indexed-tar reader does.

Every sample's blake2b-128 digest goes into ``index.json`` so the loop can check each byte
it reads against the source. A dataset is built under a temporary name and renamed into
place once whole, so an interrupted build is never reused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

FORMAT = 1  # bump when the layout changes, so old caches are not reused


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    shape: str                 # "files" or "shards"
    samples: int
    sample_size: int           # mean bytes per sample; sizes are uniform in +-25%
    classes: int = 10
    shard_size: int = 64 << 20  # target bytes per shard ("shards" only)
    seed: int = 0

    def key(self) -> str:
        doc = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.blake2b(doc.encode(), digest_size=6).hexdigest()

    @property
    def name(self) -> str:
        """Dataset name on the hub."""
        return f"train-{self.shape}"


@dataclass(frozen=True, slots=True)
class Index:
    """Where each sample lives and what it must hash to (parallel lists, one per sample)."""

    paths: list[str]      # file holding the sample, relative to the dataset root
    offsets: list[int]
    sizes: list[int]
    labels: list[int]
    digests: list[str]    # blake2b-128 hex of the sample's bytes

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def files(self) -> list[str]:
        return sorted(set(self.paths))


@dataclass(frozen=True, slots=True)
class BuiltDataset:
    spec: DatasetSpec
    root: Path        # the folder the hub serves
    state_dir: Path   # the hub's state (kept, so a rerun need not hash again)
    index: Index
    bytes: int        # bytes of all files (what a full copy moves)

    @property
    def sample_bytes(self) -> int:
        return sum(self.index.sizes)


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "spokefs-bench-train"


def sample_digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def ensure_dataset(spec: DatasetSpec, cache_dir: Path, progress: bool = True) -> BuiltDataset:
    """The dataset for ``spec`` under ``cache_dir``: reused when built before, else built."""
    final = cache_dir / f"{spec.shape}-{spec.key()}"
    if not (final / "index.json").exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{spec.shape}-", dir=cache_dir))
        try:
            index = (_build_files if spec.shape == "files" else _build_shards)(
                spec, tmp / "data", progress)
            (tmp / "index.json").write_text(json.dumps({"spec": asdict(spec),
                                                        "index": asdict(index)}))
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    doc = json.loads((final / "index.json").read_text())
    index = Index(**doc["index"])
    total = sum(p.stat().st_size for p in (final / "data").rglob("*") if p.is_file())
    return BuiltDataset(spec, final / "data", final / "hubstate", index, total)


def _sizes(spec: DatasetSpec, rng: random.Random) -> list[int]:
    lo, hi = int(spec.sample_size * 0.75), int(spec.sample_size * 1.25)
    return [rng.randint(lo, hi) for _ in range(spec.samples)]


def _build_files(spec: DatasetSpec, root: Path, progress: bool) -> Index:
    rng = random.Random(spec.seed)
    sizes = _sizes(spec, rng)
    paths, labels, digests = [], [], []
    for i in tqdm(range(spec.samples), desc=f"building {spec.shape} dataset", unit="file",
                  disable=not progress, leave=False):
        label = i % spec.classes
        rel = f"n{label:04d}/{i:06d}.bin"
        data = rng.randbytes(sizes[i])
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        paths.append(rel)
        labels.append(label)
        digests.append(sample_digest(data))
    return Index(paths, [0] * len(paths), sizes, labels, digests)


def _build_shards(spec: DatasetSpec, root: Path, progress: bool) -> Index:
    rng = random.Random(spec.seed)
    sizes = _sizes(spec, rng)
    root.mkdir(parents=True, exist_ok=True)
    # Samples go into a shard until it holds at least shard_size bytes.
    groups: list[list[int]] = [[]]
    filled = 0
    for i, size in enumerate(sizes):
        if filled >= spec.shard_size:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += size
    paths = [""] * spec.samples
    offsets = [0] * spec.samples
    labels = [i % spec.classes for i in range(spec.samples)]
    digests = [""] * spec.samples

    def add(tar: tarfile.TarFile, name: str, data: bytes) -> int:
        """Append a member; return where its data starts (addfile does not record it)."""
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        header = len(info.tobuf(tar.format, tar.encoding, tar.errors))
        start = tar.offset
        tar.addfile(info, io.BytesIO(data))
        return start + header

    bar = tqdm(total=spec.samples, desc=f"building {spec.shape} dataset", unit="sample",
               disable=not progress, leave=False)
    with bar:
        for k, group in enumerate(groups):
            name = f"shard-{k:05d}.tar"
            with tarfile.open(root / name, "w", format=tarfile.USTAR_FORMAT) as tar:
                for i in group:
                    key = f"{i:08d}"
                    add(tar, f"{key}.cls", str(labels[i]).encode())
                    data = rng.randbytes(sizes[i])
                    paths[i], offsets[i] = name, add(tar, f"{key}.bin", data)
                    digests[i] = sample_digest(data)
                    bar.update(1)
    return Index(paths, offsets, sizes, labels, digests)
