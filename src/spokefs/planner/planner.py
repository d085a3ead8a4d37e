"""The planner: events in, actions out (see the package docstring for how to drive it)."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from spokefs.errors import ConfigError
from spokefs.planner.events import (
    DEMAND,
    Action,
    CapacityChanged,
    EpochBoundary,
    Event,
    Evicted,
    Fetch,
    FetchDone,
    FetchFailed,
    JobEnded,
    OrderAnnounced,
    Pin,
    Read,
    SetFuture,
    Unpin,
    WorkingSetLearned,
)
from spokefs.planner.events import Cancel as CancelAction
from spokefs.planner.manifest import DEFAULT_BLOCK_SIZE, Manifest
from spokefs.planner.order import OrderCursor, check_order
from spokefs.planner.readahead import Readahead
from spokefs.planner.workingset import ENDGAME, KEEP, SEEN, ScanState, WorkingSet
from spokefs.policy import BlockKey

# Priority bands (lower first). Readahead and announced order use 1 + distance in blocks or
# positions from the reader, so the nearest need goes first whoever asked for it; filling a
# learned working set comes after every such need.
WORKING_SET_PRIORITY = 1 << 20

_JobKey = tuple[str, str]  # (dataset, job)
# What a fill generator yields: (key, size, priority, reason); reason "pin" asks for a pin.
_Item = tuple[BlockKey, int, int, str]


@dataclass(slots=True)
class _Inflight:
    size: int
    priority: int
    reason: str
    owner: object = None


@dataclass(eq=False)
class _Learner:
    """A (dataset, job) learning its working set and keeping (part of) it resident."""

    dataset: str
    job: str
    m: Manifest
    scan: ScanState
    alloc: int = 0  # bytes it may keep pinned
    keep: list[int] = field(default_factory=list)  # KEEP files in selection order
    keep_bytes: int = 0
    pinned: dict[BlockKey, int] = field(default_factory=dict)  # key -> size
    endgame_pinned: dict[BlockKey, int] = field(default_factory=dict)
    endgame_bytes: int = 0  # sum of endgame_pinned
    endgame_budget: int = 0  # what the endgame may pin: the room when it started
    unread_other: int = 0  # predicted, unread this epoch, not kept: bytes
    fill: Iterator[_Item] | None = None
    endgame: Iterator[_Item] | None = None
    endgame_done: bool = False  # this epoch's endgame ran
    pending: _Item | None = None  # a fetch the budget held back


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
    - ``resident``: a view of the cache's residency (``key in resident``; the spoke passes its
      ``BlockStore``, an eviction policy will do too). Without one the planner tracks
      ``FetchDone`` and ``Evicted``.
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
        disorder_window: int = 1024,
        scan_threshold: int = 12,
        reserve_bytes: int | None = None,
        learn: bool = True,
        readahead: bool = True,
        idle_timeout: float = 3600.0,
        max_jobs: int = 256,
        resident: Container[BlockKey] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        for name, value in (
            ("capacity", capacity), ("max_inflight_bytes", max_inflight_bytes),
            ("readahead_max_bytes", readahead_max_bytes), ("lookahead_bytes", lookahead_bytes),
            ("block_size", block_size),
        ):  # fmt: skip
            if value <= 0:
                raise ConfigError(f"planner {name} must be > 0 bytes, got {value}")
        self.capacity = capacity
        self.max_inflight_bytes = max_inflight_bytes
        self.lookahead_bytes = lookahead_bytes
        self.disorder_window = disorder_window
        self.scan_threshold = scan_threshold
        self._reserve_opt = reserve_bytes
        self.learn = learn
        self.readahead_enabled = readahead
        self.idle_timeout = idle_timeout
        self.max_jobs = max_jobs
        self.block_size = block_size
        self._own_resident: set[BlockKey] | None = None if resident is not None else set()
        self._resident: Container[BlockKey] = (
            resident if resident is not None else self._own_resident  # type: ignore[assignment]
        )
        self._readahead = Readahead(
            block_size, readahead_min_bytes or block_size, readahead_max_bytes
        )
        self._manifests: dict[str, Manifest] = {}
        self._inflight: dict[BlockKey, _Inflight] = {}
        self._prefetch_bytes = 0
        # (priority, seq, key, size, reason, owner, tag): owner.alive False, or an order's
        # position (tag) already read, makes an entry stale.
        self._queue: list[tuple[int, int, BlockKey, int, str, Any, int]] = []
        self._seq = 0
        self._orders: dict[_JobKey, OrderCursor] = {}
        self._order_seen: dict[_JobKey, float] = {}  # last announce or read of each order
        self._order_pins: dict[BlockKey, int] = {}  # key -> pin count from orders
        self._learners: dict[_JobKey, _Learner] = {}
        self._pinned_bytes = 0
        self._order_pinned_bytes = 0
        self._demand_bytes = 0  # demand fetches in flight
        self._last_idle_check = 0.0
        self.stats: Counter[str] = Counter()

    # -- inputs besides events ------------------------------------------------------------
    def add_manifest(self, dataset: str, manifest: Manifest) -> None:
        """The snapshot ``dataset`` resolves to. Learning and announced orders need it."""
        self._manifests[dataset] = manifest

    def manifest(self, dataset: str) -> Manifest | None:
        return self._manifests.get(dataset)

    @property
    def reserve_bytes(self) -> int:
        if self._reserve_opt is not None:
            return self._reserve_opt
        return max(2 * self.block_size, min(self.max_inflight_bytes, self.capacity // 10))

    @property
    def prefetch_inflight_bytes(self) -> int:
        return self._prefetch_bytes

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def readahead_window(self, dataset: str, path: str, reader_id: str | int = 0) -> int:
        return self._readahead.window((dataset, path, reader_id))

    def order_position(self, dataset: str, job: str) -> int | None:
        cur = self._orders.get((dataset, job))
        return cur.pos if cur else None

    def jobs(self, sample: int = 20_000) -> list[dict[str, Any]]:
        """Per (dataset, job): the working set it is predicted to read (bytes), what is kept
        resident for it and how much of that is resident now, and an announced order's
        progress (positions read of those announced). Resident bytes are estimated from an
        even sample of at most ``sample`` kept blocks: a status call must not walk millions."""
        out: dict[_JobKey, dict[str, Any]] = {}
        for jk, ln in self._learners.items():
            pins = ln.pinned
            step = max(1, len(pins) // sample)
            seen = have = 0
            for key, size in islice(pins.items(), 0, None, step):
                seen += size
                have += size if key in self._resident else 0
            kept = sum(pins.values()) if step > 1 else seen
            out[jk] = {"dataset": jk[0], "job": jk[1], "learned": ln.scan.learned,
                       "epochs": ln.scan.epoch,
                       "working_set_bytes": ln.scan.predicted_bytes() if ln.scan.detected
                       else None,
                       "kept_bytes": kept,
                       "resident_bytes": round(have * kept / seen) if seen else 0}
        for jk, cur in self._orders.items():
            d = out.setdefault(jk, {"dataset": jk[0], "job": jk[1]})
            d["order"] = {"epoch": cur.epoch, "read": cur.dropped + cur.pos,
                          "positions": cur.dropped + len(cur)}
        return [out[k] for k in sorted(out)]

    def working_set(self, dataset: str, job: str = "") -> WorkingSet | None:
        """What (dataset, job) read in its last complete epoch, to persist."""
        ln = self._learners.get((dataset, job))
        return ln.scan.working_set(dataset, job) if ln else None

    def restore_working_set(self, ws: WorkingSet | dict[str, Any]) -> list[Action]:
        """Take a persisted working set back: start filling it right away."""
        if isinstance(ws, dict):
            ws = WorkingSet.from_json(ws)
        m = self._manifests.get(ws.dataset)
        if m is None:
            raise ConfigError(f"no manifest for dataset {ws.dataset!r}; add_manifest() first")
        out: list[Action] = []
        ln = self._learners.get((ws.dataset, ws.job))
        if ln is not None:
            self._release_learner(ln, out)
        ln = self._new_learner(ws.dataset, ws.job, m, out)
        ln.scan.restore(ws)
        if ln.scan.learned:
            self.stats["working_sets_restored"] += 1
            self._allocate(out, force=ln)
        self._pump(out)
        return out

    # -- events ---------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        out: list[Action] = []
        now = getattr(event, "now", 0.0)
        if now - self._last_idle_check >= 1.0:
            self._last_idle_check = now
            self._expire(now, out)
        if isinstance(event, Read):
            self._on_read(event, out)
        elif isinstance(event, FetchDone):
            self._done(event.key, resident=True)
        elif isinstance(event, FetchFailed):
            self._done(event.key, resident=False)
            self.stats["fetch_failed"] += 1
        elif isinstance(event, Evicted):
            if self._own_resident is not None:
                self._own_resident.discard(event.key)
        elif isinstance(event, OrderAnnounced):
            self._on_order(event, out)
        elif isinstance(event, EpochBoundary):
            ln = self._learners.get((event.dataset, event.job))
            if ln is not None:
                ln.scan.new_epoch()
                self._on_epoch(ln, out)
        elif isinstance(event, JobEnded):
            self._end_job(event.dataset, event.job, out)
        elif isinstance(event, CapacityChanged):
            if event.capacity <= 0:
                raise ConfigError(f"capacity must be > 0 bytes, got {event.capacity}")
            self.capacity = event.capacity
            self._allocate(out)
            for cur in self._orders.values():
                self._fill_order(cur, out)
        else:
            raise TypeError(f"not a planner event: {event!r}")
        self._pump(out)
        return out

    # -- reads ----------------------------------------------------------------------------
    def _on_read(self, ev: Read, out: list[Action]) -> None:
        self.stats["reads"] += 1
        m = self._manifests.get(ev.dataset)
        fi = m.index(ev.path) if m is not None else None
        if fi is not None and m is not None and m.versions[fi] != ev.version:
            fi = None  # another snapshot's file: block maths only
        bs = m.block_size if m is not None else self.block_size
        sid = (ev.dataset, ev.path, ev.reader_id)
        stream, fresh = self._readahead.on_read(sid, ev.size, ev.offset, ev.length)
        end = min(ev.size, ev.offset + ev.length)
        touched = range(ev.offset // bs, (end - 1) // bs + 1) if end > ev.offset else range(0)

        ln = (self._learner_for(ev.dataset, ev.job, m, out)
              if self.learn and fi is not None else None)
        keep = ln is not None and fi is not None and bool(ln.scan.flags[fi] & KEEP)
        for b in touched:
            key = (ev.version, b)
            if key in self._resident:
                if b >= fresh:
                    self.stats["hit_blocks"] += 1
                continue
            if b >= fresh:
                self.stats["miss_blocks"] += 1
            if keep and ln is not None and key not in ln.pinned:
                self._pin_learned(ln, key, min(bs, ev.size - b * bs), out)
            self._demand(key, min(bs, ev.size - b * bs), out)

        matched = False
        if fi is not None and self._orders:
            matched = self._order_read(ev, fi, [b for b in touched if b >= fresh], out)
        if matched:
            return
        if self.readahead_enabled and stream.alive:
            for b in self._readahead.ahead(stream, ev.size):
                size = min(bs, ev.size - b * bs)
                self._want((ev.version, b), size, 1 + b - touched.start, "readahead", stream)
        if ln is not None and fi is not None and fresh == ev.offset // bs:
            self._learn_read(ln, fi, ev.now, out)

    def _demand(self, key: BlockKey, size: int, out: list[Action]) -> None:
        inf = self._inflight.get(key)
        if inf is None:
            self._inflight[key] = _Inflight(size, DEMAND, "demand")
            self._demand_bytes += size
            out.append(Fetch(key, size, DEMAND, "demand"))
            self.stats["fetch_demand"] += 1
        elif inf.priority != DEMAND:  # the reader caught a prefetch: it jumps the queue
            inf.priority = DEMAND
            out.append(Fetch(key, inf.size, DEMAND, "demand"))
            self.stats["late_prefetch"] += 1

    # -- the in-flight budget ---------------------------------------------------------------
    def _want(
        self, key: BlockKey, size: int, priority: int, reason: str, owner: Any, tag: int = -1
    ) -> None:
        """Queue a prefetch (readahead or order); the pump sends it when the budget allows."""
        if size <= 0 or key in self._resident or key in self._inflight:
            return
        self._seq += 1
        heapq.heappush(self._queue, (priority, self._seq, key, size, reason, owner, tag))

    def _budget_ok(self, size: int) -> bool:
        return self._prefetch_bytes == 0 or self._prefetch_bytes + size <= self.max_inflight_bytes

    def _issue(
        self, key: BlockKey, size: int, priority: int, reason: str, owner: Any, out: list[Action]
    ) -> None:
        self._inflight[key] = _Inflight(size, priority, reason, owner)
        self._prefetch_bytes += size
        out.append(Fetch(key, size, priority, reason))
        self.stats[f"fetch_{reason}"] += 1

    def _pump(self, out: list[Action]) -> None:
        queue = self._queue
        while queue:
            prio, _, key, size, reason, owner, tag = queue[0]
            if (
                not owner.alive
                or key in self._resident
                or key in self._inflight
                or (tag >= 0 and owner.was_read(tag))  # the reader got there first
            ):
                heapq.heappop(queue)
                continue
            if not self._budget_ok(size):
                return
            heapq.heappop(queue)
            self._issue(key, size, prio, reason, owner, out)
        # Learned working sets, round-robin, after every nearer need.
        active = [ln for ln in self._learners.values() if ln.fill or ln.endgame or ln.pending]
        # (a generator is truthy; it is set to None once exhausted)
        while active:
            for ln in list(active):
                item = ln.pending or self._next_fill(ln, out)
                if item is None:
                    active.remove(ln)
                    continue
                key, size, prio, reason = item
                if not self._budget_ok(size):
                    ln.pending = item
                    return
                ln.pending = None
                if key not in self._resident and key not in self._inflight:
                    self._issue(key, size, prio, reason, ln, out)

    def _done(self, key: BlockKey, resident: bool) -> None:
        inf = self._inflight.pop(key, None)
        if inf is not None:
            if inf.reason == "demand":
                self._demand_bytes -= inf.size
            else:
                self._prefetch_bytes -= inf.size
        if self._own_resident is not None:
            if resident:
                self._own_resident.add(key)
            else:
                self._own_resident.discard(key)

    # -- announced order ------------------------------------------------------------------
    def _on_order(self, ev: OrderAnnounced, out: list[Action]) -> None:
        m = self._manifests.get(ev.dataset)
        if m is None:
            raise ConfigError(f"no manifest for dataset {ev.dataset!r}; add_manifest() first")
        files = ev.files
        if files and isinstance(files[0], str):
            idx = [m.index(p) for p in files]  # type: ignore[arg-type]
            missing = [p for p, i in zip(files, idx, strict=True) if i is None]
            if missing:
                raise ConfigError(
                    f"announced order names {len(missing)} path(s) not in dataset "
                    f"{ev.dataset!r}, e.g. {missing[0]!r}; announce paths of its snapshot"
                )
            files = idx  # type: ignore[assignment]
        # Checked whole before anything changes: a bad order keeps the job's earlier one.
        check_order(m.sizes, m.block_size, files, ev.ranges)  # type: ignore[arg-type]
        jk = (ev.dataset, ev.job)
        cur = self._orders.get(jk)
        if cur is None and len(self._orders) >= self.max_jobs:
            raise ConfigError(
                f"{len(self._orders)} jobs have announced orders, the most this spoke keeps; "
                "end finished jobs (DELETE .../jobs/JOB) or wait for idle ones to expire")
        self._order_seen[jk] = ev.now
        append = cur is not None and ev.epoch > cur.epoch
        if cur is not None and not append:
            self._release_order(cur, out)
        if cur is None or not append:
            cur = OrderCursor(m, self.disorder_window)
            self._orders[jk] = cur
        cur.compact()
        new = cur.extend(files, ev.ranges)  # type: ignore[arg-type]
        cur.epoch = ev.epoch
        self.stats["orders"] += 1
        out.append(SetFuture(cur.keys(new), append=append, stream=f"{ev.dataset}/{ev.job}"))
        # An announced order beats learning: drop what learning holds for this job.
        for key in (jk, (ev.dataset, "")):
            ln = self._learners.get(key)
            if ln is not None:
                self._release_learner(ln, out)
        self._allocate(out)
        self._fill_order(cur, out)

    def _lookahead(self) -> int:
        return min(self.lookahead_bytes, self.capacity // (2 * max(1, len(self._orders))))

    def _order_read(self, ev: Read, fi: int, fresh: list[int], out: list[Action]) -> bool:
        if ev.job and (ev.dataset, ev.job) in self._orders:
            cursors = [self._orders[(ev.dataset, ev.job)]]
        else:
            cursors = [c for (ds, _), c in self._orders.items() if ds == ev.dataset]
        matched = False
        for cur in cursors:
            for b in fresh:
                p = cur.locate(fi, b)
                if p is None:
                    continue
                matched = True
                self._order_seen[(ev.dataset, ev.job)] = ev.now
                issued = cur.issued
                for q in cur.consume(p):
                    if q < issued:
                        self._unpin_order(cur.key(q), cur.size(q), out)
            if matched:
                self._fill_order(cur, out)
                return True
        return False

    def _fill_order(self, cur: OrderCursor, out: list[Action]) -> None:
        """Pin and queue every block up to the lookahead budget ahead of the reader."""
        end = cur.lookahead_end(self._lookahead())
        start = max(cur.issued, cur.pos)
        consumed = cur.consumed
        for p in range(start, end):
            if consumed[p]:
                continue
            key, size = cur.key(p), cur.size(p)
            self._order_pins[key] = self._order_pins.get(key, 0) + 1
            self._pinned_bytes += size
            self._order_pinned_bytes += size
            out.append(Pin(key))
            self._want(key, size, 1 + p - cur.pos, "order", cur, cur.dropped + p)
        cur.issued = max(cur.issued, end)

    def _unpin_order(self, key: BlockKey, size: int, out: list[Action]) -> None:
        n = self._order_pins.get(key, 0)
        if n == 0:
            return
        if n == 1:
            del self._order_pins[key]
        else:
            self._order_pins[key] = n - 1
        self._pinned_bytes -= size
        self._order_pinned_bytes -= size
        out.append(Unpin(key))

    def _release_order(self, cur: OrderCursor, out: list[Action]) -> None:
        cur.alive = False
        for p in cur.unread_issued():
            self._unpin_order(cur.key(p), cur.size(p), out)
        for key, inf in self._inflight.items():
            if inf.owner is cur:
                out.append(CancelAction(key))

    # -- learned working sets ----------------------------------------------------------------
    def _new_learner(self, dataset: str, job: str, m: Manifest, out: list[Action]
                     ) -> _Learner:
        if len(self._learners) >= self.max_jobs:  # the one that read least recently goes
            oldest = min(self._learners.values(), key=lambda x: x.scan.last_now)
            self.stats["learners_dropped"] += 1
            self._release_learner(oldest, out)
        ln = _Learner(dataset, job, m, ScanState(m, self.scan_threshold))
        self._learners[(dataset, job)] = ln
        return ln

    def _learner_for(self, dataset: str, job: str, m: Manifest | None, out: list[Action]
                     ) -> _Learner | None:
        ln = self._learners.get((dataset, job))
        if ln is not None:
            return ln if ln.m is m else None
        if m is None:
            return None
        if not job:  # an anonymous read (a mount): the job that works on this dataset
            mine = [x for (ds, _), x in self._learners.items() if ds == dataset and x.m is m]
            if mine:
                return max(mine, key=lambda x: x.scan.last_now)
        if any(ds == dataset and (not job or j in ("", job)) for ds, j in self._orders):
            return None  # announced order: nothing to learn
        return self._new_learner(dataset, job, m, out)

    def _learn_read(self, ln: _Learner, fi: int, now: float, out: list[Action]) -> None:
        scan = ln.scan
        first = not scan.flags[fi] & SEEN
        was_endgame = bool(scan.flags[fi] & ENDGAME)
        result = scan.on_read(fi, now)
        if result == "detected":
            self.stats["scans_detected"] += 1
            self._allocate(out, force=ln)
        elif result == "widened":
            self._allocate(out, force=ln)
        elif result == "epoch":
            self._on_epoch(ln, out)
            return
        if was_endgame:
            for b in range(ln.m.nblocks(fi)):
                key = ln.m.key(fi, b)
                size = ln.endgame_pinned.pop(key, None)
                if size is not None:
                    self._pinned_bytes -= size
                    ln.endgame_bytes -= size
                    out.append(Unpin(key))
        if first and scan.detected and not scan.flags[fi] & KEEP and scan.in_prediction(fi):
            ln.unread_other -= scan.m.sizes[fi]
            self._maybe_endgame(ln)

    def _on_epoch(self, ln: _Learner, out: list[Action]) -> None:
        self.stats["epochs_learned"] += 1
        for key, size in ln.endgame_pinned.items():
            self._pinned_bytes -= size
            out.append(Unpin(key))
        ln.endgame_pinned.clear()
        ln.endgame, ln.endgame_done, ln.endgame_bytes = None, False, 0
        out.append(WorkingSetLearned(ln.dataset, ln.job, ln.scan.working_set(ln.dataset, ln.job)))
        self._allocate(out, force=ln)

    def _allocate(self, out: list[Action], force: _Learner | None = None) -> None:
        """Share the capacity left after the reserve and the announced orders' lookahead
        between learned working sets: smaller ones get all they need, larger ones an equal
        share of the rest (water-filling). Reselect where a share changed."""
        active = [ln for ln in self._learners.values() if ln.scan.detected]
        avail = self.capacity - self.reserve_bytes - self._lookahead() * len(self._orders)
        avail = max(0, avail)
        need = sorted(active, key=lambda ln: ln.scan.predicted_bytes())
        for n, ln in enumerate(need):
            share = avail // (len(need) - n)
            alloc = min(ln.scan.predicted_bytes(), share)
            avail -= alloc
            if alloc != ln.alloc or ln is force:
                ln.alloc = alloc
                self._select(ln, out)

    def _select(self, ln: _Learner, out: list[Action]) -> None:
        """Choose the files to keep (all predicted ones when they fit in the allocation; else
        those already resident first, then unread ones) and restart the fill."""
        scan, m = ln.scan, ln.m
        flags, sizes = scan.flags, m.sizes
        kept: list[int] = []
        total = 0
        for i in ln.keep:  # what stays: still predicted and within the allocation
            if scan.in_prediction(i) and total + sizes[i] <= ln.alloc:
                kept.append(i)
                total += sizes[i]
            else:
                flags[i] &= ~KEEP
                self._unpin_file(ln, i, out)
        span = scan.predicted_range()
        if total < ln.alloc and span:
            # Start after the file read last, so a sorted scan is filled just ahead of itself.
            start = min(max(scan.last_index + 1, span.start), span.stop)
            order = [*range(start, span.stop), *range(span.start, start)]
            resident = self._resident
            for want_seen in (True, False):
                for i in order:
                    if flags[i] & KEEP or bool(flags[i] & SEEN) != want_seen:
                        continue
                    if not scan.in_prediction(i):
                        continue
                    if want_seen and not all(m.key(i, b) in resident for b in range(m.nblocks(i))):
                        continue  # read but gone: not worth a second fetch this epoch
                    if total + sizes[i] > ln.alloc:
                        break
                    flags[i] |= KEEP
                    kept.append(i)
                    total += sizes[i]
        ln.keep, ln.keep_bytes = kept, total
        ln.unread_other = sum(
            sizes[i] for i in span if scan.in_prediction(i) and not flags[i] & (KEEP | SEEN)
        )
        ln.fill = self._fill_gen(ln)
        ln.pending = None
        # Files already resident are pinned now, before a demand miss can evict them.
        ln.pending = self._next_item(ln, "fill", out)
        self._maybe_endgame(ln)

    def _fill_gen(self, ln: _Learner) -> Iterator[_Item]:
        """Kept files in selection order: pin each block, fetch the ones not resident."""
        m = ln.m
        for rank, i in enumerate(list(ln.keep)):
            if not ln.scan.flags[i] & KEEP:
                continue
            priority = WORKING_SET_PRIORITY + min(rank, WORKING_SET_PRIORITY - 1)
            for b in range(m.nblocks(i)):
                key, size = m.key(i, b), m.block_bytes(i, b)
                if key not in ln.pinned:
                    yield key, size, 0, "pin"
                if size > 0 and key not in self._resident and key not in self._inflight:
                    yield key, size, priority, "working-set"

    def _maybe_endgame(self, ln: _Learner) -> None:
        """Near an epoch's end, what is left unread fits beside the kept set: fetch it all."""
        if ln.endgame is not None or ln.endgame_done or ln.unread_other <= 0:
            return
        if not ln.scan.detected:
            return
        # Count what is promised, not only what is pinned yet: kept sets pin as they fill.
        committed = self._order_pinned_bytes + sum(
            x.keep_bytes + x.endgame_bytes for x in self._learners.values()
        )
        room = self.capacity - committed - self._prefetch_bytes - self._demand_bytes
        if ln.unread_other <= room:
            self.stats["endgames"] += 1
            ln.endgame = self._endgame_gen(ln)
            ln.endgame_budget = room

    def _endgame_gen(self, ln: _Learner) -> Iterator[_Item]:
        """Predicted files neither kept nor read yet this epoch: pin (until read) and fetch."""
        scan, m = ln.scan, ln.m
        for i in scan.predicted_range():
            flags = scan.flags
            if flags[i] & (KEEP | SEEN) or not scan.in_prediction(i):
                continue
            flags[i] |= ENDGAME
            for b in range(m.nblocks(i)):
                key, size = m.key(i, b), m.block_bytes(i, b)
                if key not in ln.endgame_pinned:
                    yield key, size, 0, "pin"
                if size > 0 and key not in self._resident and key not in self._inflight:
                    yield key, size, 2 * WORKING_SET_PRIORITY, "working-set"

    def _next_item(self, ln: _Learner, attr: str, out: list[Action]) -> _Item | None:
        """The next fetch from one of the learner's generators, carrying out pins on the way."""
        gen = getattr(ln, attr)
        pins = ln.pinned if attr == "fill" else ln.endgame_pinned
        while gen is not None:
            item = next(gen, None)
            if item is None:
                setattr(ln, attr, None)
                if attr == "endgame":
                    ln.endgame_done = True
                return None
            key, size, _, reason = item
            if reason != "pin":
                return item
            if key in pins:
                continue
            if attr == "endgame":
                if ln.endgame_bytes + size > ln.endgame_budget:
                    ln.endgame, ln.endgame_done = None, True  # out of room: stop here
                    return None
                ln.endgame_bytes += size
            pins[key] = size
            self._pinned_bytes += size
            out.append(Pin(key))
        return None

    def _next_fill(self, ln: _Learner, out: list[Action]) -> _Item | None:
        return self._next_item(ln, "fill", out) or self._next_item(ln, "endgame", out)

    def _pin_learned(self, ln: _Learner, key: BlockKey, size: int, out: list[Action]) -> None:
        ln.pinned[key] = size
        self._pinned_bytes += size
        out.append(Pin(key))

    def _unpin_file(self, ln: _Learner, i: int, out: list[Action]) -> None:
        for b in range(ln.m.nblocks(i)):
            key = ln.m.key(i, b)
            size = ln.pinned.pop(key, None)
            if size is not None:
                self._pinned_bytes -= size
                out.append(Unpin(key))

    def _release_learner(self, ln: _Learner, out: list[Action]) -> None:
        for pins in (ln.pinned, ln.endgame_pinned):
            for key, size in pins.items():
                self._pinned_bytes -= size
                out.append(Unpin(key))
            pins.clear()
        ln.endgame_bytes = 0
        ln.fill = ln.endgame = None
        ln.pending = None
        self._learners.pop((ln.dataset, ln.job), None)

    # -- endings ----------------------------------------------------------------------------
    def _end_job(self, dataset: str, job: str, out: list[Action]) -> None:
        cur = self._orders.pop((dataset, job), None)
        self._order_seen.pop((dataset, job), None)
        if cur is not None:
            self._release_order(cur, out)
            out.append(SetFuture((), append=False, stream=f"{dataset}/{job}"))
        ln = self._learners.get((dataset, job))
        if ln is not None:
            self._release_learner(ln, out)
        self._allocate(out)

    def _expire(self, now: float, out: list[Action]) -> None:
        for (ds, job), ln in list(self._learners.items()):
            if now - ln.scan.last_now > self.idle_timeout:
                self.stats["idle_released"] += 1
                self._end_job(ds, job, out)
        for (ds, job), seen in list(self._order_seen.items()):
            if now - seen > self.idle_timeout:  # announced, then nothing read for long
                self.stats["idle_released"] += 1
                self._end_job(ds, job, out)

    def __repr__(self) -> str:
        return (
            f"<Planner capacity={self.capacity} inflight={len(self._inflight)} "
            f"prefetch_bytes={self._prefetch_bytes} pinned_bytes={self._pinned_bytes} "
            f"orders={len(self._orders)} learners={len(self._learners)}>"
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
