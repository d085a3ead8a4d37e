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

The sampler resumes with the model. Save ``sampler.state_dict(consumed=samples_this_epoch)``
in the checkpoint beside the model's; after a restart (on a fresh node too),
``sampler.load_state_dict(state)`` makes the next ``iter()`` draw the same epoch's order
again, announce what is left of it from that position (so the spoke fetches the next
batches before the loader asks for them) and yield only the rest; the epochs after it are
the ones the first run would have drawn. ``consumed`` is what the training loop took (steps
x batch size): the loader's workers draw indices ahead of training, so the sampler's own
count (the default) would skip the batches that were in flight at the save.

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
        # For state_dict(): the epoch being yielded, how to draw its order again, and how
        # many of its samples were yielded.
        self._current: tuple[int, dict[str, Any]] | None = None
        self._yielded = 0
        self._resume: dict[str, Any] | None = None  # load_state_dict(): the next iter()

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
        full = len(self.sampler)  # type: ignore[arg-type]
        return full - int(self._resume["position"]) if self._resume else full

    def __iter__(self) -> Iterator[int]:
        resume, self._resume = self._resume, None
        if resume is not None:
            _restore_draw(self.sampler, resume["draw"])
        draw = _draw_state(self.sampler)
        order = list(iter(self.sampler))
        start = min(int(resume["position"]), len(order)) if resume else 0
        if start:
            order = order[start:]
        # Post in the background: the first batches must not wait for the hint's round trip
        # (the spoke fetches demand misses anyway, and the order catches up a moment later).
        if self._posting is not None:
            self._posting.join()
        self._posting = threading.Thread(target=self.announce, args=(order, self.epoch),
                                         name="spokefs-announce", daemon=True)
        self._posting.start()
        self._current = (self.epoch, {"draw": draw, "start": start})
        self._yielded = start
        self.epoch += 1
        return self._count(order)

    def _count(self, order: list[int]) -> Iterator[int]:
        for i in order:
            self._yielded += 1
            yield i

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """What a checkpoint keeps to resume the data where the model resumes: the epoch,
        the position in it (``consumed``: samples the training loop took since this epoch's
        ``iter()`` began, a resumed epoch's skipped part not counted; default: those this
        sampler yielded, which runs ahead by the loader's prefetch) and
        how its order is drawn again (the generator's state at the epoch's start, or the
        inner sampler's seed)."""
        if self._current is None:  # no epoch begun: resume at the start of the next
            return {"version": 1, "epoch": self.epoch, "position": 0, "draw": None}
        epoch, cur = self._current
        position = self._yielded  # counts from the epoch's start, a resumed part included
        if consumed is not None:  # counts from this iter()'s start; never past what it gave
            position = min(cur["start"] + max(consumed, 0), self._yielded)
        if position >= len(self.sampler):  # type: ignore[arg-type]
            return {"version": 1, "epoch": epoch + 1, "position": 0, "draw": None}
        return {"version": 1, "epoch": epoch, "position": position, "draw": cur["draw"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``'s answer: the next ``iter()`` is the rest of that
        epoch, announced to the spoke from that position."""
        if state.get("version") != 1:
            raise ValueError(f"not a spokefs AnnouncingSampler state: {state!r:.80}")
        self.set_epoch(int(state["epoch"]))
        position = int(state["position"])
        self._resume = ({"position": position, "draw": state["draw"]}
                        if position or state["draw"] is not None else None)

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


def _draw_state(sampler: object) -> dict[str, Any] | None:
    """How the order ``sampler`` is about to draw can be drawn again: its generator's state,
    torch's global one (a RandomSampler without a generator seeds itself from it), or nothing
    (a sampler whose order follows from its seed and epoch, such as DistributedSampler, or a
    fixed sequence)."""
    import torch

    gen = getattr(sampler, "generator", None)
    if isinstance(gen, torch.Generator):
        return {"generator": gen.get_state()}
    if isinstance(sampler, torch.utils.data.RandomSampler):
        return {"torch_rng": torch.get_rng_state()}
    return None


def _restore_draw(sampler: object, draw: dict[str, Any] | None) -> None:
    import torch

    if draw is None:
        return
    if "generator" in draw:
        gen = getattr(sampler, "generator", None)
        if not isinstance(gen, torch.Generator):
            raise ValueError("the saved sampler state holds a generator's state, but this "
                             "sampler has no generator: build it as it was built")
        gen.set_state(draw["generator"])
    elif "torch_rng" in draw:
        torch.set_rng_state(draw["torch_rng"])


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
