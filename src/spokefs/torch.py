"""``spokefs.torch``: announce each epoch's sample order to the spoke, for any sampler.

    from spokefs.torch import AnnouncingSampler
    sampler = AnnouncingSampler(RandomSampler(ds), paths=ds.paths,
                                url="http://spoke:8471/imagenet", job="resnet50-run3",
                                root="/mnt/imagenet")
    loader = DataLoader(ds, sampler=sampler, num_workers=8, ...)

The wrapper draws the inner sampler's order for the epoch in the main process (so DataLoader
workers need nothing), posts it (paths, optionally a byte range per sample for samples inside
shards), and yields the same order. The spoke then fetches exactly ahead of the readers and,
when the cache is smaller than the dataset, evicts the block whose next use is farthest away.
Works the same whether the dataset reads through the mount or through ``spokefs.open``.
A spoke that cannot be reached only costs the hint: training goes on, with a warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from spokefs.client.control import SpokeControl
from spokefs.errors import SpokeError

log = logging.getLogger(__name__)


class AnnouncingSampler(Sampler[int]):
    def __init__(self, sampler: Sampler[int] | Sequence[int],
                 paths: Sequence[str] | Callable[[int], str], url: str,
                 job: str = "default", root: str = "",
                 ranges: Callable[[int], tuple[int, int]] | None = None,
                 deadline: float = 5.0) -> None:
        """``paths[i]`` (or ``paths(i)``) is sample i's file, relative to the dataset, or
        under ``root`` (a mountpoint) which is stripped. ``ranges(i)``, when given, is sample
        i's (offset, length) inside its file."""
        self.sampler = sampler
        self.paths = paths
        self.root = root.rstrip("/") + "/" if root else ""
        self.ranges = ranges
        rank = getattr(sampler, "rank", None)  # DistributedSampler: one order per rank
        self.control = SpokeControl(url, job=job if rank is None else f"{job}.rank{rank}",
                                    deadline=deadline)
        self.epoch = 0
        self._posting: threading.Thread | None = None

    def _path(self, i: int) -> str:
        p = self.paths(i) if callable(self.paths) else self.paths[i]
        p = str(p)
        if self.root and p.startswith(self.root):
            p = p[len(self.root):]
        return p.lstrip("/")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        order = list(iter(self.sampler))
        # Post in the background: the first batches must not wait for the hint's round trip
        # (the spoke fetches demand misses anyway, and the order catches up a moment later).
        if self._posting is not None:
            self._posting.join()
        self._posting = threading.Thread(target=self.announce, args=(order, self.epoch),
                                         name="spokefs-announce", daemon=True)
        self._posting.start()
        self.epoch += 1
        return iter(order)

    def wait_announced(self, timeout: float | None = None) -> None:
        """Block until the last order was posted (tests; a readiness check)."""
        if self._posting is not None:
            self._posting.join(timeout)

    def announce(self, order: Sequence[int], epoch: int | None = None) -> dict[str, Any] | None:
        try:
            return self.control.announce(
                self.epoch if epoch is None else epoch, paths=[self._path(i) for i in order],
                ranges=[self.ranges(i) for i in order] if self.ranges else None)
        except (SpokeError, OSError) as exc:
            log.warning("could not announce epoch %d's order to the spoke (%s); "
                        "training goes on without the hint", self.epoch, exc)
            return None
