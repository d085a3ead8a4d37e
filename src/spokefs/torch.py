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

``StepReporter`` tells the spoke how long each batch waited for its data and how long the
step then took, so the spoke's dashboard (``/ui``) and ``/metrics`` show whether the job is
data-bound next to the cache's state:

    from spokefs.torch import StepReporter
    with StepReporter("http://spoke:8471/imagenet", job="resnet50-run3") as steps:
        for batch in steps.wrap(loader):     # times the wait for each batch
            train_step(batch)                # and the step, until the next batch is asked

Reports are batched and posted by a background thread at most about once a second; the
training loop never waits for the spoke, and a spoke that is down just loses the reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from torch.utils.data import Sampler

from spokefs.client.control import SpokeControl
from spokefs.errors import SpokeError
from spokefs.spoke.jobsignal import MAX_STEPS

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PENDING = MAX_STEPS  # steps held for the next post: what the spoke takes in one


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


class StepReporter:
    """Reports each batch's data wait and step time to the spoke, fire-and-forget.

    ``step(data_wait_s, step_s)`` (or ``wrap(loader)``, which measures both) only appends to
    a list under a lock; a background thread, started with the first step, posts what
    gathered at most every ``every`` seconds. A post that fails (spoke down, refused) drops
    its steps with one warning; at most ``MAX_PENDING`` steps wait, the rest are dropped and
    counted (``dropped``). ``close()`` (or leaving the ``with``) posts what is left, waiting
    at most ``deadline`` seconds."""

    def __init__(self, url: str, job: str = "default", every: float = 1.0,
                 deadline: float = 2.0, rank: int | None = None) -> None:
        """``url``: the spoke and dataset (``http://spoke:8471/imagenet``). ``rank``: a
        distributed job's rank, reported as its own job (``job.rankN``)."""
        self.control = SpokeControl(url, job=job if rank is None else f"{job}.rank{rank}",
                                    deadline=deadline)
        self.every = every
        self.deadline = deadline
        self.sent = 0      # steps the spoke took
        self.dropped = 0   # steps lost: the spoke failed, or too many waited
        self._pending: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._posting = False  # a batch taken from _pending is being posted
        self._thread: threading.Thread | None = None
        self._warned = False

    def step(self, data_wait_s: float, step_s: float) -> None:
        """One batch: the seconds the loop waited for it, then spent on it."""
        with self._lock:
            if self._closed:
                return
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                return
            self._pending.append((max(0.0, data_wait_s), max(0.0, step_s)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spokefs-steps",
                                                daemon=True)
                self._thread.start()

    def wrap(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield ``batches``' items, timing each: the wait is the time to get the item, the
        step the time until the loop asks for the next one."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            try:
                yield item
            finally:  # also when the loop breaks out: that step counts too
                self.step(t1 - t0, time.perf_counter() - t1)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.every)
            self._wake.clear()
            with self._lock:
                batch, self._pending = self._pending, []
                closed = self._closed
                self._posting = bool(batch)
            if batch:
                self._post(batch)
                with self._lock:
                    self._posting = False
            if closed:
                return

    def _post(self, batch: list[tuple[float, float]]) -> None:
        try:
            self.control.report_steps(batch)
            self.sent += len(batch)
        except Exception as exc:  # never the training loop's problem: the report is lost
            with self._lock:
                self.dropped += len(batch)
            if not self._warned:
                self._warned = True
                log.warning("could not report steps to the spoke (%s); training goes on, "
                            "reports are dropped while it cannot be reached", exc)
            else:
                log.debug("step report lost: %s", exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Post what waits now and wait until it was posted (or dropped), at most
        ``timeout`` (default ``deadline``) seconds; whether it was (tests, before a pause)."""
        end = time.monotonic() + (self.deadline if timeout is None else timeout)
        self._wake.set()
        while True:
            with self._lock:
                if not self._pending and not self._posting:
                    return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Post what is left (waiting at most about ``deadline``) and stop the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._wake.set()
            thread.join(self.deadline + 1.0)

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
