"""What became resident lately, for processes that read the cache on their own.

A mount on the spoke's host reads resident blocks from the segment files itself, but must
first learn where a block is. Asking per file costs a round trip to the spoke for every small
file a job opens, even for files the spoke prefetched long before. The feed is the other
way round: the store tells it of every block that becomes resident, and a reader that asks
anyway (a locate, a report of its reads) gets what was added since it last asked, so by the
time it opens a prefetched file it already knows where the bytes are.

Sans-I/O: a bounded list with sequence numbers. An entry can go stale (the block was
evicted); readers of the cache treat a stale location as a miss, never serve it.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ResidencyFeed(Generic[K, V]):
    """The last ``keep`` blocks that became resident, each with a sequence number."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self._entries: deque[tuple[K, V]] = deque(maxlen=keep)
        self.end = 0  # the sequence number the next entry gets

    def add(self, key: K, value: V) -> None:
        self._entries.append((key, value))
        self.end += 1

    def since(self, cursor: int, limit: int) -> tuple[list[tuple[K, V]], int]:
        """Up to ``limit`` entries from ``cursor`` on, oldest first, and the cursor to ask
        with next. A cursor older than what is kept starts at the oldest kept; one from the
        future (the reader last asked a spoke that has restarted since) starts over."""
        first = self.end - len(self._entries)
        start = first if cursor > self.end else max(cursor, first)
        stop = min(self.end, start + max(0, limit))
        return list(islice(self._entries, start - first, stop - first)), stop
