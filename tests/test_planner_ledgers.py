"""The planner's parts keep their byte ledgers in step with the actions they send, whatever
the events (property test), and the seams between the parts and their drivers hold."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spokefs.errors import ConfigError
from spokefs.manifest import Manifest as Snapshot
from spokefs.planner import (
    Action,
    CapacityChanged,
    EpochBoundary,
    Event,
    Evicted,
    Fetch,
    FetchDone,
    FetchFailed,
    JobEnded,
    Manifest,
    ManifestAdded,
    OrderAnnounced,
    Pin,
    Planner,
    Read,
    Unpin,
    WorkingSetLearned,
    WorkingSetRestored,
)
from spokefs.planner.interpreter import Interpreter
from spokefs.policy import BlockKey

KiB, MiB = 1 << 10, 1 << 20
BS = MiB
SIZES = [0, 10, 100 * KiB, 300 * KiB, BS, BS + 1, 3 * BS + 5, 6 * BS]
JOBS = ["", "j1", "j2"]


def manifest(tag: str = "") -> Manifest:
    return Manifest.from_entries(
        [(f"{d}/{j:03d}", f"{tag}v{d}{j}", SIZES[(j * 5 + len(d)) % len(SIZES)])
         for d in ("train/a", "train/b", "val") for j in range(12)], BS)


class Ledgers:
    """A pretend spoke that checks, after every call, that the planner's ledgers agree with
    the actions it sent: fetches outstanding, pins held."""

    def __init__(self, p: Planner, ms: list[Manifest], resident: set[BlockKey] | None) -> None:
        self.p, self.resident = p, resident
        self.size = {m.key(i, b): m.block_bytes(i, b) for m in ms for i in range(len(m))
                     for b in range(m.nblocks(i))}
        self.inflight: dict[BlockKey, Fetch] = {}
        self.pins: Counter[BlockKey] = Counter()
        self.learned: list[WorkingSetLearned] = []

    def send(self, event: Event) -> None:
        try:
            actions = self.p.handle(event)
        except (ConfigError, ValueError):
            actions = []  # refused; what it decided before comes with the next call
        self.apply(actions)

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Fetch):
                self.inflight.setdefault(a.key, a)  # a second Fetch raises the priority
                self.size.setdefault(a.key, a.size)
            elif isinstance(a, Pin):
                self.pins[a.key] += 1
            elif isinstance(a, Unpin):
                assert self.pins[a.key] > 0, f"unpin of {a.key} not pinned"
                self.pins[a.key] -= 1
            elif isinstance(a, WorkingSetLearned):
                self.learned.append(a)
        self.check()

    def check(self) -> None:
        p = self.p
        budget = p.budget
        assert set(budget.inflight) == set(self.inflight)
        assert budget.prefetch_bytes == sum(
            f.size for f in self.inflight.values() if f.reason != "demand")
        assert budget.demand_bytes == sum(
            f.size for f in self.inflight.values() if f.reason == "demand")
        assert p.prefetch_inflight_bytes == budget.prefetch_bytes
        # Pins: the ledger's total, each holder's bytes, and what the store was told.
        holders = [p.orders.pins] + [pins for ln in p.learning.learners.values()
                                     for pins in (ln.pinned, ln.endgame_pinned)]
        for h in holders:
            assert h.bytes == sum(size * h.count(key) for key, size in h.items())
        assert p.pinned_bytes == p.pins.bytes == sum(h.bytes for h in holders)
        assert p.pinned_bytes == sum(self.size[k] * n for k, n in self.pins.items())
        held = Counter({key: h.count(key) for h in holders for key, _ in h.items()})
        for h in holders[1:]:  # a learner's pins are single; only orders nest
            assert all(h.count(key) == 1 for key, _ in h.items())
        assert +self.pins == +Counter(
            {k: sum(h.count(k) for h in holders) for k in held})


steps = st.lists(st.tuples(st.integers(0, 99), st.integers(0, 10**6), st.integers(0, 10**6)),
                 max_size=150)


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(steps, st.sampled_from([2, 8, 40, 400]), st.sampled_from([1, 3, 50]), st.booleans(),
       st.booleans())
def test_ledgers_agree_with_the_actions(plan: list[tuple[int, int, int]], capacity_mib: int,
                                        inflight_mib: int, with_resident: bool,
                                        small_window: bool) -> None:
    ms = [manifest(), manifest("other")]
    m = ms[0]
    resident: set[BlockKey] | None = set() if with_resident else None
    p = Planner(capacity=capacity_mib * MiB, block_size=BS, max_inflight_bytes=inflight_mib * MiB,
                lookahead_bytes=4 * MiB, disorder_window=2 if small_window else 64,
                scan_threshold=3, idle_timeout=5.0, max_jobs=2, resident=resident)
    h = Ledgers(p, ms, resident)
    h.send(ManifestAdded("ds", m))
    now = 0.0
    for kind, x, y in plan:
        now += (x % 4) * 0.75 if kind % 3 == 0 else 0.0
        i = x % len(m)
        if kind < 40:
            size = m.sizes[i]
            off = 0 if y % 3 else y % max(1, size)
            h.send(Read("ds", m.paths[i], m.versions[i], size, off, max(1, size - off),
                        reader_id=y % 3, job=JOBS[y % 3], now=now))
        elif kind < 70 and h.inflight:
            key = sorted(h.inflight)[y % len(h.inflight)]
            del h.inflight[key]
            ok = y % 7 != 0
            if resident is not None and ok:
                resident.add(key)
            h.send(FetchDone(key, now) if ok else FetchFailed(key, now))
        elif kind < 78:
            files = [(x + 7 * j) % len(m) for j in range(y % 20)]
            ranges = [(0, max(1, m.sizes[f])) for f in files] if y % 4 == 0 else None
            h.send(OrderAnnounced("ds", JOBS[x % 3], y % 3, files, ranges, now=now))
        elif kind < 82:
            h.send(EpochBoundary("ds", JOBS[x % 3], 0, now))
        elif kind < 85:
            h.send(JobEnded("ds", JOBS[x % 3], now))
        elif kind < 87:
            h.send(CapacityChanged([1, 4, 40, 400][y % 4] * MiB, now))
        elif kind < 94:
            unpinned = sorted(k for k in (resident or ()) if not h.pins[k])
            if unpinned:  # the store evicts what nobody pins
                key = unpinned[y % len(unpinned)]
                resident.discard(key)  # type: ignore[union-attr]
                h.send(Evicted(key, now))
            elif resident is None:
                h.send(Evicted(m.key(i, 0), now))
        elif kind < 97 and h.learned:
            h.send(WorkingSetRestored(h.learned[y % len(h.learned)].working_set, now))
        else:  # a new snapshot: learners and orders of the old one stop matching reads
            m = ms[y % 2]
            h.send(ManifestAdded("ds", m))
    for ds, job in [("ds", j) for j in JOBS]:
        h.send(JobEnded(ds, job, now))
    assert p.pinned_bytes == 0 and not +h.pins  # every job ended: nothing stays pinned


def test_a_restored_working_set_is_not_idle_at_once() -> None:
    """Restored at a late clock (the spoke's loop time is the host's uptime), the set is
    not released at the next event as if nobody had read it since time zero."""
    m = manifest()
    p = Planner(capacity=400 * MiB, block_size=BS, scan_threshold=3, idle_timeout=60.0)
    p.handle(ManifestAdded("ds", m))
    ws = None
    for epoch in range(2):
        for i in range(len(m)):
            for a in p.handle(Read("ds", m.paths[i], m.versions[i], m.sizes[i], 0,
                                   max(1, m.sizes[i]), now=epoch)):
                if isinstance(a, WorkingSetLearned):
                    ws = a.working_set
    assert ws is not None
    q = Planner(capacity=400 * MiB, block_size=BS, idle_timeout=60.0)
    q.handle(ManifestAdded("ds", m))
    out = q.handle(WorkingSetRestored(ws, now=100_000.0))
    assert q.pinned_bytes > 0 and any(isinstance(a, Fetch) for a in out)
    key = next(a.key for a in out if isinstance(a, Fetch))
    out = q.handle(FetchDone(key, now=100_001.0))
    assert not any(isinstance(a, Unpin) for a in out) and q.jobs()


def test_a_refused_event_loses_no_action() -> None:
    m = manifest()
    p = Planner(capacity=400 * MiB, block_size=BS, idle_timeout=5.0)
    p.handle(ManifestAdded("ds", m))
    pinned = p.handle(OrderAnnounced("ds", "idle", 0, [0, 1, 2], now=0.0))
    assert any(isinstance(a, Pin) for a in pinned)
    # The job has gone idle: this call releases it, then refuses the event ...
    with pytest.raises(ConfigError):
        p.handle(OrderAnnounced("nope", "j", 0, [0], now=10.0))
    # ... and the next call carries the releases out.
    out = p.handle(FetchFailed(("none", 0), now=10.0))
    assert sum(isinstance(a, Unpin) for a in out) == sum(isinstance(a, Pin) for a in pinned)
    assert p.pinned_bytes == 0


def test_fetches_name_their_own_dataset() -> None:
    """A fetch another dataset's event lets out names its own dataset: here dataset a's
    fetch ends and frees the budget for b's nearer need (the driver once sent it as a's)."""
    a, b = manifest("a"), manifest("b")
    p = Planner(capacity=400 * MiB, block_size=BS, max_inflight_bytes=1)
    p.handle(ManifestAdded("a", a))
    p.handle(ManifestAdded("b", b))
    first = p.handle(OrderAnnounced("a", "j", 0, list(range(6))))
    p.handle(OrderAnnounced("b", "j", 0, list(range(6))))
    done = next(f for f in first if isinstance(f, Fetch))
    assert done.dataset == "a"
    out = p.handle(FetchDone(done.key))
    assert [(f.key, f.dataset) for f in out if isinstance(f, Fetch)] == [(b.key(0, 0), "b")]


def test_interpreter_carries_out_actions_through_its_callbacks() -> None:
    class Cache(set):
        pinned: Counter = Counter()

        def pin(self, key: BlockKey) -> None:
            self.pinned[key] += 1

        def unpin(self, key: BlockKey) -> None:
            self.pinned[key] -= 1

        def set_future(self, keys, stream: str, append: bool = False) -> None:
            self.future = (list(keys), stream, append)

    m = manifest()
    cache = Cache()
    p = Planner(capacity=400 * MiB, block_size=BS, resident=cache)
    fetched: list[tuple[str, BlockKey]] = []
    later: list = []
    it = Interpreter(p, cache, lambda ds, a: fetched.append((ds, a.key)), lambda k: False,
                     later.append, lambda: 0.0)
    it.handle(ManifestAdded("ds", m))
    it.handle(OrderAnnounced("ds", "j", 0, [0, 1]))
    keys = [m.key(i, b) for i in (0, 1) for b in range(m.nblocks(i))]
    assert cache.future == (keys, "ds/j", False)
    assert {k for k, n in cache.pinned.items() if n} == set(keys)
    assert fetched == [("ds", k) for k in keys]
    # A Fetch of a block already resident is answered FetchDone, later (never re-entering).
    cache.add(("x", 0))
    it.act([Fetch(("x", 0), 1, 5, "order", "ds")])
    assert len(later) == 1 and ("x", 0) not in it.fetching
    for ds_key in fetched:
        it.finished(ds_key[1], True)
    assert p.prefetch_inflight_bytes == 0
    later.pop()()


def test_the_planner_view_of_a_snapshot_shares_its_lists() -> None:
    paths = ["a/x", "a/y", "b"]
    snap = Snapshot(dataset="ds", snapshot="0123456789ab", created=0.0, block_size=BS,
                    paths=paths, sizes=[0, BS + 1, 10], modes=[0o644] * 3, mtimes=[0] * 3,
                    versions=[f"{i:032x}" for i in range(3)], dirs=["", "a"])
    view = Manifest.of(snap)
    built = Manifest(snap.paths, snap.versions, snap.sizes, snap.block_size)
    assert view.paths is snap.paths and view.versions is snap.versions
    assert list(view.sizes) == list(built.sizes) and view.total_bytes == built.total_bytes
    assert [view.nblocks(i) for i in range(3)] == [0, 2, 1]
