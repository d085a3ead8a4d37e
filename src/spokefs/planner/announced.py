"""Announced orders: per (dataset, job), pin and queue the blocks up to a lookahead ahead of
the reader, release each position as it is read (the cursor itself: ``order.py``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from spokefs.errors import ConfigError
from spokefs.planner.budget import Budget
from spokefs.planner.events import Action, Cancel, OrderAnnounced, Read, SetFuture
from spokefs.planner.manifest import Manifest
from spokefs.planner.order import OrderCursor, check_order
from spokefs.planner.pins import PinLedger
from spokefs.planner.settings import Settings

JobKey = tuple[str, str]  # (dataset, job)


class OrderPlanner:
    def __init__(self, settings: Settings, budget: Budget, ledger: PinLedger,
                 stats: Counter[str]) -> None:
        self.settings = settings
        self.budget = budget
        self.stats = stats
        self.cursors: dict[JobKey, OrderCursor] = {}
        self.seen: dict[JobKey, float] = {}  # last announce or read of each order
        # One holder for every order: a block two orders (or two positions) hold is pinned
        # twice and released once per position read.
        self.pins = ledger.holder()

    def __len__(self) -> int:
        return len(self.cursors)

    def lookahead(self) -> int:
        """Bytes each order may hold ahead of its reader: at most half the cache in all."""
        s = self.settings
        return min(s.lookahead_bytes, s.capacity // (2 * max(1, len(self.cursors))))

    def reserved(self) -> int:
        """Capacity the orders' lookaheads take (learned working sets share the rest)."""
        return self.lookahead() * len(self.cursors)

    def announced(self, dataset: str, job: str) -> bool:
        """Whether an order speaks for reads of (dataset, job): the job's own, or any order on
        the dataset for an anonymous read or an anonymous order."""
        return any(ds == dataset and (not job or j in ("", job)) for ds, j in self.cursors)

    def position(self, dataset: str, job: str) -> int | None:
        cur = self.cursors.get((dataset, job))
        return cur.pos if cur else None

    def status(self) -> dict[JobKey, dict[str, Any]]:
        return {jk: {"epoch": cur.epoch, "read": cur.dropped + cur.pos,
                     "positions": cur.dropped + len(cur)} for jk, cur in self.cursors.items()}

    # -- events -----------------------------------------------------------------------------
    def announce(self, ev: OrderAnnounced, m: Manifest | None, out: list[Action]
                 ) -> OrderCursor:
        """Take the order (a later epoch extends the job's order, dropping any epoch before
        the one it follows; another replaces it); the caller releases what learning held for
        the job, then ``fill``s the cursor."""
        if m is None:
            raise ConfigError(f"no manifest for dataset {ev.dataset!r}; add it first "
                              "(ManifestAdded)")
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
        cur = self.cursors.get(jk)
        if cur is None and len(self.cursors) >= self.settings.max_jobs:
            raise ConfigError(
                f"{len(self.cursors)} jobs have announced orders, the most this spoke keeps; "
                "end finished jobs (DELETE .../jobs/JOB) or wait for idle ones to expire")
        self.seen[jk] = ev.now
        append = cur is not None and ev.epoch > cur.epoch
        if cur is not None and not append:
            self._release(cur, out)
        if cur is None or not append:
            cur = OrderCursor(m, self.settings.disorder_window)
            self.cursors[jk] = cur
        stream = f"{ev.dataset}/{ev.job}"
        if append and cur.latest > 0:
            # Two epochs held already: the older goes, read or not, so a job announcing epoch
            # after epoch holds two epochs' positions, not every one it ever announced.
            for key in cur.drop_older_epochs():
                self.pins.unpin(key, out)
            out.append(SetFuture(cur.keys(range(cur.pos, len(cur))), append=False,
                                 stream=stream))
        cur.compact()
        new = cur.extend(files, ev.ranges)  # type: ignore[arg-type]
        cur.latest = new.start
        cur.epoch = ev.epoch
        self.stats["orders"] += 1
        out.append(SetFuture(cur.keys(new), append=append, stream=stream))
        return cur

    def on_read(self, ev: Read, fi: int, fresh: list[int], out: list[Action]) -> bool:
        """Consume the positions the read's fresh blocks match; True when an order matched
        (then readahead and learning stay out of it)."""
        if ev.job and (ev.dataset, ev.job) in self.cursors:
            cursors = [self.cursors[(ev.dataset, ev.job)]]
        else:
            cursors = [c for (ds, _), c in self.cursors.items() if ds == ev.dataset]
        matched = False
        for cur in cursors:
            for b in fresh:
                p = cur.locate(fi, b)
                if p is None:
                    continue
                matched = True
                self.seen[(ev.dataset, ev.job)] = ev.now
                issued = cur.issued
                for q in cur.consume(p):
                    if q < issued:
                        self.pins.unpin(cur.key(q), out)
            if matched:
                self.fill(cur, ev.dataset, out)
                return True
        return False

    def fill(self, cur: OrderCursor, dataset: str, out: list[Action]) -> None:
        """Pin and queue every block up to the lookahead ahead of the reader."""
        end = cur.lookahead_end(self.lookahead())
        start = max(cur.issued, cur.pos)
        consumed = cur.consumed
        for p in range(start, end):
            if consumed[p]:
                continue
            key, size = cur.key(p), cur.size(p)
            self.pins.pin(key, size, out)
            self.budget.want(key, size, 1 + p - cur.pos, "order", dataset, cur, cur.dropped + p)
        cur.issued = max(cur.issued, end)

    def fill_all(self, out: list[Action]) -> None:
        for (ds, _), cur in self.cursors.items():
            self.fill(cur, ds, out)

    def end(self, dataset: str, job: str, out: list[Action]) -> None:
        cur = self.cursors.pop((dataset, job), None)
        self.seen.pop((dataset, job), None)
        if cur is not None:
            self._release(cur, out)
            out.append(SetFuture((), append=False, stream=f"{dataset}/{job}"))

    def idle(self, now: float) -> list[JobKey]:
        """Orders announced or read last more than ``idle_timeout`` ago."""
        timeout = self.settings.idle_timeout
        return [jk for jk, seen in self.seen.items() if now - seen > timeout]

    def _release(self, cur: OrderCursor, out: list[Action]) -> None:
        cur.alive = False
        for p in cur.unread_issued():
            self.pins.unpin(cur.key(p), out)
        for key in self.budget.owned_by(cur):
            out.append(Cancel(key))
