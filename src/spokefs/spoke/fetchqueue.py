"""Which blocks to ask the upstream for next, and how many in one request (sans-I/O).

Blocks wait here by priority (0 is a reader waiting, first; larger is prefetch, later) and
leave in batches: one request carries many blocks of one dataset (the batch read of
docs/protocol.md), so a small file costs neither a round trip nor an HTTP exchange of its own.

The rules, in the order they apply:

- at most ``max_requests`` requests are out; a demand block always takes a free one;
- a batch is made of the head of the queue and the next entries of the same dataset, the
  same route (the upstream, or one tier member: ``route``, None for the upstream) and the
  same kind (demand with demand, prefetch with prefetch), up to ``max_blocks`` blocks and
  ``max_bytes`` bytes;
- prefetch is held to a window: a prefetch batch may go only while less than
  ``prefetch_window`` bytes (asked for and not yet received, demand included, or received
  and not yet written: ``backlog``, so a slow disk slows the fill, not memory) are out,
  or fewer than ``min_prefetch`` prefetch requests are (so a block larger than the window
  still moves); it takes at most a quarter of the window (or ``min_batch_bytes``, whichever
  is more), so several requests share a long link and keep it busy between them, while a
  short one still gets batches worth their fixed cost. The spoke sets the window from what
  it measures of the link (``spokefs.linkmodel``): a demand miss issued behind a long
  prefetch queue then waits for a share of about twice the bandwidth-delay product, not for
  the whole queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Any

QUEUED, TAKEN, GONE = 0, 1, 2


class Entry:
    """A block waiting for, or on, a request."""

    __slots__ = ("data", "group", "key", "priority", "route", "size", "state")

    def __init__(self, key: Hashable, group: str, priority: int, size: int,
                 route: Hashable | None = None) -> None:
        self.key = key
        self.group = group
        self.priority = priority
        self.size = size
        self.state = QUEUED
        self.route = route  # where the block is asked for: None, the upstream; else the
        # caller's (a tier's Route): entries batch together only with an equal route
        self.data: Any = None  # the caller's own (the fetcher's Fetch)


class Batch:
    """One request's blocks; ``outstanding`` counts their bytes not yet received."""

    __slots__ = ("entries", "group", "outstanding", "prefetch", "route", "size")

    def __init__(self, entries: list[Entry], prefetch: bool) -> None:
        self.entries = entries
        self.group = entries[0].group
        self.route = entries[0].route
        self.prefetch = prefetch
        self.size = sum(e.size for e in entries)
        self.outstanding = self.size


class FetchQueue:
    def __init__(self, max_requests: int, prefetch_window: int | None = None,
                 min_prefetch: int = 2, max_blocks: int = 256,
                 max_bytes: int = 16 << 20, min_batch_bytes: int = 1 << 20) -> None:
        self.max_requests = max_requests
        self.prefetch_window = prefetch_window  # None: only the request limit holds prefetch
        self.min_prefetch = min_prefetch
        self.max_blocks = max_blocks
        self.max_bytes = max_bytes
        self.min_batch_bytes = min_batch_bytes
        self.active = 0           # requests out
        self.prefetch_active = 0  # of which prefetch
        self.inflight_bytes = 0   # asked for and not yet received, every request
        self.backlog = 0          # received, not yet written to the cache: counts too
        self._heap: list[tuple[int, int, Entry]] = []
        self._seq = itertools.count()
        self._queued = 0

    # -- entries -------------------------------------------------------------------------------
    def add(self, key: Hashable, group: str, priority: int, size: int,
            route: Hashable | None = None) -> Entry:
        e = Entry(key, group, priority, size, route)
        heapq.heappush(self._heap, (priority, next(self._seq), e))
        self._queued += 1
        return e

    def raise_priority(self, e: Entry, priority: int) -> None:
        """An entry is wanted sooner (a reader now waits for a prefetch): reordered while
        queued; out on a request, it only says so (a tier member's silence is then waited
        out no longer)."""
        if priority < e.priority:
            e.priority = priority
            if e.state == QUEUED:
                heapq.heappush(self._heap, (priority, next(self._seq), e))

    def remove(self, e: Entry) -> bool:
        """Take a queued entry out (a cancelled prefetch); False if it already left."""
        if e.state != QUEUED:
            return False
        e.state = GONE
        self._queued -= 1
        return True

    def requeue(self, e: Entry) -> None:
        """Put back an entry whose request ended without it (a retry)."""
        e.state = QUEUED
        heapq.heappush(self._heap, (e.priority, next(self._seq), e))
        self._queued += 1

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def held_back(self) -> bool:
        """Something waits for a request slot or for room in the prefetch window."""
        return self._queued > 0

    # -- batches -------------------------------------------------------------------------------
    def _head(self) -> Entry | None:
        while self._heap:
            priority, _, e = self._heap[0]
            if e.state == QUEUED and e.priority == priority:
                return e
            heapq.heappop(self._heap)  # stale: taken, removed, or raised (another copy)
        return None

    def _prefetch_fits(self) -> bool:
        return (self.prefetch_window is None or self.prefetch_active < self.min_prefetch
                or self.inflight_bytes + self.backlog < self.prefetch_window)

    def next_batch(self) -> Batch | None:
        """The next request to send, or None if nothing may go now."""
        if self.active >= self.max_requests:
            return None
        head = self._head()
        if head is None:
            return None
        prefetch = head.priority > 0
        if prefetch and not self._prefetch_fits():
            return None
        cap = self.max_bytes
        if prefetch and self.prefetch_window is not None:
            cap = min(cap, max(self.prefetch_window // 4, self.min_batch_bytes))
        entries: list[Entry] = []
        aside: list[tuple[int, int, Entry]] = []
        total = 0
        while len(entries) < self.max_blocks and self._heap:
            item = self._heap[0]
            priority, _, e = item
            if e.state != QUEUED or e.priority != priority:
                heapq.heappop(self._heap)
                continue
            if (priority > 0) != prefetch:
                break  # demand and prefetch never share a request
            if e.group != head.group or e.route != head.route:
                if len(aside) >= self.max_blocks:
                    break  # another dataset's (or route's) turn comes with its own head
                aside.append(heapq.heappop(self._heap))
                continue
            if entries and total + e.size > cap:
                break
            heapq.heappop(self._heap)
            e.state = TAKEN
            entries.append(e)
            total += e.size
        for item in aside:
            heapq.heappush(self._heap, item)
        self._queued -= len(entries)
        batch = Batch(entries, prefetch)
        self.active += 1
        self.prefetch_active += prefetch
        self.inflight_bytes += batch.size
        return batch

    def received(self, batch: Batch, nbytes: int) -> None:
        """Bytes of a batch's response arrived: they no longer fill the window."""
        n = min(nbytes, batch.outstanding)
        batch.outstanding -= n
        self.inflight_bytes -= n

    def finished(self, batch: Batch) -> None:
        """A batch's request ended (whatever came of it)."""
        self.active -= 1
        self.prefetch_active -= batch.prefetch
        self.inflight_bytes -= batch.outstanding
        batch.outstanding = 0
