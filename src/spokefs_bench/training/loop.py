"""The training loop every scenario runs: a real DataLoader, an emulated accelerator.

The accelerator step is emulated the way MLPerf Storage does it: a fixed compute time per
batch (sleep), or with ``model=True`` a small real CNN step on the CPU. The loop records, per
batch, how long it waited for data and how long it computed (``metrics.Batch``).

Each worker reads a sample through the scenario's opener, hashes it and compares with the
digest recorded when the dataset was built; a mismatch is counted, never hidden.
"""

from __future__ import annotations

import gc
import math
import random
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from spokefs_bench.training.datasets import Index, sample_digest
from spokefs_bench.training.metrics import Batch
from spokefs_bench.training.openers import Opener

IMAGE_SHAPE = (3, 32, 32)  # what a "decoded" sample becomes: its first 3072 bytes
IMAGE_BYTES = math.prod(IMAGE_SHAPE)


@dataclass(frozen=True, slots=True)
class LoopConfig:
    epochs: int = 3
    batch_size: int = 16
    workers: int = 4
    compute_s: float = 0.1      # emulated accelerator time per batch (ignored with model)
    model: bool = False
    prefetch_factor: int = 2
    seed: int = 0


def epoch_order(index: Index, epoch: int, seed: int, shape: str) -> list[int]:
    """The sample order of one epoch, fixed by (seed, epoch), so it can be announced.

    ``files``: a fresh global shuffle. ``shards``: shards shuffled, samples in order within a
    shard (what WebDataset-style readers do, so reads stay sequential inside a shard)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    if shape != "shards":
        order = list(range(len(index)))
        rng.shuffle(order)
        return order
    by_shard: dict[str, list[int]] = {}
    for i, p in enumerate(index.paths):
        by_shard.setdefault(p, []).append(i)
    shards = sorted(by_shard)
    rng.shuffle(shards)
    return [i for s in shards for i in by_shard[s]]


class EpochSampler(Sampler[int]):
    """Yields ``epoch_order`` for the epoch set with ``set_epoch`` (like DistributedSampler)."""

    def __init__(self, index: Index, seed: int, shape: str) -> None:
        self.index, self.seed, self.shape = index, seed, shape
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        return epoch_order(self.index, epoch, self.seed, self.shape)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch))

    def __len__(self) -> int:
        return len(self.index)


class _Gate(Sampler[int]):
    """Outermost sampler: empty until opened, so the worker warm-up pass neither reads nor
    announces anything (a wrapped sampler may post its order when iterated)."""

    def __init__(self, inner: Sampler[int]) -> None:
        self.inner = inner
        self.open = False

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner) if self.open else iter(())

    def __len__(self) -> int:
        return len(self.inner) if self.open else 0  # type: ignore[arg-type]


class SampleDataset(Dataset[dict[str, Any]]):
    """Reads sample i through the opener and checks it against the source's digest.

    The "decoded image" (the sample's first 3072 bytes) leaves the worker as bytes, not a
    tensor: each tensor crossing from a worker costs a shared-memory handshake (2-3 ms per
    batch measured here on 2 cores), which would let the CPU, not the emulated accelerator,
    set the pace. The main process makes the tensor (``batch_images``)."""

    def __init__(self, index: Index, opener: Opener) -> None:
        self.index = index
        self.opener = opener

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ix = self.index
        data = self.opener.read(ix.paths[i], ix.offsets[i], ix.sizes[i])
        ok = len(data) == ix.sizes[i] and sample_digest(data) == ix.digests[i]
        return {"image": bytes(data[:IMAGE_BYTES]).ljust(IMAGE_BYTES, b"\0"),
                "label": ix.labels[i], "bytes": ix.sizes[i], "ok": ok}


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch as plain Python (pickled through the worker queue, no shared memory)."""
    return {"image": b"".join(x["image"] for x in items),
            "label": [x["label"] for x in items], "bytes": [x["bytes"] for x in items],
            "ok": [x["ok"] for x in items]}


def batch_images(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's images as a float tensor [B, 3, 32, 32] in [0, 1]."""
    raw = torch.frombuffer(bytearray(batch["image"]), dtype=torch.uint8)
    return raw.view(-1, *IMAGE_SHAPE).float().div_(255.0)


class TinyCNN(torch.nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_step(cfg: LoopConfig, classes: int) -> Callable[[dict[str, Any]], None]:
    """The accelerator: a sleep of ``compute_s``, or one optimiser step of a tiny CNN."""
    if not cfg.model:
        def sleep_step(batch: dict[str, Any]) -> None:
            time.sleep(cfg.compute_s)
        return sleep_step
    torch.manual_seed(cfg.seed)
    model = TinyCNN(classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def model_step(batch: dict[str, Any]) -> None:
        opt.zero_grad()
        loss_fn(model(batch_images(batch)), torch.tensor(batch["label"])).backward()
        opt.step()
    return model_step


@dataclass(slots=True)
class LoopResult:
    timeline: list[Batch]
    samples_wrong: int
    bytes_wrong: int


def run_loop(index: Index, shape: str, opener: Opener, cfg: LoopConfig, classes: int,
             setup: Callable[[], None] | None = None,
             wrap_sampler: Callable[[EpochSampler], Sampler[int]] | None = None,
             on_batch: Callable[[Batch], None] | None = None) -> LoopResult:
    """Train for ``cfg.epochs`` epochs and return the per-batch timeline.

    The clock starts once the DataLoader's worker processes exist (a pass over an empty
    epoch forks them: framework start-up, not data access; about 0.5 s on 2 cores). Every
    byte is read after it starts. ``setup`` runs after the clock starts and is charged to the
    first batch's data wait (the staged copy). ``wrap_sampler`` lets a scenario announce the
    order (hints)."""
    # More workers than cores is deliberate: they mostly wait on I/O, not the CPU.
    warnings.filterwarnings("ignore", message=".*suggested max number of worker",
                            category=UserWarning)
    gate = _Gate(wrap_sampler(EpochSampler(index, cfg.seed, shape)) if wrap_sampler
                 else EpochSampler(index, cfg.seed, shape))
    loader = DataLoader(SampleDataset(index, opener), batch_size=cfg.batch_size, sampler=gate,
                        collate_fn=collate, num_workers=cfg.workers,
                        persistent_workers=cfg.workers > 0,
                        prefetch_factor=cfg.prefetch_factor if cfg.workers else None,
                        multiprocessing_context="fork" if cfg.workers else None)
    step = make_step(cfg, classes)
    timeline: list[Batch] = []
    wrong_samples = wrong_bytes = 0
    try:
        for _ in loader:  # the gate is shut: this only starts the workers
            raise AssertionError("the warm-up epoch is empty")
        gate.open = True
        start = time.perf_counter()
        if setup is not None:
            setup()
        last = start  # end of the previous batch: all time until the next one is waiting
        for epoch in range(cfg.epochs):
            gate.set_epoch(epoch)
            for i, batch in enumerate(loader):
                got = time.perf_counter()
                step(batch)
                done = time.perf_counter()
                for ok, n in zip(batch["ok"], batch["bytes"], strict=True):
                    if not ok:
                        wrong_samples += 1
                        wrong_bytes += n
                rec = Batch(epoch, i, done - start, got - last, done - got,
                            len(batch["label"]), sum(batch["bytes"]))
                timeline.append(rec)
                if on_batch is not None:
                    on_batch(rec)
                last = done
    finally:
        del loader  # persistent workers exit with their loader
        gc.collect()
    return LoopResult(timeline, wrong_samples, wrong_bytes)


def batches_per_epoch(samples: int, batch_size: int) -> int:
    return -(-samples // batch_size)


def announced_paths(index: Index, order: Sequence[int]) -> list[str]:
    """The file paths an epoch reads, in order (what a hint announces)."""
    return [index.paths[i] for i in order]
