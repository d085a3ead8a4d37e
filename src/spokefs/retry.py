"""Backoff schedule for retries against an upstream (sans-I/O: delays, not sleeps)."""

from __future__ import annotations

import random
from collections.abc import Iterator


def backoff_delays(first: float = 0.05, cap: float = 2.0, factor: float = 2.0,
                   rng: random.Random | None = None) -> Iterator[float]:
    """Exponential backoff, each pause jittered to 50-100% of its ceiling: never a retry
    loop without a growing pause."""
    r = rng or random.Random()
    ceiling = first
    while True:
        yield ceiling * (0.5 + 0.5 * r.random())
        ceiling = min(cap, ceiling * factor)
