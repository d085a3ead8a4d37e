"""The job routes' rate per principal (``wire.ratelimit``), with the clock passed in."""

from __future__ import annotations

import pytest

from spokefs.wire.ratelimit import TokenBuckets


def test_a_burst_then_the_sustained_rate() -> None:
    b = TokenBuckets(rate=2, burst=4)
    assert [b.take("a", 0.0) for _ in range(4)] == [0.0] * 4
    assert b.take("a", 0.0) == pytest.approx(0.5)  # empty: one token comes in 1/rate
    assert b.take("a", 0.25) == pytest.approx(0.25)  # a refusal takes nothing
    assert b.take("a", 0.5) == 0.0
    assert b.take("b", 0.5) == 0.0  # principals do not share a bucket
    assert b.take("a", 100.0) == 0.0  # a long pause refills to the burst, not beyond
    assert [b.take("a", 100.0) for _ in range(3)] == [0.0] * 3
    assert b.take("a", 100.0) > 0


def test_principals_remembered_are_bounded() -> None:
    b = TokenBuckets(rate=1, burst=1, most=3)
    for key in "abcd":
        assert b.take(key, 0.0) == 0.0
    assert len(b) == 3
    assert b.take("b", 0.0) > 0  # still remembered, still empty
    assert b.take("a", 0.0) == 0.0  # forgotten first (least recently heard): starts full


def test_nonsense_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        TokenBuckets(rate=0)
    with pytest.raises(ValueError):
        TokenBuckets(burst=0.5)
