"""Retrying against an upstream: one policy object (``RetryPolicy``: the backoff schedule
and the deadline, sans-I/O: it says how long to pause, never sleeps) and the one "retry
until the deadline" loop that the spoke, its replica workers and the mount share.

Every retry in spokefs takes its pauses from a ``RetryPolicy``: the loop below, the spoke's
fetch path (``spoke/fetcher.py``: a fetch's own schedule, held in the fetch), the synchronous
client (``client/sync.py``: urllib3 is told not to retry, since a deadline, a final
certificate error and a resumed cut-short body are not what its ``Retry`` counts), and the
tier's Kubernetes watch (``tier/sources.py``, no deadline). The native mount's HTTP reader
(native/mount/src/http.rs) follows ``NEAR``'s numbers in Rust.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

from spokefs.errors import Failure, Transient, UpstreamUnavailable

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Pauses between tries whose ceiling starts at ``base`` seconds and doubles up to
    ``cap``, each drawn from ``[1 - jitter, 1]`` of its ceiling (so many clients that failed
    together do not come back together), for ``deadline`` seconds after the first try; the
    last pause ends at the deadline, for one last try. ``math.inf``: never give up."""

    base: float = 0.05
    cap: float = 2.0
    jitter: float = 0.5
    deadline: float = 30.0

    def __post_init__(self) -> None:
        if not (0 < self.base <= self.cap and 0 <= self.jitter <= 1 and self.deadline > 0):
            raise ValueError(f"not a retry policy: {self} (0 < base <= cap, 0 <= jitter <= 1, "
                             "deadline > 0)")

    def within(self, deadline: float) -> RetryPolicy:
        """The same schedule with another deadline (each caller's ``--deadline``)."""
        return replace(self, deadline=deadline)

    def ceiling(self, attempt: int) -> float:
        """The longest pause after failed try number ``attempt`` (0: the first)."""
        return min(self.cap, self.base * 2.0 ** min(attempt, 64))

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The pauses, one per failed try, jittered: never a retry loop without a growing
        pause."""
        r = rng or random.Random()
        for k in itertools.count():
            yield self.ceiling(k) * (1.0 - self.jitter * r.random())

    def pause(self, delay: float, elapsed: float) -> float | None:
        """How long to pause before the next try, ``elapsed`` seconds after the first
        (``delay``: the next of ``delays()``), cut to end at the deadline; None once the
        deadline has passed: give up."""
        left = self.deadline - elapsed
        return None if left <= 0 else min(delay, left)


# An upstream across the link (hub, spoke, bucket hub): 50 ms doubling to 2 s.
UPSTREAM = RetryPolicy()
# A peer on this host that comes back quickly (the spoke's primary worker, the mount's
# spoke): 20 ms doubling to 0.5 s.
NEAR = RetryPolicy(base=0.02, cap=0.5)


def forever(base: float, cap: float) -> RetryPolicy:
    """A schedule with no deadline, for what must keep trying (a watch)."""
    return RetryPolicy(base=base, cap=cap, deadline=math.inf)


async def retrying(attempt: Callable[[], Awaitable[T]], policy: RetryPolicy,
                   give_up: Callable[[str], Exception], *,
                   on_transient: Callable[[Transient], None] | None = None,
                   bound_attempts: bool = False,
                   now: Callable[[], float] | None = None,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> T:
    """``attempt()``, retried after each ``Transient`` as ``policy`` says until its deadline;
    then ``give_up(cause)`` is raised. ``bound_attempts``: an attempt still running at the
    deadline is cut short too (a hung upstream cannot outlast it). ``now`` and ``sleep``: a
    clock for tests. An ``UpstreamUnavailable`` given up with gets the last failure's
    ``Failure`` kind."""
    clock = now or asyncio.get_running_loop().time
    start = clock()
    cause, last, kind = "no attempt made", None, Failure.NO_ANSWER
    for delay in policy.delays():
        try:
            if not bound_attempts:
                return await attempt()
            left = policy.deadline - (clock() - start)
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
            cause, last = f"no answer within {policy.deadline:g}s", exc
            kind = Failure.NO_ANSWER
            break
        pause = policy.pause(delay, clock() - start)
        if pause is None:
            break
        await sleep(pause)
    err = give_up(cause)
    if isinstance(err, UpstreamUnavailable) and err.cause == cause:
        err.kind = kind  # typed where the failure was seen, not guessed from its text
    raise err from last
