"""The training loop every scenario runs: a real DataLoader, an emulated accelerator.

The accelerator step is emulated the way MLPerf Storage does it: a fixed compute time per
batch (sleep), or with ``model=True`` a real training step: a small CNN on the CPU
(``arch="tiny"``), or torchvision's ResNet-50 on ``device`` (``arch="resnet50"``: bf16
autocast and channels-last on CUDA, SGD). The loop records, per batch, how long it waited for
data and how long it computed (``metrics.Batch``); on CUDA a step ends when the device is
done with it (synchronised), so its compute time is the accelerator's.

Each worker reads a sample through the scenario's opener, hashes it and compares with the
digest recorded when the dataset was built; a mismatch is counted, never hidden.
"""

from __future__ import annotations

import gc
import itertools
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
# The image each architecture trains on. No decode: a sample's bytes are cropped or padded
# with zeros to the image's size (``sample_image``).
ARCH_SHAPES: dict[str, tuple[int, int, int]] = {"tiny": IMAGE_SHAPE, "resnet50": (3, 224, 224)}
WARMUP_STEPS = 3  # untimed steps on random images before the clock starts (cuDNN autotuning)


@dataclass(frozen=True, slots=True)
class LoopConfig:
    epochs: int = 3
    batch_size: int = 16
    workers: int = 4
    compute_s: float = 0.1      # emulated accelerator time per batch (ignored with model)
    model: bool = False
    prefetch_factor: int = 2
    seed: int = 0
    arch: str = "tiny"          # with model: "tiny" (a small CNN) or "resnet50" (torchvision)
    device: str = "cpu"         # with model: where it trains ("cpu", "cuda", "cuda:1", ...)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return ARCH_SHAPES[self.arch] if self.model else IMAGE_SHAPE

    def describe_accelerator(self) -> str:
        if not self.model:
            return f"sleep {self.compute_s * 1000:g} ms per batch"
        if self.arch == "tiny":
            return f"tiny CNN on {self.device}"
        where = self.device
        if where.startswith("cuda"):
            where += f" ({torch.cuda.get_device_name(torch.device(where))}, bf16 autocast)"
        return f"{self.arch} on {where}"


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


class _AllEpochs(Sampler[list[int]]):
    """Every epoch's batches in one pass of the DataLoader (an epoch's last batch may be short;
    no batch spans two epochs). The DataLoader keeps prefetching across an epoch boundary, as
    with the infinite samplers large trainers use; a ``for batch in loader`` per epoch would
    restart its iteration (a handshake with every worker, an empty prefetch queue), so every
    epoch would open with a stall of the loop's making, longer the busier the machine."""

    def __init__(self, inner: Sampler[int], epochs: int, batch_size: int) -> None:
        self.inner, self.epochs, self.batch_size = inner, epochs, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for epoch in range(self.epochs):
            if hasattr(self.inner, "set_epoch"):
                self.inner.set_epoch(epoch)
            order = iter(self.inner)  # iterated when reached: a hint posts as it would
            while batch := list(itertools.islice(order, self.batch_size)):
                yield batch

    def __len__(self) -> int:
        return self.epochs * batches_per_epoch(len(self.inner),  # type: ignore[arg-type]
                                               self.batch_size)


class _Gate(Sampler[list[int]]):
    """Outermost (batch) sampler: empty until opened, so the worker warm-up pass neither reads
    nor announces anything (a wrapped sampler may post its order when iterated)."""

    def __init__(self, inner: _AllEpochs) -> None:
        self.inner = inner
        self.open = False

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.inner) if self.open else iter(())

    def __len__(self) -> int:
        return len(self.inner) if self.open else 0  # type: ignore[arg-type]


def sample_image(data: bytes | memoryview, nbytes: int) -> bytes:
    """A sample "decoded" into an image of ``nbytes`` bytes: its first ``nbytes`` bytes,
    padded with zeros when it is shorter (random bytes: there is nothing to decode)."""
    return bytes(data[:nbytes]).ljust(nbytes, b"\0")


class SampleDataset(Dataset[dict[str, Any]]):
    """Reads sample i through the opener and checks it against the source's digest.

    The "decoded image" (the sample's first ``image_bytes`` bytes, 3072 by default) leaves
    the worker as bytes: each tensor crossing from a worker costs a shared-memory handshake
    (2-3 ms per batch measured here on 2 cores), which would let the CPU, not the emulated
    accelerator, set the pace for small images. ``collate`` joins a batch's images and the
    main process makes the tensor (``batch_images``); for larger images ``collate_tensor``
    makes it in the worker, so a batch crosses in shared memory, not through a pipe."""

    def __init__(self, index: Index, opener: Opener, image_bytes: int = IMAGE_BYTES) -> None:
        self.index = index
        self.opener = opener
        self.image_bytes = image_bytes

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ix = self.index
        data = self.opener.read(ix.paths[i], ix.offsets[i], ix.sizes[i])
        ok = len(data) == ix.sizes[i] and sample_digest(data) == ix.digests[i]
        return {"image": sample_image(data, self.image_bytes),
                "label": ix.labels[i], "bytes": ix.sizes[i], "ok": ok}


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch as plain Python (pickled through the worker queue, no shared memory)."""
    return {"image": b"".join(x["image"] for x in items),
            "label": [x["label"] for x in items], "bytes": [x["bytes"] for x in items],
            "ok": [x["ok"] for x in items]}


def collate_tensor(items: list[dict[str, Any]]) -> dict[str, Any]:
    """``collate`` with the images as one flat uint8 tensor: made in the worker, it crosses
    to the main process in shared memory (one handshake a batch, no copy through a pipe)."""
    batch = collate(items)
    batch["image"] = torch.frombuffer(bytearray(batch["image"]), dtype=torch.uint8)
    return batch


def batch_uint8(batch: dict[str, Any]) -> torch.Tensor:
    """The batch's images, flat uint8, from either collate."""
    raw = batch["image"]
    if isinstance(raw, torch.Tensor):
        return raw
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def batch_images(batch: dict[str, Any], shape: tuple[int, ...] = IMAGE_SHAPE) -> torch.Tensor:
    """The batch's images as a float tensor [B, *shape] in [0, 1]."""
    return batch_uint8(batch).view(-1, *shape).float().div_(255.0)


class TinyCNN(torch.nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_step(cfg: LoopConfig, classes: int,
              warm_sizes: Sequence[int] = ()) -> Callable[[dict[str, Any]], None]:
    """The accelerator: a sleep of ``compute_s``, or one optimiser step of a tiny CNN, or of
    a torchvision model (``cfg.arch``) warmed up on random batches of ``warm_sizes``."""
    if not cfg.model:
        def sleep_step(batch: dict[str, Any]) -> None:
            time.sleep(cfg.compute_s)
        return sleep_step
    torch.manual_seed(cfg.seed)
    if cfg.arch != "tiny":
        return make_vision_step(cfg, classes, warm_sizes)
    model = TinyCNN(classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def model_step(batch: dict[str, Any]) -> None:
        opt.zero_grad()
        loss_fn(model(batch_images(batch)), torch.tensor(batch["label"])).backward()
        opt.step()
    return model_step


def make_vision_step(cfg: LoopConfig, classes: int,
                     warm_sizes: Sequence[int] = ()) -> Callable[[dict[str, Any]], None]:
    """One SGD step of torchvision's ``cfg.arch`` (random weights) on ``cfg.device``:
    channels-last, bf16 autocast on CUDA (fp32 elsewhere), the step synchronised so its time
    is the device's. ``WARMUP_STEPS`` untimed steps per size in ``warm_sizes`` first, so
    cuDNN's autotuning and the allocator's growth are start-up, not data wait."""
    try:
        import torchvision
    except ImportError as exc:
        raise RuntimeError(f"--model {cfg.arch} needs torchvision ({exc})") from exc
    if cfg.arch not in ARCH_SHAPES:
        raise ValueError(f"unknown model {cfg.arch!r}; known: {', '.join(ARCH_SHAPES)}")
    dev = torch.device(cfg.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
    shape = ARCH_SHAPES[cfg.arch]
    model = getattr(torchvision.models, cfg.arch)(weights=None, num_classes=classes)
    model = model.to(dev, memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def images_step(images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.view(-1, *shape).float().div_(255.0)
        x = x.contiguous(memory_format=torch.channels_last)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model(x), labels)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)

    for n in sorted({n for n in warm_sizes if n > 0}):
        for _ in range(WARMUP_STEPS):
            images_step(torch.randint(0, 256, (n, *shape), dtype=torch.uint8, device=dev),
                        torch.randint(0, classes, (n,), device=dev))

    def vision_step(batch: dict[str, Any]) -> None:
        images_step(batch_uint8(batch).to(dev), torch.tensor(batch["label"], device=dev))
    return vision_step


@dataclass(slots=True)
class LoopResult:
    timeline: list[Batch]
    samples_wrong: int
    bytes_wrong: int
    started_unix: float = 0.0  # wall-clock time of t = 0 (to line up outside samplers)


def run_loop(index: Index, shape: str, opener: Opener, cfg: LoopConfig, classes: int,
             setup: Callable[[], None] | None = None,
             wrap_sampler: Callable[[EpochSampler], Sampler[int]] | None = None,
             on_batch: Callable[[Batch], None] | None = None,
             ready: Callable[[], None] | None = None) -> LoopResult:
    """Train for ``cfg.epochs`` epochs and return the per-batch timeline.

    The clock starts once the DataLoader's worker processes exist (a pass over an empty
    epoch forks them: framework start-up, not data access; about 0.5 s on 2 cores). Every
    byte is read after it starts. ``setup`` runs after the clock starts and is charged to the
    first batch's data wait (the staged copy). ``wrap_sampler`` lets a scenario announce the
    order (hints). ``ready`` runs once the workers exist and the step is made, just before
    the clock starts: loops run side by side (``bench contention``) start together there."""
    # More workers than cores is deliberate: they mostly wait on I/O, not the CPU.
    warnings.filterwarnings("ignore", message=".*suggested max number of worker",
                            category=UserWarning)
    gate = _Gate(_AllEpochs(wrap_sampler(EpochSampler(index, cfg.seed, shape)) if wrap_sampler
                            else EpochSampler(index, cfg.seed, shape),
                            cfg.epochs, cfg.batch_size))
    per_epoch = batches_per_epoch(len(index), cfg.batch_size)
    image_bytes = math.prod(cfg.image_shape)
    loader = DataLoader(SampleDataset(index, opener, image_bytes), batch_sampler=gate,
                        collate_fn=collate if image_bytes <= IMAGE_BYTES else collate_tensor,
                        num_workers=cfg.workers, persistent_workers=cfg.workers > 0,
                        prefetch_factor=cfg.prefetch_factor if cfg.workers else None,
                        multiprocessing_context="fork" if cfg.workers else None)
    timeline: list[Batch] = []
    wrong_samples = wrong_bytes = 0
    try:
        for _ in loader:  # the gate is shut: this only starts the workers
            raise AssertionError("the warm-up epoch is empty")
        # The model after the workers start: the first fork comes before CUDA is touched.
        step = make_step(cfg, classes, (cfg.batch_size, len(index) % cfg.batch_size))
        if ready is not None:
            ready()
        gate.open = True
        start, started_unix = time.perf_counter(), time.time()
        if setup is not None:
            setup()
        last = start  # end of the previous batch: all time until the next one is waiting
        for k, batch in enumerate(loader):  # every epoch in one pass (_AllEpochs)
            got = time.perf_counter()
            step(batch)
            done = time.perf_counter()
            for ok, n in zip(batch["ok"], batch["bytes"], strict=True):
                if not ok:
                    wrong_samples += 1
                    wrong_bytes += n
            rec = Batch(k // per_epoch, k % per_epoch, done - start, got - last, done - got,
                        len(batch["label"]), sum(batch["bytes"]))
            timeline.append(rec)
            if on_batch is not None:
                on_batch(rec)
            last = done
    finally:
        del loader  # persistent workers exit with their loader
        gc.collect()
    return LoopResult(timeline, wrong_samples, wrong_bytes, started_unix)


def batches_per_epoch(samples: int, batch_size: int) -> int:
    return -(-samples // batch_size)


def announced_paths(index: Index, order: Sequence[int]) -> list[str]:
    """The file paths an epoch reads, in order (what a hint announces)."""
    return [index.paths[i] for i in order]
