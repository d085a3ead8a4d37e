"""Announced order from a real DataLoader: the spoke fetches ahead of the readers."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

import spokefs
from spokefs.client.control import SpokeControl
from test_spoke import metric

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset, RandomSampler  # noqa: E402

from spokefs.torch import AnnouncingSampler  # noqa: E402


class Files(Dataset):
    def __init__(self, base: str, paths: list[str]) -> None:
        self.base, self.paths = base, paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> bytes:
        with spokefs.open(f"{self.base}/{self.paths[i]}") as f:
            return f.read()


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_announced_order_is_fetched_ahead(spoke_server, dataset: Path) -> None:
    base = f"{spoke_server.url}/ds"
    paths = sorted(p.relative_to(dataset).as_posix() for p in dataset.rglob("*.jpg"))
    sampler = AnnouncingSampler(RandomSampler(range(len(paths))), paths, base, job="t1")
    order = list(iter(sampler))  # draws and announces epoch 0
    sampler.wait_announced(10)
    ctl = SpokeControl(base)
    # Nothing has been read, yet the announced files become resident.
    assert wait_for(lambda: ctl.residency(paths=[paths[i] for i in order[:8]])["fraction"]
                    == 1.0)
    assert metric(spoke_server.url, "spokefs_cache_misses_total") == 0


def test_dataloader_with_workers_reads_correct_bytes(spoke_server, dataset: Path) -> None:
    base = f"{spoke_server.url}/ds"
    paths = sorted(p.relative_to(dataset).as_posix() for p in dataset.rglob("*.jpg"))
    ds = Files(base, paths)
    sampler = AnnouncingSampler(RandomSampler(ds), paths, base, job="t2")
    loader = DataLoader(ds, sampler=sampler, batch_size=4, num_workers=2,
                        collate_fn=lambda b: b)
    for _epoch in range(2):
        seen = [x for batch in loader for x in batch]
        assert sorted(seen) == sorted((dataset / p).read_bytes() for p in paths)
    hits = metric(spoke_server.url, "spokefs_cache_hits_total")
    assert hits >= len(paths)  # the second epoch came from the cache


def test_unreachable_spoke_costs_only_the_hint(tmp_path: Path) -> None:
    sampler = AnnouncingSampler(list(range(5)), [f"f{i}" for i in range(5)],
                                "http://127.0.0.1:9/ds", deadline=0.2)
    assert list(iter(sampler)) == [0, 1, 2, 3, 4]
