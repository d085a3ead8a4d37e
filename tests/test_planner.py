"""The planner against in-memory fakes: no sockets, no clock, no store."""

from __future__ import annotations

import random
import time
from array import array
from collections import Counter

import pytest

from spokefs.errors import BadRequest, ConfigError
from spokefs.integrity import block_count
from spokefs.planner import (
    DEMAND,
    WORKING_SET_PRIORITY,
    Action,
    CapacityChanged,
    Event,
    Fetch,
    FetchDone,
    JobEnded,
    Manifest,
    ManifestAdded,
    OrderAnnounced,
    Pin,
    Planner,
    Read,
    SetFuture,
    Unpin,
    WorkingSet,
    WorkingSetLearned,
    WorkingSetRestored,
)
from spokefs.planner.order import MAX_ORDER_ENTRIES, OrderTooLarge
from spokefs.policy import BlockKey

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BS = 4 * MiB


class Harness:
    """A planner with a pretend store: fetches complete when told, pins are counted."""

    def __init__(self, manifest: Manifest, **options: object) -> None:
        options.setdefault("capacity", 10 * GiB)
        self.p = Planner(block_size=manifest.block_size, **options)  # type: ignore[arg-type]
        self.m = manifest
        self.p.handle(ManifestAdded("ds", manifest))
        self.actions: list[Action] = []
        self.inflight: dict[BlockKey, Fetch] = {}
        self.fetched: Counter[BlockKey] = Counter()
        self.pins: Counter[BlockKey] = Counter()
        self.max_prefetch_inflight = 0

    def apply(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            if isinstance(a, Fetch) and a.key not in self.inflight:
                self.inflight[a.key] = a
                self.fetched[a.key] += 1
            elif isinstance(a, Pin):
                self.pins[a.key] += 1
            elif isinstance(a, Unpin):
                assert self.pins[a.key] > 0, f"unpin of {a.key} never pinned"
                self.pins[a.key] -= 1
        prefetch = sum(f.size for f in self.inflight.values() if f.reason != "demand")
        self.max_prefetch_inflight = max(self.max_prefetch_inflight, prefetch)
        self.actions += actions
        return actions

    def send(self, event: Event) -> list[Action]:
        return self.apply(self.p.handle(event))

    def read(self, i: int, offset: int = 0, length: int | None = None, **kw: object):
        m = self.m
        n = m.sizes[i] if length is None else length
        ev = Read("ds", m.paths[i], m.versions[i], m.sizes[i], offset, n, **kw)  # type: ignore[arg-type]
        out = self.send(ev)
        self.complete(demand_only=True)
        return out

    def complete(self, demand_only: bool = False, limit: int | None = None) -> None:
        """Finish fetches (the demand ones, or everything until the planner stops asking)."""
        done = 0
        while self.inflight and (limit is None or done < limit):
            keys = [k for k, f in self.inflight.items() if f.reason == "demand" or not demand_only]
            if not keys:
                return
            key = keys[0]
            del self.inflight[key]
            self.send(FetchDone(key))
            done += 1

    def fetches(self, reason: str | None = None) -> list[Fetch]:
        return [a for a in self.actions if isinstance(a, Fetch) and reason in (None, a.reason)]


def tree(dirs: dict[str, int], size: int = 100 * KiB) -> Manifest:
    entries = [(f"{d}/{j:05d}.jpg", f"v-{d}-{j}", size) for d, n in dirs.items() for j in range(n)]
    return Manifest.from_entries(entries, BS)


# -- manifest ---------------------------------------------------------------------------------


def test_manifest_subtree_and_blocks() -> None:
    m = Manifest.from_entries(
        [("a/b/x", "1", 10), ("a/b.txt", "2", 5), ("a/b/y", "3", 9 * MiB), ("c", "4", 0)], BS
    )
    assert m.paths == ["a/b.txt", "a/b/x", "a/b/y", "c"]
    sub = m.subtree("a/b/")
    assert [m.paths[i] for i in sub] == ["a/b/x", "a/b/y"]
    assert m.bytes_in(sub) == 10 + 9 * MiB
    assert m.index("a/b/y") == 2 and m.index("nope") is None
    assert m.nblocks(2) == 3 and m.block_bytes(2, 2) == MiB
    assert m.nblocks(3) == 0 and m.blocks_of(3) == range(0)  # an empty file has no block
    assert m.blocks_of(2, 4 * MiB - 1, 2) == range(0, 2)
    with pytest.raises(ConfigError):
        Manifest(["b", "a"], ["1", "2"], [1, 1])


@pytest.mark.parametrize("files", [[0, 1, 2], [0, 1, 2, 3]])  # without, with a 2-block file
def test_an_empty_file_has_no_block_for_the_planner_either(files: list[int]) -> None:
    """The planner cuts files as the hub and the spoke's warm-up do (integrity.block_count:
    an empty file has none). With a block of its own for an empty file, an order pinned a key
    no upstream serves and no store holds, at a position no read of the file consumed."""
    m = Manifest.from_entries(
        [("a-empty", "v0", 0), ("b", "v1", 100 * KiB), ("c-empty", "v2", 0), ("d", "v3", 5 * MiB)],
        BS)
    assert [m.nblocks(i) for i in range(4)] == [block_count(s, BS) for s in m.sizes]
    h = Harness(m, max_inflight_bytes=1 * GiB)
    out = h.send(OrderAnnounced("ds", "j", 0, files))
    future = next(a for a in out if isinstance(a, SetFuture))
    assert list(future.keys) == [(m.versions[f], b) for f in files for b in range(m.nblocks(f))]
    assert not [k for k in h.pins if k[0] in ("v0", "v2")]
    h.complete()
    for f in files:
        h.read(f, job="j")
    assert h.p.order_position("ds", "j") == len(future.keys)  # every position consumed


# -- readahead --------------------------------------------------------------------------------


def test_readahead_window_grows_then_caps() -> None:
    m = Manifest.from_entries([("big.bin", "v", 1 * GiB)], BS)
    h = Harness(m, readahead_max_bytes=32 * MiB, max_inflight_bytes=1 * GiB, learn=False)
    windows = []
    for off in range(0, 200 * MiB, 1 * MiB):
        h.read(0, off, MiB, reader_id="w0")
        windows.append(h.p.readahead_window("ds", "big.bin", "w0"))
        ahead = [f.key[1] * BS for f in h.fetches("readahead")]
        # Never more than the cap beyond what the reader has reached (block granularity).
        assert max(ahead, default=0) < off + MiB + 32 * MiB + BS
        h.complete()
    assert windows[0] == BS  # a read from the start speculates one block
    assert windows == sorted(windows)  # only grows while sequential
    assert max(windows) == 32 * MiB
    assert windows.index(32 * MiB) <= 16  # doubling: reached within a few blocks
    # Everything ahead was asked for once; the reader never waited after the first block.
    assert max(Counter(f.key for f in h.fetches()).values()) == 1
    assert len(h.fetches("demand")) == 1


def test_readahead_resets_on_seek() -> None:
    m = Manifest.from_entries([("big.bin", "v", 1 * GiB)], BS)
    h = Harness(m, readahead_max_bytes=32 * MiB, learn=False)
    for off in range(0, 40 * MiB, MiB):
        h.read(0, off, MiB)
    assert h.p.readahead_window("ds", "big.bin") > BS
    h.read(0, 700 * MiB, MiB)
    assert h.p.readahead_window("ds", "big.bin") == 0
    n = len(h.fetches())
    h.read(0, 300 * MiB, 64 * KiB)  # random reads fetch just what they touch
    assert [f.reason for f in h.fetches()[n:]] == ["demand"]


# -- working-set learning ---------------------------------------------------------------------


def scan_tree() -> Manifest:
    return tree({"train/c0": 60, "train/c1": 60, "train/c2": 60, "val": 40})


def test_scan_detection_prefetches_the_unread_rest_once() -> None:
    m = scan_tree()
    h = Harness(m, scan_threshold=12, max_inflight_bytes=2 * MiB)
    train = list(m.subtree("train/"))
    rng = random.Random(5)
    order = rng.sample(train, len(train))
    for n, i in enumerate(order[:12]):
        assert h.fetches("working-set") == [], "no prediction before the threshold"
        h.read(i)
        if n < 11:
            assert h.p.stats["scans_detected"] == 0
    assert h.p.stats["scans_detected"] == 1
    h.complete()  # let the background fill run to the end, budget permitting
    ws = [f.key for f in h.fetches("working-set")]
    expected = {m.key(i, 0) for i in order[12:]}
    assert set(ws) == expected  # exactly the unread rest of train/, nothing from val/
    assert len(ws) == len(expected)  # once each
    assert all(f.priority >= WORKING_SET_PRIORITY for f in h.fetches("working-set"))
    assert h.max_prefetch_inflight <= 2 * MiB
    # The reader finds everything resident: no more demand fetches this epoch.
    before = len(h.fetches("demand"))
    for i in order[12:]:
        h.read(i)
    assert len(h.fetches("demand")) == before


def test_demand_jumps_the_background_fill() -> None:
    m = scan_tree()
    h = Harness(m, scan_threshold=8, max_inflight_bytes=200 * KiB)
    train = list(m.subtree("train/"))
    for i in train[::7][:8]:
        h.read(i)
    assert h.inflight, "a prefetch is outstanding"
    waiting = next(i for i in train if m.key(i, 0) not in h.inflight and i % 7)
    out = h.send(Read("ds", m.paths[waiting], m.versions[waiting], m.sizes[waiting], 0, 10))
    fetches = [a for a in out if isinstance(a, Fetch)]
    assert fetches[0].key == m.key(waiting, 0) and fetches[0].priority == DEMAND
    # The budget held back further prefetches: only the demand went out.
    assert all(f.reason == "demand" for f in fetches)


def test_scan_ignores_random_rereads() -> None:
    m = scan_tree()
    h = Harness(m, scan_threshold=12)
    hot = list(m.subtree("train/"))[:5]
    for _ in range(20):
        for i in hot:
            h.read(i)
    assert h.p.stats["scans_detected"] == 0
    assert h.fetches("working-set") == []


def test_next_epoch_is_recognised_and_learned_set_restores() -> None:
    m = scan_tree()
    h = Harness(m, scan_threshold=12)
    train = list(m.subtree("train/c1/")) + list(m.subtree("train/c2/"))
    rng = random.Random(1)
    epoch1 = rng.sample(train, len(train))
    for i in epoch1:
        h.read(i)
    h.complete()
    for i in epoch1[:3]:  # epoch 2 begins
        h.read(i)
    learned = [a for a in h.actions if isinstance(a, WorkingSetLearned)]
    assert len(learned) == 1
    ws = learned[0].working_set
    assert ws == h.p.working_set("ds")
    assert ws.files == len(train) and ws.prefix == "train/"
    assert ws.ranges == [(m.paths[train[0]], m.paths[train[-1]])]
    # A new planner (the job restarts) fills the set before the first read.
    h2 = Harness(m, max_inflight_bytes=1 * GiB)
    h2.apply(h2.p.handle(WorkingSetRestored(WorkingSet.from_json(ws.to_json()))))
    assert {f.key for f in h2.fetches("working-set")} == {m.key(i, 0) for i in train}


def test_working_set_larger_than_cache_keeps_a_fixed_part() -> None:
    m = scan_tree()
    capacity = 100 * 100 * KiB  # 100 of the 180 train files
    h = Harness(m, scan_threshold=12, capacity=capacity, reserve_bytes=10 * 100 * KiB)
    train = list(m.subtree("train/"))
    rng = random.Random(2)
    for _ in range(3):
        for i in rng.sample(train, len(train)):
            h.read(i)
            h.complete()
            assert h.p.pinned_bytes <= capacity
            pinned = sum(1 for n in h.pins.values() if n)
            assert pinned <= 100
    kept = {k for k, n in h.pins.items() if n}
    assert 80 <= len(kept) <= 90  # capacity minus the reserve
    # Every later epoch re-reads the kept part without fetching it again.
    assert all(h.fetched[k] == 1 for k in kept)


def test_a_job_starting_beside_a_scan_gets_room_without_taking_any_back() -> None:
    """A second job reading (its scan not recognised yet) holds back an equal share, so the
    first job's fill never overshoots what it keeps once the second is recognised: nothing
    fetched for it is unpinned and fetched again (bench contention's cold phase)."""
    m = scan_tree()
    file = 100 * KiB
    capacity = 120 * file
    h = Harness(m, scan_threshold=12, capacity=capacity, reserve_bytes=10 * file)
    train, val = list(m.subtree("train/")), list(m.subtree("val/"))
    rng = random.Random(3)
    b_order, a_order = rng.sample(train, len(train)), rng.sample(val, len(val))
    h.read(a_order[0], job="a")                 # A has begun, not yet a scan
    for i in b_order[:12]:
        h.read(i, job="b")                      # B's scan is recognised first
    h.complete()
    b_keys = {m.key(i, 0) for i in train}
    b_pinned = {k for k, n in h.pins.items() if n and k in b_keys}
    assert len(b_pinned) * file <= (capacity - 10 * file) // 2  # half: A's share held back
    unpins_before = sum(1 for a in h.actions if isinstance(a, Unpin) and a.key in b_keys)
    for i in a_order[1:13]:
        h.read(i, job="a")                      # A recognised: 40 files, less than its half
    h.complete()
    assert h.p.stats["scans_detected"] == 2
    assert sum(1 for a in h.actions if isinstance(a, Unpin) and a.key in b_keys) == (
        unpins_before)                          # B gave nothing back ...
    b_now = {k for k, n in h.pins.items() if n and k in b_keys}
    assert b_now > b_pinned                     # ... and grew into what A does not need
    assert all(h.fetched[k] == 1 for k in h.fetched)
    assert h.p.pinned_bytes <= capacity


def test_a_reader_that_is_no_scan_stops_holding_a_share() -> None:
    m = scan_tree()
    file = 100 * KiB
    capacity = 120 * file
    h = Harness(m, scan_threshold=12, capacity=capacity, reserve_bytes=10 * file)
    train, val = list(m.subtree("train/")), list(m.subtree("val/"))
    h.read(val[0], job="a")
    for i in random.Random(4).sample(train, 12):  # B: a scan of all of train/
        h.read(i, job="b")
    h.complete()
    held = sum(1 for n in h.pins.values() if n)
    assert held * file <= (capacity - 10 * file) // 2
    hot = val[:3]
    for _ in range(40):                         # A re-reads a few files: not a scan
        for i in hot:
            h.read(i, job="a")
    h.complete()
    b_keys = {m.key(i, 0) for i in train}
    assert sum(1 for k, n in h.pins.items() if n and k in b_keys) > held


def test_job_end_releases_pins() -> None:
    m = scan_tree()
    h = Harness(m, scan_threshold=8)
    for i in list(m.subtree("train/"))[:20]:
        h.read(i, job="j")
    h.complete()
    assert sum(h.pins.values()) > 0
    h.send(JobEnded("ds", "j"))
    assert sum(h.pins.values()) == 0 and h.p.pinned_bytes == 0


# -- announced order --------------------------------------------------------------------------


def test_order_fetches_exactly_ahead_within_budget() -> None:
    m = tree({"d": 500})
    look = 20 * 100 * KiB
    h = Harness(m, lookahead_bytes=look, max_inflight_bytes=1 * GiB, disorder_window=8)
    order = random.Random(3).sample(range(len(m)), len(m))
    h.send(OrderAnnounced("ds", "job", 0, array("l", order)))
    fut = [a for a in h.actions if isinstance(a, SetFuture)]
    assert list(fut[0].keys) == [m.key(i, 0) for i in order]
    assert [f.key for f in h.fetches("order")] == [m.key(i, 0) for i in order[:20]]
    h.complete()
    for n, i in enumerate(order):
        h.read(i, job="job")
        h.complete()
        assert h.p.order_position("ds", "job") == n + 1
        ahead = {m.key(j, 0) for j in order[n + 1 : n + 21]}
        outstanding = {k for k, c in h.pins.items() if c}
        assert outstanding <= ahead  # pinned: only what lies ahead, within the budget
        assert h.p.pinned_bytes <= look
    assert len(h.fetches("demand")) == 0  # fetched ahead: the reader never waited
    assert [f.key for f in h.fetches("order")] == [m.key(i, 0) for i in order]
    assert sum(h.pins.values()) == 0


def test_order_tolerates_multi_worker_disorder() -> None:
    m = tree({"d": 400})
    h = Harness(m, lookahead_bytes=40 * 100 * KiB, disorder_window=16)
    order = list(range(len(m)))
    random.Random(4).shuffle(order)
    h.send(OrderAnnounced("ds", "", 0, order))
    h.complete()
    rng = random.Random(9)
    reads = []
    for base in range(0, len(order), 8):  # 8 workers, each a little out of step
        batch = order[base : base + 8]
        rng.shuffle(batch)
        reads += batch
    for w, i in enumerate(reads):
        h.read(i, reader_id=w % 8)
        h.complete()
    assert h.p.order_position("ds", "") == len(order)
    assert len(h.fetches("demand")) == 0
    assert len(h.fetches("order")) == len(order)
    assert sum(h.pins.values()) == 0


def test_order_keeps_what_slow_loader_workers_will_read() -> None:
    """A DataLoader's 12 workers each read a batch of 256 of the order at once (reads spread
    over 3,072 positions) while prefetches arrive a few at a time: the far workers' reads
    must not make the near workers' positions count as read, which would drop their queued
    prefetches and turn those reads into demand misses (the planner's default window)."""
    m = tree({"d": 6144})
    h = Harness(m, lookahead_bytes=1 * GiB, max_inflight_bytes=16 * MiB)
    order = list(range(len(m)))
    random.Random(5).shuffle(order)
    h.send(OrderAnnounced("ds", "", 0, order))
    h.complete(limit=48)
    workers, batch = 12, 256
    batches = [order[b : b + batch] for b in range(0, len(order), batch)]
    for group in range(0, len(batches), workers):  # each worker a batch, in step
        mine = batches[group : group + workers]
        for step in range(batch):
            for w in mine:
                h.read(w[step])
            h.complete(limit=48)  # prefetches arrive at 4x the read rate
    h.complete()
    assert h.p.order_position("ds", "") == len(order)
    # Measured with this schedule: 326 with the window at 16,384, 1,653 at 1,024.
    assert len(h.fetches("demand")) < 600


def test_order_with_shard_ranges_and_next_epoch() -> None:
    m = Manifest.from_entries([(f"shard-{s}.tar", f"v{s}", 16 * MiB) for s in range(4)], BS)
    h = Harness(m, lookahead_bytes=24 * MiB, max_inflight_bytes=1 * GiB)
    samples = [(s, off) for s in range(4) for off in range(0, 16 * MiB, 2 * MiB)]
    rng = random.Random(0)
    shards = rng.sample(range(4), 4)
    epoch0 = [(s, off) for s in shards for off in range(0, 16 * MiB, 2 * MiB)]
    h.send(OrderAnnounced("ds", "j", 0, [s for s, _ in epoch0], [(o, 2 * MiB) for _, o in epoch0]))
    h.complete()
    assert len(samples) == len(epoch0)
    for s, off in epoch0:
        h.read(s, off, 2 * MiB, job="j")
        h.complete()
    h.send(OrderAnnounced("ds", "j", 1, [s for s, _ in epoch0], [(o, 2 * MiB) for _, o in epoch0]))
    assert h.p.order_position("ds", "j") == 16  # 4 shards x 4 blocks, continuing
    assert len(h.fetches("demand")) == 0


def test_epoch_after_epoch_holds_two_epochs_not_all_of_them() -> None:
    """A job announcing epoch 0, 1, 2, ... without reading (or reading slowly) holds the
    latest epoch and the one before it: older ones go, with their pins and their futures."""
    m = tree({"train": 100})
    h = Harness(m, lookahead_bytes=2 * MiB)
    order = list(range(100))
    for epoch in range(40):
        h.send(OrderAnnounced("ds", "j", epoch, order))
        cur = h.p.orders.cursors[("ds", "j")]
        assert len(cur) <= 2 * len(order)
        held = sum(1 for n in h.pins.values() if n)
        assert sum(h.pins.values()) <= len(order) and held <= len(order)
    futures = [a for a in h.actions if isinstance(a, SetFuture)]
    resets = [a for a in futures if not a.append]
    assert resets and all(len(a.keys) <= 2 * len(order) for a in futures)
    assert h.p.orders.status()[("ds", "j")]["positions"] == 40 * len(order)
    # The reader, arriving late, still runs along the order it holds: epoch 38's positions.
    for i in order[:10]:
        h.read(i, job="j")
    assert h.p.order_position("ds", "j") == 10


# Timing: a bound on the planner's CPU cost, which no fake clock can stand in for. CPU time
# (process_time), not wall time: other processes on a loaded machine do not count.
@pytest.mark.timing
def test_million_entry_announcement_is_fast() -> None:
    n = 1_000_000
    paths = [f"train/{i:07d}.jpg" for i in range(n)]
    versions = [f"{i:032x}" for i in range(n)]
    m = Manifest(paths, versions, array("q", [110 * KiB]) * n, BS)
    p = Planner(capacity=64 * GiB, block_size=BS, lookahead_bytes=256 * MiB)
    p.handle(ManifestAdded("ds", m))
    order = array("l", range(n))
    random.Random(0).shuffle(order)  # type: ignore[arg-type]
    t = time.process_time()
    actions = p.handle(OrderAnnounced("ds", "j", 0, order))
    elapsed = time.process_time() - t
    assert elapsed < 3.0, f"announcing 1M entries took {elapsed:.2f} CPU-s"  # measured ~0.6
    assert isinstance(actions[0], SetFuture) and len(actions[0].keys) == n
    assert sum(1 for a in actions if isinstance(a, Fetch)) > 0


def test_order_ranges_are_checked_and_clipped() -> None:
    m = Manifest.from_entries([(f"shard-{s}.tar", f"v{s}", 16 * MiB) for s in range(2)]
                              + [("empty", "ve", 0)], BS)
    s0, s1, empty = (m.index(p) for p in ("shard-0.tar", "shard-1.tar", "empty"))
    h = Harness(m, lookahead_bytes=64 * MiB)
    for ranges in ([(0, True)], [(0, 1.5)], [(-1, 10)], [(16 * MiB, 1)], [(0, 0)],
                   [(-(10**15), 10**15 + 1)], [("0", 1)], [(0, 1, 2)], "0-1", [(0, 1)] * 2):
        with pytest.raises(BadRequest):
            h.send(OrderAnnounced("ds", "j", 0, [s0], ranges))  # type: ignore[arg-type]
    assert h.p.pinned_bytes == 0 and not h.fetches("order")
    # A huge length is the rest of the file (its cost: test_huge_order_ranges_are_cheap).
    h.send(OrderAnnounced("ds", "j", 1, [s0, s1, empty] * 10_000,
                          [(MiB, 10**15), (0, 2**80), (0, 10**15)] * 10_000))
    fetched = {f.key for f in h.fetches("order")}
    assert fetched and fetched <= {m.key(i, b) for i in (s0, s1) for b in range(4)}
    h.read(s0, 0, MiB, job="j")  # reads go on as usual
    assert h.p.order_position("ds", "j") is not None
    with pytest.raises(OrderTooLarge):
        h.send(OrderAnnounced("ds", "k", 0, array("l", [empty]) * (MAX_ORDER_ENTRIES + 1)))


# Timing: a bound on the planner's CPU cost (process_time: other processes do not count).
@pytest.mark.timing
def test_huge_order_ranges_are_cheap() -> None:
    m = Manifest.from_entries([(f"shard-{s}.tar", f"v{s}", 16 * MiB) for s in range(2)]
                              + [("empty", "ve", 0)], BS)
    files = [m.index(p) for p in ("shard-0.tar", "shard-1.tar", "empty")]
    h = Harness(m, lookahead_bytes=64 * MiB)
    t = time.process_time()  # a huge length is the rest of the file, however many entries
    h.send(OrderAnnounced("ds", "j", 0, files * 10_000,
                          [(MiB, 10**15), (0, 2**80), (0, 10**15)] * 10_000))
    elapsed = time.process_time() - t
    assert elapsed < 3.0, f"{elapsed:.2f} CPU-s"  # measured ~0.1; per block: never
    assert h.p.order_position("ds", "j") is not None


# -- misc ---------------------------------------------------------------------------------


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError):
        Planner(capacity=0)
    p = Planner(capacity=GiB)
    with pytest.raises(ConfigError):
        p.handle(CapacityChanged(-1))
    with pytest.raises(ConfigError):
        p.handle(OrderAnnounced("nope", "j", 0, [0]))
    with pytest.raises(TypeError):
        p.handle("read")  # type: ignore[arg-type]
    p.handle(ManifestAdded("ds", tree({"d": 3})))
    with pytest.raises(ConfigError):
        p.handle(OrderAnnounced("ds", "j", 0, ["d/nope.jpg"]))


def test_unknown_files_still_get_demand_and_readahead() -> None:
    p = Planner(capacity=GiB, block_size=BS)
    out = p.handle(Read("ds", "x.bin", "vx", 64 * MiB, 0, MiB))
    assert [(type(a).__name__, a.key) for a in out if isinstance(a, Fetch)] == [
        ("Fetch", ("vx", 0)),
        ("Fetch", ("vx", 1)),
    ]
