"""A concurrency limit whose waiters are served by priority (0 first), FIFO within one.

Demand misses take priority 0 and jump ahead of queued prefetches, so a reader never waits
behind the planner's background fill for a slot on the link.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class PriorityLimiter:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w[2].done())

    async def acquire(self, priority: int = 0, ticket: Ticket | None = None) -> None:
        """Wait for a slot. ``ticket`` lets another party raise the priority while queued."""
        if ticket is not None:
            priority = min(priority, ticket.priority)
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if ticket is not None:
            ticket.limiter, ticket.future, ticket.priority = self, fut, priority
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the next waiter
                return
        self.active -= 1

    def _raise(self, fut: asyncio.Future[None], priority: int) -> None:
        # A second heap entry for the same waiter; whichever pops first wins, and
        # release() skips entries whose future is already done.
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))

    @asynccontextmanager
    async def slot(self, priority: int = 0, ticket: Ticket | None = None
                   ) -> AsyncIterator[None]:
        await self.acquire(priority, ticket)
        try:
            yield
        finally:
            self.release()


class Ticket:
    """A queued acquire whose priority can be raised (a prefetch a reader now waits for)."""

    def __init__(self) -> None:
        self.limiter: PriorityLimiter | None = None
        self.future: asyncio.Future[None] | None = None
        self.priority = 1 << 30

    def raise_to(self, priority: int) -> None:
        self.priority = min(self.priority, priority)
        if self.limiter is not None and self.future is not None and not self.future.done():
            self.limiter._raise(self.future, priority)
