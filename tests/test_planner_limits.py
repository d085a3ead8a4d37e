"""The planner's state per client-chosen name is bounded: orders are capped and expire,
learners are capped (no sockets, no clock: the events carry ``now``)."""

from __future__ import annotations

import pytest

from spokefs.errors import ConfigError
from spokefs.planner import JobEnded, OrderAnnounced, Read
from test_planner import Harness, tree


def test_orders_beyond_the_cap_are_refused_until_a_job_ends() -> None:
    m = tree({"a": 40})
    h = Harness(m, max_jobs=3)
    for j in range(3):
        h.send(OrderAnnounced("ds", f"job{j}", 0, [j], now=1.0))
    with pytest.raises(ConfigError, match="3 jobs have announced orders"):
        h.send(OrderAnnounced("ds", "job3", 0, [3], now=1.0))
    h.send(OrderAnnounced("ds", "job0", 1, [5], now=1.0))  # a known job: always taken
    h.send(JobEnded("ds", "job1", now=2.0))
    h.send(OrderAnnounced("ds", "job3", 0, [3], now=2.0))  # room again


def test_an_order_nobody_reads_expires_and_releases_its_pins() -> None:
    m = tree({"a": 40})
    h = Harness(m, max_jobs=2, idle_timeout=100.0)
    h.send(OrderAnnounced("ds", "idle", 0, list(range(10)), now=0.0))
    h.send(OrderAnnounced("ds", "busy", 0, list(range(10, 20)), now=0.0))
    assert sum(h.pins.values()) > 0
    for t in (50.0, 120.0):  # "busy" reads along its order; "idle" never reads
        i = 10 if t < 100 else 11
        h.send(Read("ds", m.paths[i], m.versions[i], m.sizes[i], 0, m.sizes[i], job="busy",
                    now=t))
    # "idle" was announced at 0 and never read: gone at 120 s, its pins with it.
    idle_keys = {(m.versions[i], 0) for i in range(10)}
    assert not any(h.pins[k] for k in idle_keys)
    h.send(OrderAnnounced("ds", "new", 0, [30], now=121.0))  # its slot is free again
    with pytest.raises(ConfigError):
        h.send(OrderAnnounced("ds", "one-too-many", 0, [31], now=121.0))


def test_learners_are_capped_oldest_dropped() -> None:
    m = tree({"a": 40})
    h = Harness(m, max_jobs=4, scan_threshold=4)
    for j in range(10):  # ten clients, each with a name of its own
        i = j % len(m.paths)
        h.send(Read("ds", m.paths[i], m.versions[i], m.sizes[i], 0, m.sizes[i],
                    job=f"client{j}", now=float(j)))
    assert len(h.p.learning.learners) == 4
    assert {job for _, job in h.p.learning.learners} == {f"client{j}" for j in range(6, 10)}
    assert h.p.stats["learners_dropped"] == 6
