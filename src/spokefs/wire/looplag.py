"""How late the event loop runs what is due: the wait every reader of a service shares.

A task asks to wake every ``interval`` seconds and records how much later than asked it woke.
Anything that holds the loop (a long computation, a blocking syscall, SQL) shows up here, in
``spokefs_event_loop_lag_seconds`` (a histogram, so any window's quantiles can be read off two
scrapes), and in ``lag()``, what a server's ``/healthz`` answers from.
"""

from __future__ import annotations

import asyncio
import os

from prometheus_client import CollectorRegistry, Histogram

BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5)
# /healthz: the loop is healthy while its recent lag is under this (seconds). A liveness
# probe that fails restarts the process, so only a loop held for seconds fails it.
HEALTH_MAX_LAG = float(os.environ.get("SPOKEFS_HEALTHZ_MAX_LAG", "5"))


class LoopLag:
    """``registry``: where the histogram goes (None: none, ``lag()`` only). ``window``: how
    long a late wake-up counts as recent for ``lag()`` (default: twice ``HEALTH_MAX_LAG``, so
    one stall fails a probe or two, not every probe for long after)."""

    def __init__(self, registry: CollectorRegistry | None, interval: float = 0.01,
                 window: float | None = None) -> None:
        self.interval = interval
        self.window = window if window is not None else max(1.0, 2 * HEALTH_MAX_LAG)
        self.histogram = (Histogram("spokefs_event_loop_lag_seconds",
                                    "How much later than due the event loop ran a timer",
                                    buckets=BUCKETS, registry=registry)
                          if registry is not None else None)
        self._due: float | None = None  # when the wake-up being waited for is due (loop time)
        self._worst = 0.0                # the largest recent lag, and when it was seen
        self._worst_at = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            now = loop.time()
            lag = max(0.0, now - due)
            if self.histogram is not None:
                self.histogram.observe(lag)
            if lag >= self._worst or now - self._worst_at > self.window:
                self._worst, self._worst_at = lag, now

    def lag(self) -> float:
        """The loop's recent lag, in seconds: the worst of the last ``window``, or how
        overdue the current wake-up already is, if more (called right after a stall, before
        the ticker ran again, this still sees it). 0 before ``run`` started."""
        if self._due is None:
            return 0.0
        now = asyncio.get_running_loop().time()
        worst = self._worst if now - self._worst_at <= self.window else 0.0
        return max(worst, now - self._due)
