"""Telling an eviction storm from ordinary churn (sans-I/O: the caller passes the time).

A cache that evicts a large share of its capacity within a minute is turning over faster
than any job can reuse it: the working sets do not fit, or a scan is flushing them. That is
worth one log line; a steady trickle of evictions is not.
"""

from __future__ import annotations

from collections import deque


class StormWatch:
    """Evicted bytes over a sliding ``window_s``; ``evicted`` answers the bytes of that window
    when they first pass ``share`` of the capacity (then nothing for ``quiet_s``)."""

    def __init__(self, share: float = 0.5, window_s: float = 60.0,
                 quiet_s: float = 300.0) -> None:
        self.share = share
        self.window_s = window_s
        self.quiet_s = quiet_s
        self._events: deque[tuple[float, int]] = deque()
        self._bytes = 0
        self._reported: float | None = None

    def evicted(self, nbytes: int, now: float, capacity: int) -> int | None:
        self._events.append((now, nbytes))
        self._bytes += nbytes
        while self._events and self._events[0][0] <= now - self.window_s:
            self._bytes -= self._events.popleft()[1]
        if self._bytes < self.share * capacity:
            return None
        if self._reported is not None and now - self._reported < self.quiet_s:
            return None
        self._reported = now
        return self._bytes
