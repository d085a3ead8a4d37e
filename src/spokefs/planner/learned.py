"""Learned working sets: per (dataset, job), keep (part of) the files an epoch scan reads
resident, fill them in the background after every nearer need, and near an epoch's end fetch
what is left unread when it fits (the endgame). What an epoch scan is: ``workingset.py``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from spokefs.planner.announced import JobKey, OrderPlanner
from spokefs.planner.budget import Budget
from spokefs.planner.events import Action, WorkingSetLearned
from spokefs.planner.manifest import Manifest
from spokefs.planner.pins import PinLedger, Pins
from spokefs.planner.settings import Settings
from spokefs.planner.workingset import ENDGAME, KEEP, SEEN, ScanState, WorkingSet
from spokefs.policy import BlockKey

# Priority bands (lower first). Readahead and announced order use 1 + distance in blocks or
# positions from the reader, so the nearest need goes first whoever asked for it; filling a
# learned working set comes after every such need.
WORKING_SET_PRIORITY = 1 << 20

# A job reading files whose scan is not recognised yet may be starting one: until it is, or
# until it has read this many times the scan threshold of distinct files (or four times that
# in reads) without being one, an equal share of the cache is held back for it
# (``allocate``).
PROVISIONAL_READS = 2

# What a fill generator yields: (key, size, priority, reason); reason "pin" asks for a pin.
_Item = tuple[BlockKey, int, int, str]


@dataclass(eq=False)
class Learner:
    """A (dataset, job) learning its working set and keeping (part of) it resident."""

    dataset: str
    job: str
    m: Manifest
    scan: ScanState
    pinned: Pins  # the kept set's pins
    endgame_pinned: Pins  # pinned until read
    alloc: int = 0  # bytes it may keep pinned
    keep: list[int] = field(default_factory=list)  # KEEP files in selection order
    keep_bytes: int = 0
    endgame_budget: int = 0  # what the endgame may pin: the room when it started
    unread_other: int = 0  # predicted, unread this epoch, not kept: bytes
    fill: Iterator[_Item] | None = None
    endgame: Iterator[_Item] | None = None
    endgame_done: bool = False  # this epoch's endgame ran
    pending: _Item | None = None  # a fetch the budget held back
    reads: int = 0  # reads seen (``_provisional``)


class WorkingSetPlanner:
    def __init__(self, settings: Settings, budget: Budget, ledger: PinLedger,
                 orders: OrderPlanner, resident: Container[BlockKey], stats: Counter[str]
                 ) -> None:
        self.settings = settings
        self.budget = budget
        self.ledger = ledger
        self.orders = orders
        self.resident = resident
        self.stats = stats
        self.learners: dict[JobKey, Learner] = {}

    def working_set(self, dataset: str, job: str) -> WorkingSet | None:
        ln = self.learners.get((dataset, job))
        return ln.scan.working_set(dataset, job) if ln else None

    def status(self, sample: int) -> dict[JobKey, dict[str, Any]]:
        """Per learner: the predicted working set, what is kept for it and (estimated from an
        even sample of at most ``sample`` kept blocks) how much of that is resident."""
        out: dict[JobKey, dict[str, Any]] = {}
        for jk, ln in self.learners.items():
            pins = ln.pinned
            step = max(1, len(pins) // sample)
            seen = have = 0
            for key, size in islice(pins.items(), 0, None, step):
                seen += size
                have += size if key in self.resident else 0
            kept = sum(size for _, size in pins.items()) if step > 1 else seen
            out[jk] = {"dataset": jk[0], "job": jk[1], "learned": ln.scan.learned,
                       "epochs": ln.scan.epoch,
                       "working_set_bytes": ln.scan.predicted_bytes() if ln.scan.detected
                       else None,
                       "kept_bytes": kept,
                       "resident_bytes": round(have * kept / seen) if seen else 0}
        return out

    # -- learners -----------------------------------------------------------------------------
    def new(self, dataset: str, job: str, m: Manifest, out: list[Action]) -> Learner:
        if len(self.learners) >= self.settings.max_jobs:  # the one read least recently goes
            oldest = min(self.learners.values(), key=lambda x: x.scan.last_now)
            self.stats["learners_dropped"] += 1
            self.release(oldest, out)
        ln = Learner(dataset, job, m, ScanState(m, self.settings.scan_threshold),
                     self.ledger.holder(), self.ledger.holder())
        self.learners[(dataset, job)] = ln
        return ln

    def learner_for(self, dataset: str, job: str, m: Manifest | None, out: list[Action]
                    ) -> Learner | None:
        """The learner a read of (dataset, job) feeds (made on first use), or None."""
        ln = self.learners.get((dataset, job))
        if ln is not None:
            return ln if ln.m is m else None
        if m is None:
            return None
        if not job:  # an anonymous read (a mount): the job that works on this dataset
            mine = [x for (ds, _), x in self.learners.items() if ds == dataset and x.m is m]
            if mine:
                return max(mine, key=lambda x: x.scan.last_now)
        if self.orders.announced(dataset, job):
            return None  # announced order: nothing to learn
        return self.new(dataset, job, m, out)

    def release(self, ln: Learner, out: list[Action]) -> None:
        ln.pinned.release(out)
        ln.endgame_pinned.release(out)
        ln.fill = ln.endgame = None
        ln.pending = None
        self.learners.pop((ln.dataset, ln.job), None)

    def release_job(self, dataset: str, job: str, out: list[Action]) -> None:
        ln = self.learners.get((dataset, job))
        if ln is not None:
            self.release(ln, out)

    def restore(self, ws: WorkingSet, m: Manifest, now: float, out: list[Action]) -> None:
        """Take a persisted working set back: start filling it right away."""
        self.release_job(ws.dataset, ws.job, out)
        ln = self.new(ws.dataset, ws.job, m, out)
        ln.scan.restore(ws)
        # Restored now: not idle since the clock's zero (which would release it at once).
        ln.scan.last_now = now
        if ln.scan.learned:
            self.stats["working_sets_restored"] += 1
            self.allocate(out, force=ln)

    def idle(self, now: float) -> list[JobKey]:
        timeout = self.settings.idle_timeout
        return [jk for jk, ln in self.learners.items() if now - ln.scan.last_now > timeout]

    # -- reads and epochs -----------------------------------------------------------------------
    def keeps(self, ln: Learner, fi: int) -> bool:
        return bool(ln.scan.flags[fi] & KEEP)

    def pin_read(self, ln: Learner, key: BlockKey, size: int, out: list[Action]) -> None:
        """A kept file's block is being fetched for a reader: pin it now."""
        if key not in ln.pinned:
            ln.pinned.pin(key, size, out)

    def on_read(self, ln: Learner, fi: int, now: float, out: list[Action]) -> None:
        scan = ln.scan
        first = not scan.flags[fi] & SEEN
        was_endgame = bool(scan.flags[fi] & ENDGAME)
        was_provisional = self._provisional(ln)
        ln.reads += 1
        result = scan.on_read(fi, now)
        if result == "detected":
            self.stats["scans_detected"] += 1
            self.allocate(out, force=ln)
        elif result is None and self._provisional(ln) != was_provisional:
            self.allocate(out)  # it starts, or stops, holding a provisional share
        elif result == "widened":
            self.allocate(out, force=ln)
        elif result == "epoch":
            self.on_epoch(ln, out)
            return
        if was_endgame:
            for b in range(ln.m.nblocks(fi)):
                ln.endgame_pinned.unpin(ln.m.key(fi, b), out)
        if first and scan.detected and not scan.flags[fi] & KEEP and scan.in_prediction(fi):
            ln.unread_other -= scan.m.sizes[fi]
            self._maybe_endgame(ln)

    def epoch_boundary(self, dataset: str, job: str, out: list[Action]) -> None:
        ln = self.learners.get((dataset, job))
        if ln is not None:
            ln.scan.new_epoch()
            self.on_epoch(ln, out)

    def on_epoch(self, ln: Learner, out: list[Action]) -> None:
        self.stats["epochs_learned"] += 1
        ln.endgame_pinned.release(out)
        ln.endgame, ln.endgame_done = None, False
        out.append(WorkingSetLearned(ln.dataset, ln.job, ln.scan.working_set(ln.dataset, ln.job)))
        self.allocate(out, force=ln)

    # -- what to keep ---------------------------------------------------------------------------
    def allocate(self, out: list[Action], force: Learner | None = None) -> None:
        """Share the capacity left after the reserve and the announced orders' lookahead
        between learned working sets: smaller ones get all they need, larger ones an equal
        share of the rest (water-filling). Reselect where a share changed."""
        active = [ln for ln in self.learners.values() if ln.scan.detected]
        # Jobs that may be starting a scan count as claimants of an equal share that nobody
        # gets until they are recognised: growing a share later costs nothing, but shrinking
        # one unpins blocks fetched for it, which others' fills then evict unread and which
        # cross the link again (bench contention's cold phase moved 1.25x the bytes read
        # when one job's scan was recognised a few hundred reads before the other's).
        provisional = sum(1 for ln in self.learners.values() if self._provisional(ln))
        avail = self.settings.capacity - self.settings.reserve_bytes - self.orders.reserved()
        avail = max(0, avail)
        need = sorted(active, key=lambda ln: ln.scan.predicted_bytes())
        for n, ln in enumerate(need):
            share = avail // (len(need) - n + provisional)
            alloc = min(ln.scan.predicted_bytes(), share)
            avail -= alloc
            if alloc != ln.alloc or ln is force:
                ln.alloc = alloc
                self._select(ln, out)

    @staticmethod
    def _provisional(ln: Learner) -> bool:
        """Whether ``ln`` may be starting an epoch scan: reading in its first epoch, not
        recognised yet, and not past ``PROVISIONAL_READS`` x the threshold (distinct files;
        four times that in reads, for a job re-reading a few files)."""
        s = ln.scan
        return (not s.detected and s.epoch == 0 and ln.reads > 0
                and s.distinct < PROVISIONAL_READS * s.threshold
                and ln.reads < 4 * PROVISIONAL_READS * s.threshold)

    def _select(self, ln: Learner, out: list[Action]) -> None:
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
                for b in range(m.nblocks(i)):
                    ln.pinned.unpin(m.key(i, b), out)
        span = scan.predicted_range()
        if total < ln.alloc and span:
            # Start after the file read last, so a sorted scan is filled just ahead of itself.
            start = min(max(scan.last_index + 1, span.start), span.stop)
            order = [*range(start, span.stop), *range(span.start, start)]
            resident = self.resident
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

    def _fill_gen(self, ln: Learner) -> Iterator[_Item]:
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
                if size > 0 and key not in self.resident and key not in self.budget:
                    yield key, size, priority, "working-set"

    def _maybe_endgame(self, ln: Learner) -> None:
        """Near an epoch's end, what is left unread fits beside the kept set: fetch it all."""
        if ln.endgame is not None or ln.endgame_done or ln.unread_other <= 0:
            return
        if not ln.scan.detected:
            return
        # Count what is promised, not only what is pinned yet: kept sets pin as they fill.
        committed = self.orders.pins.bytes + sum(
            x.keep_bytes + x.endgame_pinned.bytes for x in self.learners.values()
        )
        room = (self.settings.capacity - committed - self.budget.prefetch_bytes
                - self.budget.demand_bytes)
        if ln.unread_other <= room:
            self.stats["endgames"] += 1
            ln.endgame = self._endgame_gen(ln)
            ln.endgame_budget = room

    def _endgame_gen(self, ln: Learner) -> Iterator[_Item]:
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
                if size > 0 and key not in self.resident and key not in self.budget:
                    yield key, size, 2 * WORKING_SET_PRIORITY, "working-set"

    def _next_item(self, ln: Learner, attr: str, out: list[Action]) -> _Item | None:
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
            if attr == "endgame" and pins.bytes + size > ln.endgame_budget:
                ln.endgame, ln.endgame_done = None, True  # out of room: stop here
                return None
            pins.pin(key, size, out)
        return None

    # -- the background fill ----------------------------------------------------------------
    def pump(self, out: list[Action]) -> None:
        """Fill learned working sets, round-robin, while the budget allows (after every
        nearer need: the budget's queue was sent first)."""
        budget = self.budget
        # (a generator is truthy; it is set to None once exhausted)
        active = [ln for ln in self.learners.values() if ln.fill or ln.endgame or ln.pending]
        while active:
            for ln in list(active):
                item = (ln.pending or self._next_item(ln, "fill", out)
                        or self._next_item(ln, "endgame", out))
                if item is None:
                    active.remove(ln)
                    continue
                key, size, prio, reason = item
                if not budget.ok(size):
                    ln.pending = item
                    return
                ln.pending = None
                if key not in self.resident and key not in budget:
                    budget.issue(key, size, prio, reason, ln.dataset, ln, out)
