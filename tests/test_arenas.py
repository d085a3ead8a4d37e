"""The fetcher's receive buffers (``spoke.fetcher.Arenas``): reused while a fill cycles
through them, given back once idle, never while a view of one is alive."""

from __future__ import annotations

import asyncio

from spokefs.spoke.fetcher import Arenas


async def test_idle_buffers_are_given_back_and_busy_ones_kept() -> None:
    arenas = Arenas(keep_bytes=64 << 20)
    try:
        busy = memoryview(arenas.take(1 << 20))  # a block still referred to
        for _ in range(3):
            arenas.take(1 << 20)  # reused: nothing else refers to it
        await asyncio.sleep(0.05)  # let the spare be made in its thread
        assert arenas.kept == 2 << 20  # the busy one and one reused three times
        assert arenas.trim() == 0  # all were used since the last trim
        freed = arenas.trim()  # nothing taken since: the free buffer and the spare go
        assert freed == 2 << 20
        assert arenas.kept == 1 << 20  # the busy one stays while its view lives
        busy.release()
        assert arenas.trim() == 1 << 20
        assert arenas.kept == 0
        a = arenas.take(1 << 20)  # a later fill starts again
        assert len(a) == 1 << 20 and arenas.kept == 1 << 20
    finally:
        arenas.close()
