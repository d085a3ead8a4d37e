"""The one retry policy (``spokefs.retry.RetryPolicy``): its schedule, sans-I/O, and the loop
that follows it, on a clock of the test's own."""

from __future__ import annotations

import asyncio
import itertools
import math
import random

import pytest

from spokefs.errors import Failure, Transient, UpstreamUnavailable
from spokefs.retry import NEAR, UPSTREAM, RetryPolicy, forever, retrying


def test_ceilings_double_from_base_to_cap() -> None:
    p = RetryPolicy(base=0.05, cap=2.0)
    assert [p.ceiling(k) for k in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert p.ceiling(10_000) == 2.0  # no overflow however long it has failed
    assert [NEAR.ceiling(k) for k in (0, 4, 5)] == [0.02, 0.32, 0.5]


def test_each_pause_is_jittered_below_its_ceiling() -> None:
    p = RetryPolicy(base=0.1, cap=1.0, jitter=0.5)
    pauses = list(itertools.islice(p.delays(random.Random(7)), 200))
    for k, d in enumerate(pauses):
        assert 0.5 * p.ceiling(k) <= d <= p.ceiling(k), (k, d)
    assert len({round(d, 9) for d in pauses[10:]}) > 100  # jittered, not one value
    # Seeded: the same schedule; no jitter: exactly the ceilings.
    assert list(itertools.islice(p.delays(random.Random(7)), 200)) == pauses
    exact = RetryPolicy(base=0.1, cap=1.0, jitter=0.0)
    assert list(itertools.islice(exact.delays(), 5)) == [0.1, 0.2, 0.4, 0.8, 1.0]


def test_the_last_pause_ends_at_the_deadline_then_it_gives_up() -> None:
    p = UPSTREAM.within(3.0)
    assert (p.base, p.cap, p.deadline) == (0.05, 2.0, 3.0) and UPSTREAM.deadline == 30.0
    assert p.pause(2.0, 0.5) == 2.0
    assert p.pause(2.0, 2.5) == 0.5    # one last try at the deadline
    assert p.pause(2.0, 3.0) is None
    assert p.pause(0.1, 7.0) is None
    assert forever(0.5, 30.0).pause(30.0, 1e9) == 30.0
    assert forever(0.5, 30.0).deadline == math.inf


@pytest.mark.parametrize("bad", [dict(base=0.0), dict(base=3.0, cap=2.0), dict(jitter=1.5),
                                 dict(jitter=-0.1), dict(deadline=0.0)])
def test_what_is_not_a_policy_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**bad)
    with pytest.raises(AttributeError):
        UPSTREAM.base = 1.0  # type: ignore[misc]  # frozen: shared by every caller


def _clocked() -> tuple[list[float], list[float], object, object]:
    clock, slept = [0.0], []

    async def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    return clock, slept, (lambda: clock[0]), sleep


def test_the_loop_follows_the_policy_to_its_deadline() -> None:
    clock, slept, now, sleep = _clocked()
    tries = []

    async def attempt() -> None:
        tries.append(clock[0])
        raise Transient("refused", Failure.REFUSED)

    policy = RetryPolicy(base=0.1, cap=0.4, jitter=0.0, deadline=1.0)
    with pytest.raises(UpstreamUnavailable) as err:
        asyncio.run(retrying(attempt, policy, lambda c: UpstreamUnavailable(f"gone: {c}", "u", c),
                             now=now, sleep=sleep))  # type: ignore[arg-type]
    assert slept == pytest.approx([0.1, 0.2, 0.4, 0.3])  # the last cut to end at 1.0
    assert tries == pytest.approx([0.0, 0.1, 0.3, 0.7, 1.0])  # one last try at the deadline
    assert err.value.kind is Failure.REFUSED and "refused" in str(err.value)


def test_the_loop_returns_once_an_attempt_succeeds() -> None:
    _, slept, now, sleep = _clocked()
    n = [0]

    async def attempt() -> int:
        n[0] += 1
        if n[0] < 3:
            raise Transient("reset", Failure.RESET)
        return n[0]

    policy = RetryPolicy(base=0.1, cap=0.4, jitter=0.0, deadline=5.0)
    assert asyncio.run(retrying(attempt, policy, RuntimeError, now=now,  # type: ignore[arg-type]
                                sleep=sleep)) == 3
    assert slept == pytest.approx([0.1, 0.2])
