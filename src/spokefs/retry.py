"""Retrying against an upstream: the backoff schedule (sans-I/O: delays, not sleeps) and the
one "retry until the deadline" loop that the spoke, its replica workers and the mount share."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from spokefs.errors import Failure, Transient, UpstreamUnavailable

T = TypeVar("T")


def backoff_delays(first: float = 0.05, cap: float = 2.0, factor: float = 2.0,
                   rng: random.Random | None = None) -> Iterator[float]:
    """Exponential backoff, each pause jittered to 50-100% of its ceiling: never a retry
    loop without a growing pause."""
    r = rng or random.Random()
    ceiling = first
    while True:
        yield ceiling * (0.5 + 0.5 * r.random())
        ceiling = min(cap, ceiling * factor)


async def retrying(attempt: Callable[[], Awaitable[T]], deadline: float,
                   give_up: Callable[[str], Exception], *,
                   on_transient: Callable[[Transient], None] | None = None,
                   bound_attempts: bool = False, first: float = 0.05, cap: float = 2.0,
                   now: Callable[[], float] | None = None,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> T:
    """``attempt()``, retried after each ``Transient`` with backoff for ``deadline`` seconds
    (the last pause ends at the deadline, for one last try); then ``give_up(cause)`` is
    raised. ``bound_attempts``: an attempt still running at the deadline is cut short too
    (a hung upstream cannot outlast it). ``now`` and ``sleep``: a clock for tests. An
    ``UpstreamUnavailable`` given up with gets the last failure's ``Failure`` kind."""
    clock = now or asyncio.get_running_loop().time
    end = clock() + deadline
    cause, last, kind = "no attempt made", None, Failure.NO_ANSWER
    for delay in backoff_delays(first, cap):
        try:
            if not bound_attempts:
                return await attempt()
            left = end - clock()
            if left <= 0:
                break
            async with asyncio.timeout(left):
                return await attempt()
        except Transient as exc:
            cause, last, kind = str(exc), exc, exc.kind
            if on_transient is not None:
                on_transient(exc)
        except TimeoutError as exc:
            if not bound_attempts:
                raise
            cause, last, kind = f"no answer within {deadline:g}s", exc, Failure.NO_ANSWER
            break
        left = end - clock()
        if left <= 0:
            break
        await sleep(min(delay, left))
    err = give_up(cause)
    if isinstance(err, UpstreamUnavailable) and err.cause == cause:
        err.kind = kind  # typed where the failure was seen, not guessed from its text
    raise err from last
