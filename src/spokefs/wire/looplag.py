"""How late the event loop runs what is due: the wait every reader of a service shares.

A task asks to wake every ``interval`` seconds and records how much later than asked it woke.
Anything that holds the loop (a long computation, a blocking syscall, SQL) shows up here, in
``spokefs_event_loop_lag_seconds`` (a histogram, so any window's quantiles can be read off two
scrapes).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5)


class LoopLag:
    def __init__(self, registry: CollectorRegistry, interval: float = 0.01) -> None:
        self.interval = interval
        self.histogram = Histogram("spokefs_event_loop_lag_seconds",
                                   "How much later than due the event loop ran a timer",
                                   buckets=BUCKETS, registry=registry)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.histogram.observe(max(0.0, loop.time() - due))
