"""Whole-block fetches for streaming reads, exact ranges for random ones.

Why it exists (measured, docs/mount.md): with readahead raised, the kernel streams a file as
1 MiB requests. Sent one for one, each becomes an HTTP request whose fixed cost (request
handling, and, when this was measured, the spoke checking the whole 4 MiB block it comes
from; it now checks only the 256 KiB chunks a range touches) is paid four times per block.
So a streaming read fetches the whole aligned block once, serves the kernel's requests from
it, and starts the next block before it is asked for. A random read (not where the last read
of that file ended) fetches exactly what was asked: a whole block would only add latency.

Memory is bounded: at most ``capacity`` bytes of blocks, least recently used dropped first, and
a block is dropped as soon as every byte of it has been served (the kernel's page cache holds
it from then on). Block buffers are reused, because fresh multi-MiB buffers cost a page fault
per 4 KiB. A buffer goes back to the pool only when no fetch writes into it and no read holds
a view of it, and only on a later turn of the event loop: pyfuse3 copies a read's reply out
synchronously right after ``read`` returns, so by then the view is no longer needed.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

FetchInto = Callable[[str, int, memoryview], Awaitable[int]]  # (version, start, buf) -> count

STREAM_MIN = 512 * 1024   # a first read this large at offset 0 is the kernel's readahead
DEFAULT_CAPACITY = 64 * 1024 * 1024


class _Block:
    __slots__ = ("buf", "dropped", "future", "length", "served", "users")

    def __init__(self, buf: bytearray, length: int) -> None:
        self.buf = buf
        self.length = length
        self.future: asyncio.Future[int] | None = None
        self.served = 0
        self.users = 0          # reads holding a view of buf
        self.dropped = False    # out of the table; buf returns to the pool when unused


@dataclass
class CoalesceStats:
    block_fetches: int = 0
    block_bytes: int = 0
    exact_fetches: int = 0
    exact_bytes: int = 0
    served_from_blocks: int = 0
    prefetches: int = 0
    dropped_unused: int = 0


class Coalescer:
    """Turns the kernel's reads of file versions into block or exact-range fetches."""

    def __init__(self, fetch_into: FetchInto, block_size: int,
                 capacity: int = DEFAULT_CAPACITY, prefetch: int = 2) -> None:
        self.fetch_into = fetch_into
        self.block_size = block_size
        self.capacity = max(capacity, block_size)
        self.prefetch = prefetch
        self.stats = CoalesceStats()
        self._blocks: OrderedDict[tuple[str, int], _Block] = OrderedDict()
        self._held = 0
        self._pool: list[bytearray] = []
        self._last_end: OrderedDict[str, int] = OrderedDict()  # version -> end of last read
        self._tasks: set[asyncio.Task[int]] = set()

    async def read(self, version: str, size: int, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end) of a version of ``size`` bytes (``end`` <= ``size``)."""
        # A stream: this read starts where the last one of this version ended (the kernel's
        # readahead requests arrive in order), or a big first read at the start of the file.
        streaming = (self._last_end.get(version) == start
                     or (start == 0 and end - start >= STREAM_MIN))
        self._last_end[version] = end
        self._last_end.move_to_end(version)
        while len(self._last_end) > 4096:
            self._last_end.popitem(last=False)
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        indexes = range(first, last + 1)
        if not streaming and any((version, i) not in self._blocks for i in indexes):
            return await self._exact(version, start, end)
        blocks = [self._block(version, size, i) for i in indexes]
        for b in blocks:  # before anything can evict them
            b.users += 1
        try:
            if streaming:
                for i in range(last + 1, last + 1 + self.prefetch):
                    if i * bs < size and (version, i) not in self._blocks:
                        self.stats.prefetches += 1
                        self._block(version, size, i)
            parts = []
            for i, b in zip(indexes, blocks, strict=True):
                assert b.future is not None
                got = await asyncio.shield(b.future)
                lo = max(start, i * bs) - i * bs
                hi = min(end, (i + 1) * bs, i * bs + got) - i * bs
                parts.append(memoryview(b.buf)[lo:max(lo, hi)])
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            for b in blocks:
                b.users -= 1
                if b.dropped:
                    self._recycle(b)
        # Accounting only after the last await: a buffer freed here is reused on a later
        # loop turn, after pyfuse3 has copied the reply out of the view returned now.
        for i, b, part in zip(indexes, blocks, parts, strict=True):
            self._served(version, i, b, len(part))
        self.stats.served_from_blocks += len(data)
        return data

    async def _exact(self, version: str, start: int, end: int) -> memoryview:
        self.stats.exact_fetches += 1
        self.stats.exact_bytes += end - start
        buf = bytearray(end - start)  # small: from the heap, no pool needed
        n = await self.fetch_into(version, start, memoryview(buf))
        return memoryview(buf)[:n]

    def _block(self, version: str, size: int, index: int) -> _Block:
        key = (version, index)
        b = self._blocks.get(key)
        if b is not None:
            self._blocks.move_to_end(key)
            return b
        lo = index * self.block_size
        length = min(size, lo + self.block_size) - lo
        buf = self._pool.pop() if self._pool else bytearray(self.block_size)
        b = _Block(buf, length)
        task = asyncio.get_running_loop().create_task(
            self.fetch_into(version, lo, memoryview(buf)[:length]))
        b.future = task
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._fetched(key, b, t))
        self._blocks[key] = b
        self._held += length
        self.stats.block_fetches += 1
        self.stats.block_bytes += length
        while self._held > self.capacity and len(self._blocks) > 1:
            old_key, old = next(iter(self._blocks.items()))
            if old.served == 0:
                self.stats.dropped_unused += 1
            self._drop(old_key, old)
        return b

    def _fetched(self, key: tuple[str, int], b: _Block, task: asyncio.Task[int]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is not None:
            self._drop(key, b)  # forget a failure at once: the next read tries again
        elif b.dropped:
            self._recycle(b)

    def _served(self, version: str, index: int, b: _Block, n: int) -> None:
        b.served += n
        if b.served >= b.length:  # all handed to the kernel: its page cache has it now
            self._drop((version, index), b)

    def _drop(self, key: tuple[str, int], b: _Block) -> None:
        if self._blocks.get(key) is b:
            del self._blocks[key]
            self._held -= b.length
        if not b.dropped:
            b.dropped = True
            self._recycle(b)

    def _recycle(self, b: _Block) -> None:
        if b.users or b.future is None or not b.future.done():
            return  # still read from or written into; the last user or the fetch recycles
        buf, b.buf = b.buf, bytearray()
        if buf and len(self._pool) < self.capacity // self.block_size:
            asyncio.get_running_loop().call_soon(self._pool.append, buf)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._blocks.clear()
        self._pool.clear()
        self._held = 0
