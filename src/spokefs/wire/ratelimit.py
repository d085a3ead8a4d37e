"""How often one principal may make a job's requests (announce an order, start an epoch,
report steps, end a job): a token bucket per principal, sans-I/O (the clock is passed).

A job announces an order once an epoch; one that announces epoch after epoch without
reading makes the planner lay out a future it will never use, on the event loop that also
answers reads. Past its burst, a principal gets a 429 with ``Retry-After`` (``spokefs.torch``
and ``SpokeControl`` treat it as a lost hint, never the training loop's problem), and the
request is refused before its body is read.

A principal is a token's name on a server with ``--auth``, else the client's address. The
spoke's own processes and tier members are not limited. Each worker process keeps its own
buckets (a replica worker refuses before it forwards), so a spoke of N workers admits up to
N times the rate from a client whose connections land on every worker.
"""

from __future__ import annotations

import os
from collections import OrderedDict

RATE = float(os.environ.get("SPOKEFS_JOB_RATE", "8"))     # requests per second, sustained
BURST = float(os.environ.get("SPOKEFS_JOB_BURST", "64"))  # requests at once, after a pause
MOST = 65_536  # principals remembered; the one heard from least recently leaves first


class TokenBuckets:
    """``take(key, now)``: 0.0 when ``key`` may make one more request now (and it is
    counted), else the seconds until it may."""

    def __init__(self, rate: float = RATE, burst: float = BURST, most: int = MOST) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a rate above 0 and a burst of at least 1, not {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self.most = most
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def take(self, key: str, now: float) -> float:
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        wait = 0.0
        if tokens >= 1:
            tokens -= 1
        else:
            wait = (1 - tokens) / self.rate
        self._buckets[key] = (tokens, now)  # most recent last
        while len(self._buckets) > self.most:
            self._buckets.popitem(last=False)  # a forgotten principal starts full: harmless
        return wait

    def __len__(self) -> int:
        return len(self._buckets)
