"""The planner: events in, actions out (see the package docstring for how to drive it).

``Planner`` routes each event to its parts and keeps nothing of its own but the manifests
and the clock of the last idle check:

- ``Readahead`` (readahead.py): sequential streams inside a file;
- ``OrderPlanner`` (announced.py): announced orders, pinned and queued ahead of the reader;
- ``WorkingSetPlanner`` (learned.py): learned working sets, kept and filled in the background;
- ``Budget`` (budget.py): every fetch in flight, and the prefetches waiting for room;
- ``PinLedger`` (pins.py): the bytes every holder has pinned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence
from typing import Any, Protocol

from spokefs.errors import ConfigError
from spokefs.planner.announced import JobKey, OrderPlanner
from spokefs.planner.budget import Budget
from spokefs.planner.events import (
    Action,
    CapacityChanged,
    EpochBoundary,
    Event,
    Evicted,
    FetchDone,
    FetchFailed,
    JobEnded,
    ManifestAdded,
    OrderAnnounced,
    Read,
    WorkingSetRestored,
)
from spokefs.planner.learned import WorkingSetPlanner
from spokefs.planner.manifest import DEFAULT_BLOCK_SIZE, Manifest
from spokefs.planner.pins import PinLedger
from spokefs.planner.readahead import Readahead
from spokefs.planner.settings import Settings
from spokefs.planner.workingset import WorkingSet
from spokefs.policy import BlockKey


class Resident(Protocol):
    """What the planner asks of the cache: whether a block is resident now. Asked only
    inside ``handle``; the spoke's store answers it from the index its event loop owns,
    the loop that also runs the planner, so no other thread changes it meanwhile."""

    def __contains__(self, key: object, /) -> bool: ...


class Planner:
    """Sans-I/O prefetch planner for one spoke (all datasets and jobs it serves).

    Parameters (bytes unless said otherwise):

    - ``capacity``: the cache's capacity (``CapacityChanged`` updates it).
    - ``max_inflight_bytes``: outstanding prefetches at most (about twice the link's
      bandwidth-delay product); demand fetches are never held back.
    - ``readahead_min_bytes`` / ``readahead_max_bytes``: the sequential readahead window
      starts at the first, doubles per block read sequentially, stops at the second (the BDP).
    - ``lookahead_bytes``: how far ahead of an announced order's reader to fetch and pin
      (at most half the capacity, shared between jobs).
    - ``disorder_window``: how many positions reads may run ahead of the oldest unread one in
      an announced order (DataLoader workers x prefetch factor x batch size is a good size).
      Past it, unread positions count as read: their pins go and their queued prefetches
      are dropped, so a window under the loader's spread turns the slow workers' reads into
      demand misses. 16,384 covers 32 workers x 2 x 256 (measured: 12 workers of 256 with
      the old 1,024 waited 12-21 s on a first batch).
    - ``scan_threshold``: distinct files, read once each, before an epoch scan is assumed.
    - ``reserve_bytes``: capacity never given to learned working sets: room for demand
      misses, readahead and the end-of-epoch prefetch (default: max_inflight_bytes, at most
      a tenth of the capacity, at least two blocks).
    - ``learn`` / ``readahead``: switch working-set learning / sequential readahead.
    - ``idle_timeout``: seconds (of the ``now`` events carry) after which a job that stopped
      reading loses its pins and plans (its learned working set and its announced order).
    - ``max_jobs``: announced orders, and learners, kept at once (job names are chosen by
      clients): one more order than this is refused; one more learner drops the learner
      that read least recently (learning is a hint, and is learnt again).
    - ``resident``: the cache's residency (``Resident``: ``key in resident``; the spoke
      passes its ``BlockStore``, an eviction policy will do too). Without one the planner
      tracks ``FetchDone`` and ``Evicted``.
    - ``block_size``: for files not in a manifest.
    """

    def __init__(
        self,
        *,
        capacity: int,
        max_inflight_bytes: int = 150_000_000,
        readahead_min_bytes: int | None = None,
        readahead_max_bytes: int = 64 << 20,
        lookahead_bytes: int = 1 << 30,
        disorder_window: int = 16384,
        scan_threshold: int = 12,
        reserve_bytes: int | None = None,
        learn: bool = True,
        readahead: bool = True,
        idle_timeout: float = 3600.0,
        max_jobs: int = 256,
        resident: Resident | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        self.settings = s = Settings(
            capacity, max_inflight_bytes, readahead_min_bytes or block_size,
            readahead_max_bytes, lookahead_bytes, disorder_window, scan_threshold,
            reserve_bytes, learn, readahead, idle_timeout, max_jobs, block_size,
        )  # fmt: skip
        self.stats: Counter[str] = Counter()
        self._own_resident: set[BlockKey] | None = None if resident is not None else set()
        self._resident: Container[BlockKey] = (
            resident if resident is not None else self._own_resident  # type: ignore[assignment]
        )
        self._manifests: dict[str, Manifest] = {}
        self._last_idle_check = 0.0
        self._held: list[Action] = []  # decided before a refused event: sent next time
        self.readahead = Readahead(block_size, s.readahead_min_bytes, readahead_max_bytes)
        self.budget = Budget(max_inflight_bytes, self._resident, self.stats)
        self.pins = PinLedger()
        self.orders = OrderPlanner(s, self.budget, self.pins, self.stats)
        self.learning = WorkingSetPlanner(s, self.budget, self.pins, self.orders,
                                          self._resident, self.stats)

    # -- what it holds --------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.settings.capacity

    @property
    def reserve_bytes(self) -> int:
        return self.settings.reserve_bytes

    @property
    def prefetch_inflight_bytes(self) -> int:
        return self.budget.prefetch_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.pins.bytes

    def manifest(self, dataset: str) -> Manifest | None:
        return self._manifests.get(dataset)

    def readahead_window(self, dataset: str, path: str, reader_id: str | int = 0) -> int:
        return self.readahead.window((dataset, path, reader_id))

    def order_position(self, dataset: str, job: str) -> int | None:
        return self.orders.position(dataset, job)

    def working_set(self, dataset: str, job: str = "") -> WorkingSet | None:
        """What (dataset, job) read in its last complete epoch, to persist."""
        return self.learning.working_set(dataset, job)

    def jobs(self, sample: int = 20_000) -> list[dict[str, Any]]:
        """Per (dataset, job): the working set it is predicted to read (bytes), what is kept
        resident for it and how much of that is resident now, and an announced order's
        progress (positions read of those announced). Resident bytes are estimated from an
        even sample of at most ``sample`` kept blocks: a status call must not walk millions."""
        out = self.learning.status(sample)
        for jk, order in self.orders.status().items():
            out.setdefault(jk, {"dataset": jk[0], "job": jk[1]})["order"] = order
        return [out[k] for k in sorted(out)]

    # -- events ---------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        """The actions ``event`` calls for, in order. An event refused (ConfigError,
        BadRequest) changes no plan of its own; what the planner did before the refusal
        (releasing idle jobs) is sent with the next call's actions, never lost."""
        out, self._held = self._held, []
        try:
            self._handle(event, out)
        except Exception:
            self._held = out
            raise
        return out

    def _handle(self, event: Event, out: list[Action]) -> None:
        now = getattr(event, "now", 0.0)
        if now - self._last_idle_check >= 1.0:
            self._last_idle_check = now
            self._expire(now, out)
        if isinstance(event, Read):
            self._on_read(event, out)
        elif isinstance(event, (FetchDone, FetchFailed)):
            self.budget.done(event.key)
            if self._own_resident is not None:
                if isinstance(event, FetchDone):
                    self._own_resident.add(event.key)
                else:
                    self._own_resident.discard(event.key)
            if isinstance(event, FetchFailed):
                self.stats["fetch_failed"] += 1
        elif isinstance(event, Evicted):
            if self._own_resident is not None:
                self._own_resident.discard(event.key)
        elif isinstance(event, OrderAnnounced):
            cur = self.orders.announce(event, self._manifests.get(event.dataset), out)
            # An announced order beats learning: drop what learning holds for this job.
            self.learning.release_job(event.dataset, event.job, out)
            self.learning.release_job(event.dataset, "", out)
            self.learning.allocate(out)
            self.orders.fill(cur, event.dataset, out)
        elif isinstance(event, EpochBoundary):
            self.learning.epoch_boundary(event.dataset, event.job, out)
        elif isinstance(event, JobEnded):
            self._end_job(event.dataset, event.job, out)
        elif isinstance(event, CapacityChanged):
            if event.capacity <= 0:
                raise ConfigError(f"capacity must be > 0 bytes, got {event.capacity}")
            self.settings.capacity = event.capacity
            self.learning.allocate(out)
            self.orders.fill_all(out)
        elif isinstance(event, ManifestAdded):
            self._manifests[event.dataset] = event.manifest
        elif isinstance(event, WorkingSetRestored):
            ws = event.working_set
            if isinstance(ws, dict):
                ws = WorkingSet.from_json(ws)
            m = self._manifests.get(ws.dataset)
            if m is None:
                raise ConfigError(f"no manifest for dataset {ws.dataset!r}; add it first "
                                  "(ManifestAdded)")
            self.learning.restore(ws, m, event.now, out)
        else:
            raise TypeError(f"not a planner event: {event!r}")
        self._pump(out)

    def _pump(self, out: list[Action]) -> None:
        # Readahead and orders first (nearest need first), then learned sets' fills.
        if self.budget.pump(out):
            self.learning.pump(out)

    def _on_read(self, ev: Read, out: list[Action]) -> None:
        self.stats["reads"] += 1
        m = self._manifests.get(ev.dataset)
        fi = m.index(ev.path) if m is not None else None
        if fi is not None and m is not None and m.versions[fi] != ev.version:
            fi = None  # another snapshot's file: block maths only
        bs = m.block_size if m is not None else self.settings.block_size
        sid = (ev.dataset, ev.path, ev.reader_id)
        stream, fresh = self.readahead.on_read(sid, ev.size, ev.offset, ev.length)
        end = min(ev.size, ev.offset + ev.length)
        touched = range(ev.offset // bs, (end - 1) // bs + 1) if end > ev.offset else range(0)

        learning = self.learning
        ln = (learning.learner_for(ev.dataset, ev.job, m, out)
              if self.settings.learn and fi is not None else None)
        keep = ln is not None and fi is not None and learning.keeps(ln, fi)
        for b in touched:
            key = (ev.version, b)
            if key in self._resident:
                if b >= fresh:
                    self.stats["hit_blocks"] += 1
                continue
            if b >= fresh:
                self.stats["miss_blocks"] += 1
            size = min(bs, ev.size - b * bs)
            if keep and ln is not None:
                learning.pin_read(ln, key, size, out)
            self.budget.demand(key, size, ev.dataset, out)

        if fi is not None and self.orders.cursors and self.orders.on_read(
                ev, fi, [b for b in touched if b >= fresh], out):
            return
        if self.settings.readahead and stream.alive:
            for b in self.readahead.ahead(stream, ev.size):
                size = min(bs, ev.size - b * bs)
                self.budget.want((ev.version, b), size, 1 + b - touched.start, "readahead",
                                 ev.dataset, stream)
        if ln is not None and fi is not None and fresh == ev.offset // bs:
            learning.on_read(ln, fi, ev.now, out)

    # -- endings ----------------------------------------------------------------------------
    def _end_job(self, dataset: str, job: str, out: list[Action]) -> None:
        self.orders.end(dataset, job, out)
        self.learning.release_job(dataset, job, out)
        self.learning.allocate(out)

    def _expire(self, now: float, out: list[Action]) -> None:
        for jk in self.learning.idle(now):
            self.stats["idle_released"] += 1
            self._end_job(*jk, out)
        for jk in self.orders.idle(now):  # announced, then nothing read for long
            self.stats["idle_released"] += 1
            self._end_job(*jk, out)

    def __repr__(self) -> str:
        return (
            f"<Planner capacity={self.capacity} inflight={len(self.budget.inflight)} "
            f"prefetch_bytes={self.budget.prefetch_bytes} pinned_bytes={self.pins.bytes} "
            f"orders={len(self.orders)} learners={len(self.learning.learners)}>"
        )


def as_indexes(manifest: Manifest, paths: Sequence[str]) -> list[int]:
    """Manifest indexes of ``paths`` (for a compact ``OrderAnnounced``)."""
    out = []
    for p in paths:
        i = manifest.index(p)
        if i is None:
            raise ConfigError(f"{p!r} is not in the snapshot; announce paths it holds")
        out.append(i)
    return out


__all__ = ["JobKey", "Planner", "Resident", "as_indexes"]
