"""A concurrency limit whose waiters are served by priority (0 first), FIFO within one.

Demand misses take priority 0 and jump ahead of queued prefetches, so a reader never waits
behind the planner's background fill for a slot on the link. Ordering the queue is not
enough once prefetches hold the link (its bandwidth is shared by the requests on it), so
prefetch (priority > 0) may also be held to a window: a waiting prefetch starts only while
less than ``prefetch_window`` bytes (demand and prefetch, asked for and not yet received:
``received()`` counts them down as they arrive) are outstanding, or fewer than
``min_prefetch`` prefetches are (so a block larger than the window still moves). Demand
always takes a free slot. The spoke sets the window from what it measures of the link
(``spokefs.linkmodel``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Grant:
    """A slot held: ``size`` bytes still to come count against the window; ``prefetch``
    when it was let through the window."""

    __slots__ = ("prefetch", "size")

    def __init__(self, size: int = 0, prefetch: bool = False) -> None:
        self.size = size
        self.prefetch = prefetch


class PriorityLimiter:
    def __init__(self, limit: int, prefetch_window: int | None = None,
                 min_prefetch: int = 2) -> None:
        self.limit = limit
        self.active = 0
        self.prefetch_window = prefetch_window  # None: only the slots bound prefetch
        self.min_prefetch = min_prefetch
        self.prefetch_active = 0
        self.inflight_bytes = 0  # of every granted slot, demand included
        # (priority, seq, size, future); a raised ticket adds a second entry for its future.
        self._waiters: list[tuple[int, int, int, asyncio.Future[Grant]]] = []
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return len({id(w[3]) for w in self._waiters if not w[3].done()})

    @property
    def held_back(self) -> bool:
        """Something waits for a slot or for room in the prefetch window."""
        while self._waiters and self._waiters[0][3].done():
            heapq.heappop(self._waiters)
        return bool(self._waiters)

    async def acquire(self, priority: int = 0, ticket: Ticket | None = None,
                      size: int = 0) -> Grant:
        """Wait for a slot. ``ticket`` lets another party raise the priority while queued;
        ``size`` is the bytes the request will bring. Returns the grant for release()."""
        if ticket is not None:
            priority = min(priority, ticket.priority)
        fut: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        if ticket is not None:
            ticket.limiter, ticket.future, ticket.priority, ticket.size = (
                self, fut, priority, size)
        heapq.heappush(self._waiters, (priority, next(self._seq), size, fut))
        self._dispatch()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # the slot was handed over just as we were cancelled
            raise

    def release(self, grant: Grant | None = None) -> None:
        self.active -= 1
        if grant is not None:
            self.inflight_bytes -= grant.size
            self.prefetch_active -= grant.prefetch
            grant.size = 0
        self._dispatch()

    def received(self, grant: Grant, nbytes: int) -> None:
        """Bytes of a held slot's response arrived: they no longer fill the window."""
        n = min(nbytes, grant.size)
        if n > 0:
            grant.size -= n
            self.inflight_bytes -= n
            self._dispatch()

    def set_prefetch_window(self, nbytes: int | None) -> None:
        self.prefetch_window = nbytes
        self._dispatch()  # a larger window may let queued prefetches go

    def _prefetch_fits(self) -> bool:
        return (self.prefetch_window is None or self.prefetch_active < self.min_prefetch
                or self.inflight_bytes < self.prefetch_window)

    def _dispatch(self) -> None:
        while self.active < self.limit and self._waiters:
            priority, _, size, fut = self._waiters[0]
            if fut.done():  # cancelled, or the other entry of a raised ticket went first
                heapq.heappop(self._waiters)
                continue
            if priority > 0 and not self._prefetch_fits():
                return  # the heap's best is a prefetch, so is everything behind it
            heapq.heappop(self._waiters)
            self.active += 1
            self.inflight_bytes += size
            self.prefetch_active += priority > 0
            fut.set_result(Grant(size, priority > 0))

    def _raise(self, fut: asyncio.Future[Grant], priority: int, size: int) -> None:
        # A second heap entry for the same waiter; whichever pops first wins, and
        # _dispatch() skips entries whose future is already done.
        heapq.heappush(self._waiters, (priority, next(self._seq), size, fut))
        self._dispatch()

    @asynccontextmanager
    async def slot(self, priority: int = 0, ticket: Ticket | None = None,
                   size: int = 0) -> AsyncIterator[Grant]:
        grant = await self.acquire(priority, ticket, size)
        try:
            yield grant
        finally:
            self.release(grant)


class Ticket:
    """A queued acquire whose priority can be raised (a prefetch a reader now waits for)."""

    def __init__(self) -> None:
        self.limiter: PriorityLimiter | None = None
        self.future: asyncio.Future[Grant] | None = None
        self.priority = 1 << 30
        self.size = 0

    def raise_to(self, priority: int) -> None:
        self.priority = min(self.priority, priority)
        if self.limiter is not None and self.future is not None and not self.future.done():
            self.limiter._raise(self.future, priority, self.size)
