"""The in-flight budget: every fetch the planner asked for and has not heard the end of, and
the prefetches waiting for room.

Demand fetches (a reader waits) go out at once and are never held back; prefetches queue
by priority and go out while the outstanding prefetch bytes stay within ``max_bytes`` (the
first one always goes, however large). ``prefetch_bytes`` and ``demand_bytes`` are sums over
``inflight``, kept as each fetch starts and ends (tests/test_planner_ledgers.py checks it).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Protocol

from spokefs.planner.events import DEMAND, Action, Fetch
from spokefs.policy import BlockKey


class Owner(Protocol):
    """Who queued a prefetch: ``alive`` turns False when it is no longer wanted (a readahead
    stream that seeked, an order replaced or ended). An owner that queues positions (an
    order's cursor, ``tag`` >= 0) also answers ``was_read(tag)``."""

    alive: bool


@dataclass(slots=True)
class Inflight:
    size: int
    priority: int
    reason: str
    dataset: str
    owner: object = None


class Budget:
    def __init__(self, max_bytes: int, resident: Container[BlockKey], stats: Counter[str]
                 ) -> None:
        self.max_bytes = max_bytes
        self.resident = resident
        self.stats = stats
        self.inflight: dict[BlockKey, Inflight] = {}
        self.prefetch_bytes = 0
        self.demand_bytes = 0
        # (priority, seq, key, size, reason, dataset, owner, tag): owner.alive False, or an
        # order's position (tag) already read, makes an entry stale.
        self._queue: list[tuple[int, int, BlockKey, int, str, str, Any, int]] = []
        self._seq = 0

    def __contains__(self, key: object) -> bool:
        return key in self.inflight

    def demand(self, key: BlockKey, size: int, dataset: str, out: list[Action]) -> None:
        """A reader waits for ``key``: fetch it now, or raise its prefetch to demand."""
        inf = self.inflight.get(key)
        if inf is None:
            self.inflight[key] = Inflight(size, DEMAND, "demand", dataset)
            self.demand_bytes += size
            out.append(Fetch(key, size, DEMAND, "demand", dataset))
            self.stats["fetch_demand"] += 1
        elif inf.priority != DEMAND:  # the reader caught a prefetch: it jumps the queue
            inf.priority = DEMAND  # its bytes stay prefetch bytes: they were counted so
            out.append(Fetch(key, inf.size, DEMAND, "demand", inf.dataset))
            self.stats["late_prefetch"] += 1

    def want(self, key: BlockKey, size: int, priority: int, reason: str, dataset: str,
             owner: Owner, tag: int = -1) -> None:
        """Queue a prefetch (readahead or order); ``pump`` sends it when the budget allows.
        ``tag`` >= 0: the owner's position, dropped once ``owner.was_read(tag)``."""
        if size <= 0 or key in self.resident or key in self.inflight:
            return
        self._seq += 1
        heapq.heappush(self._queue, (priority, self._seq, key, size, reason, dataset, owner,
                                     tag))

    def ok(self, size: int) -> bool:
        return self.prefetch_bytes == 0 or self.prefetch_bytes + size <= self.max_bytes

    def issue(self, key: BlockKey, size: int, priority: int, reason: str, dataset: str,
              owner: object, out: list[Action]) -> None:
        self.inflight[key] = Inflight(size, priority, reason, dataset, owner)
        self.prefetch_bytes += size
        out.append(Fetch(key, size, priority, reason, dataset))
        self.stats[f"fetch_{reason}"] += 1

    def pump(self, out: list[Action]) -> bool:
        """Send queued prefetches while the budget allows; False when it ran out of room."""
        queue = self._queue
        while queue:
            prio, _, key, size, reason, dataset, owner, tag = queue[0]
            if (
                not owner.alive
                or key in self.resident
                or key in self.inflight
                or (tag >= 0 and owner.was_read(tag))  # the reader got there first
            ):
                heapq.heappop(queue)
                continue
            if not self.ok(size):
                return False
            heapq.heappop(queue)
            self.issue(key, size, prio, reason, dataset, owner, out)
        return True

    def done(self, key: BlockKey) -> None:
        """The fetch of ``key`` ended (resident or failed)."""
        inf = self.inflight.pop(key, None)
        if inf is not None:
            if inf.reason == "demand":
                self.demand_bytes -= inf.size
            else:
                self.prefetch_bytes -= inf.size

    def owned_by(self, owner: object) -> list[BlockKey]:
        return [key for key, inf in self.inflight.items() if inf.owner is owner]
