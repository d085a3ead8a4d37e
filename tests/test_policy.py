"""Eviction policies: one suite over the registry, then what each policy adds."""

from __future__ import annotations

import random

import pytest

from spokefs.errors import ConfigError
from spokefs.policy import (
    POLICIES,
    BlockKey,
    CopiesFirst,
    EvictionPolicy,
    Share,
    Shares,
    make_policy,
)

MiB = 1 << 20


def k(i: int, version: str = "v") -> BlockKey:
    return (version, i)


@pytest.fixture(params=sorted(POLICIES) + [f"{name}/{where}" for name in sorted(POLICIES)
                                            for where in ("reserved", "shared")])
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    """Every policy, alone and under ``Shares``: the keys' dataset (``k()``'s "v") with a
    reservation of its own (a class; nothing else to take, so it gives its own), or none
    (the shared instance, beside another dataset's empty reservation)."""
    name, _, where = request.param.partition("/")
    if not where:
        return make_policy(name)
    reserved = "v" if where == "reserved" else "other"
    return Shares(make_policy(name), dataset_of=lambda key: key[0], clock=lambda: 0.0,
                  shares={reserved: Share(min_bytes=1 << 40)})


def fill(policy: EvictionPolicy, n: int, size: int = MiB) -> None:
    for i in range(n):
        policy.insert(k(i), size)


def drain(policy: EvictionPolicy) -> list[BlockKey]:
    """Evict everything the way the store does; returns the victims in order."""
    out = []
    while (key := policy.victim()) is not None:
        assert key in policy
        out.append(key)
        policy.remove(key)
    return out


# -- the shared contract ------------------------------------------------------------------


def test_registry_and_protocol(policy: EvictionPolicy) -> None:
    assert isinstance(policy, EvictionPolicy)
    assert POLICIES[policy.name] is type(getattr(policy, "shared", policy))


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as exc:
        make_policy("nope")
    for name in POLICIES:
        assert name in str(exc.value)


def test_empty(policy: EvictionPolicy) -> None:
    assert len(policy) == 0
    assert policy.victim() is None
    assert k(1) not in policy
    assert "not a key" not in policy
    policy.remove(k(1))  # unknown: no-op
    policy.access(k(1))  # unknown: no-op
    policy.unpin(k(1))  # not pinned: no-op
    assert len(policy) == 0


def test_insert_contains_len(policy: EvictionPolicy) -> None:
    fill(policy, 5)
    assert len(policy) == 5
    assert all(k(i) in policy for i in range(5))
    policy.insert(k(2), 2 * MiB)  # re-insert: still one entry
    assert len(policy) == 5


def test_victim_is_stable_and_resident(policy: EvictionPolicy) -> None:
    fill(policy, 10)
    v = policy.victim()
    assert v is not None and v in policy
    assert policy.victim() == v  # no change in between: same answer
    assert len(policy) == 10  # victim() does not remove


def test_remove_is_idempotent(policy: EvictionPolicy) -> None:
    fill(policy, 3)
    policy.remove(k(1))
    policy.remove(k(1))
    assert len(policy) == 2 and k(1) not in policy
    assert sorted(drain(policy)) == [k(0), k(2)]
    assert len(policy) == 0


def test_drain_evicts_each_block_once(policy: EvictionPolicy) -> None:
    fill(policy, 50)
    for i in range(0, 50, 3):
        policy.access(k(i))
    victims = drain(policy)
    assert sorted(victims) == [k(i) for i in range(50)]


def test_pinned_never_victim(policy: EvictionPolicy) -> None:
    fill(policy, 4)
    for i in range(4):
        policy.pin(k(i))
    assert policy.victim() is None
    policy.unpin(k(2))
    assert policy.victim() == k(2)


def test_pin_before_arrival_is_remembered(policy: EvictionPolicy) -> None:
    policy.pin(k(7))
    policy.insert(k(7), MiB)
    policy.insert(k(8), MiB)
    assert drain(policy) == [k(8)]
    assert k(7) in policy
    policy.unpin(k(7))
    assert drain(policy) == [k(7)]


def test_pins_nest(policy: EvictionPolicy) -> None:
    fill(policy, 1)
    policy.pin(k(0))
    policy.pin(k(0))
    policy.unpin(k(0))
    assert policy.victim() is None
    policy.unpin(k(0))
    assert policy.victim() == k(0)


def test_remove_keeps_pin(policy: EvictionPolicy) -> None:
    # A corrupt pinned block is dropped and fetched again: it must come back pinned.
    fill(policy, 2)
    policy.pin(k(0))
    policy.remove(k(0))
    assert k(0) not in policy
    policy.insert(k(0), MiB)
    assert drain(policy) == [k(1)]


def test_access_of_pinned_and_unknown_is_harmless(policy: EvictionPolicy) -> None:
    fill(policy, 3)
    policy.pin(k(1))
    policy.access(k(1))
    policy.access(k(99))
    assert k(1) not in drain(policy)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_capacity_simulation(policy: EvictionPolicy, seed: int) -> None:
    """Random reads, pins and purges through a store model: capacity holds, victims valid."""
    rng = random.Random(seed)
    capacity = 40 * MiB
    sizes = {i: rng.choice([MiB // 4, MiB, 2 * MiB, 4 * MiB]) for i in range(200)}
    resident: dict[BlockKey, int] = {}
    pinned: dict[BlockKey, int] = {}
    used = 0
    hits = 0
    for _ in range(5000):
        i = int(rng.paretovariate(1.2)) % 200 if rng.random() < 0.7 else rng.randrange(200)
        key = k(i)
        op = rng.random()
        if op < 0.05:
            policy.pin(key)
            pinned[key] = pinned.get(key, 0) + 1
            continue
        if op < 0.10 and pinned:
            pkey = rng.choice(sorted(pinned))
            policy.unpin(pkey)
            pinned[pkey] -= 1
            if not pinned[pkey]:
                del pinned[pkey]
            continue
        if op < 0.12 and key in resident:  # purge / corrupt
            used -= resident.pop(key)
            policy.remove(key)
            policy.remove(key)
            continue
        if key in resident:
            hits += 1
            policy.access(key)
            continue
        size = sizes[i]
        admitted = True
        while used + size > capacity:
            v = policy.victim()
            if v is None:
                admitted = False
                break
            assert v in resident, "victim must be resident"
            assert v not in pinned, "victim must be unpinned"
            used -= resident.pop(v)
            policy.remove(v)
        if admitted:
            resident[key] = size
            used += size
            policy.insert(key, size)
            policy.access(key)
        assert used <= capacity
        assert len(policy) == len(resident)
    assert all(key in policy for key in resident)
    assert hits > 0


def test_many_pins_keep_victim_cheap(policy: EvictionPolicy) -> None:
    fill(policy, 20_000, size=1)
    for i in range(19_999):
        policy.pin(k(i))
    for _ in range(20_000):  # would be quadratic if victim() walked past pinned keys
        assert policy.victim() == k(19_999)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_takes_the_store_capacity_the_same_way(name: str) -> None:
    """The spoke builds any policy as ``make_policy(name, capacity=...)``, never asking the
    class what it takes; a bad capacity is a clear error whichever policy is named."""
    p = make_policy(name, capacity=64 * MiB)
    assert isinstance(p, POLICIES[name]) and p.name == name
    assert POLICIES[name](capacity=64 * MiB).name == name  # type: ignore[call-arg]
    assert make_policy(name).victim() is None  # capacity unknown: still a policy
    with pytest.raises(ConfigError, match="capacity"):
        make_policy(name, capacity=-1)


def test_a_plain_policy_keeps_no_copies(policy: EvictionPolicy) -> None:
    """What the store asks of every policy about a tier member's copies, answered by a
    policy that keeps none: no copy to evict, a copy inserted is an ordinary block."""
    assert not policy.keeps_copies and policy.copy_bytes == 0
    fill(policy, 2)
    policy.insert_copy(k(5), MiB)
    assert k(5) in policy and policy.copy_bytes == 0 and policy.copy_victim() is None
    assert policy.reclassify(policy.resident_keys(), lambda key: True) == 0
    assert sorted(drain(policy)) == [k(0), k(1), k(5)]


# -- lru ------------------------------------------------------------------------------------


def test_lru_order() -> None:
    p = make_policy("lru")
    fill(p, 4)
    p.access(k(0))
    p.access(k(2))
    assert drain(p) == [k(1), k(3), k(0), k(2)]


def test_lru_unpinned_comes_back_as_fresh() -> None:
    p = make_policy("lru")
    fill(p, 3)
    p.pin(k(0))
    p.unpin(k(0))
    assert drain(p) == [k(1), k(2), k(0)]


# -- s3fifo ---------------------------------------------------------------------------------


def run_store(policy: EvictionPolicy, trace: list[BlockKey], capacity: int, size: int = MiB):
    """Replay reads through a store of ``capacity`` bytes; returns the missed reads."""
    used = 0
    misses = []
    for key in trace:
        if key not in policy:
            misses.append(key)
            while used + size > capacity:
                v = policy.victim()
                assert v is not None
                policy.remove(v)
                used -= size
            policy.insert(key, size)
            used += size
        policy.access(key)
    return misses


@pytest.mark.parametrize("name", ["s3fifo", "lru"])
def test_one_time_scan(name: str) -> None:
    """A hot set read again and again survives a long one-time scan under s3fifo only."""
    p = make_policy(name, capacity=100 * MiB) if name == "s3fifo" else make_policy(name)
    hot = [k(i, "hot") for i in range(50)]
    run_store(p, hot * 4, 100 * MiB)
    scan = [k(i, "scan") for i in range(1000)]
    misses = run_store(p, scan + hot, 100 * MiB)
    hot_misses = [key for key in misses if key[0] == "hot"]
    if name == "s3fifo":
        assert hot_misses == []
    else:
        assert len(hot_misses) == 50


def test_s3fifo_ghost_readmits_to_main() -> None:
    p = make_policy("s3fifo", capacity=10 * MiB)
    run_store(p, [k(i) for i in range(20)], 10 * MiB)  # k(0..9) evicted from small: ghosts
    assert k(0) not in p
    run_store(p, [k(0)], 10 * MiB)
    run_store(p, [k(i, "new") for i in range(9)], 10 * MiB)  # floods the small queue
    assert k(0) in p  # came back through the ghost set into main


def test_s3fifo_rejects_bad_options() -> None:
    with pytest.raises(ConfigError):
        make_policy("s3fifo", small_ratio=1.5)
    with pytest.raises(ConfigError):
        make_policy("s3fifo", capacity=0)
    with pytest.raises(ConfigError):
        make_policy("s3fifo", bogus=1)


# -- belady ---------------------------------------------------------------------------------

# The textbook reference string: with 3 frames OPT faults 7 times, LRU 10 times.
TEXTBOOK = [k(i) for i in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]


def test_belady_is_optimal_on_the_textbook_trace() -> None:
    p = make_policy("belady")
    p.set_future(TEXTBOOK)
    misses = run_store(p, TEXTBOOK, 3 * MiB)
    # Hand-checked: 1 2 3 miss; 4 evicts 3 (next use farthest); 1 2 hit; 5 evicts 4... ; 1 2
    # hit; 3 evicts 1 or 2 (never used again); 4 evicts the other; 5 hits.
    assert len(misses) == 7
    assert misses[:5] == [k(1), k(2), k(3), k(4), k(5)]
    assert len(run_store(make_policy("lru"), TEXTBOOK, 3 * MiB)) == 10


def test_belady_without_future_is_lru() -> None:
    trace = [k(i % 7) for i in range(100)] + [k(i % 3) for i in range(30)]
    lru = run_store(make_policy("lru"), trace, 4 * MiB)
    assert run_store(make_policy("belady"), trace, 4 * MiB) == lru


def test_belady_evicts_never_used_again_first() -> None:
    p = make_policy("belady")
    fill(p, 4)
    p.set_future([k(1), k(3)])
    assert drain(p) == [k(0), k(2), k(3), k(1)]


def test_belady_cyclic_scan_does_not_collapse() -> None:
    """LRU misses every read of a loop larger than the cache; Belady keeps most of it."""
    loop = [k(i) for i in range(10)]
    p = make_policy("belady")
    p.set_future(loop * 5)
    misses = run_store(p, loop * 5, 8 * MiB)
    assert len(run_store(make_policy("lru"), loop * 5, 8 * MiB)) == 50
    assert len(misses) <= 10 + 4 * 2


def test_belady_tolerates_disorder_and_repeated_reads() -> None:
    order = [k(i) for i in range(40)]
    p = make_policy("belady", window=8)
    p.set_future(order * 2)
    fill(p, 40)
    # Four workers: each reads every fourth block, a few positions out of step, and each
    # block in several small reads.
    reads = []
    for base in range(0, 40, 4):
        for w in (2, 0, 3, 1):
            reads += [order[base + w]] * 3
    for key in reads:
        p.access(key)
    assert p.position() == 40  # one epoch read, every occurrence once
    # The second epoch reads k(0) first and k(39) last.
    assert p.victim() == k(39)


def test_belady_skipped_positions_do_not_stall() -> None:
    order = [k(i) for i in range(100)]
    p = make_policy("belady", window=4)
    p.set_future(order)
    for key in order[:10] + order[13:60]:  # the reader skips 10..12
        p.access(key)
    assert p.position() >= 55
    assert p.next_use(k(11)) > 100  # taken as read
    p.advance(90)
    assert p.position() == 90
    for key in order[95:]:  # beyond the window: unannounced
        p.access(key)
    assert p.position() == 90


def test_belady_extend_future_links_epochs() -> None:
    p = make_policy("belady")
    epoch = [k(i) for i in range(5)]
    p.set_future(epoch)
    fill(p, 5)
    for key in epoch:
        p.access(key)
    p.extend_future(list(reversed(epoch)))
    assert p.victim() == k(0)  # read last in the next epoch
    assert p.next_use(k(4)) == 5


def test_belady_two_streams_share_one_clock() -> None:
    """Two jobs announce their own orders; each block's next use is judged on one clock."""
    a = [k(i, "a") for i in range(10)]
    b = [k(i, "b") for i in range(10)]
    p = make_policy("belady")
    p.set_future(a, stream="job-a")
    p.set_future(b, stream="job-b")
    for key in a + b:
        p.insert(key, MiB)
    for x, y in zip(a[:5], b[:5], strict=True):  # the jobs read in turns
        p.access(x)
        p.access(y)
    assert p.position("job-a") == 5 and p.position("job-b") == 5
    # Read blocks are never used again: they go first; then the farthest of either job.
    victims = drain(p)
    assert set(victims[:10]) == set(a[:5] + b[:5])
    assert set(victims[10:12]) == {a[9], b[9]}
    assert set(victims[-2:]) == {a[5], b[5]}
    p.set_future([], stream="job-a")  # forgotten: plain LRU for its blocks again
    assert p.next_use(a[6]) > 1 << 60


# -- a tier member's copies ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_copies_through_the_common_methods(name: str) -> None:
    """The store's calls (``insert_copy``, ``copy_victim``) on ``make_policy(copies=True)``."""
    p = make_policy(name, capacity=8 * MiB, copies=True)
    assert isinstance(p, CopiesFirst) and p.keeps_copies and p.name == name
    fill(p, 2)
    p.insert_copy(k(10), MiB)
    p.insert_copy(k(1), MiB)  # owned already: stays owned
    assert p.copy_bytes == MiB and p.copy_victim() == k(10) and p.victim() == k(10)
    p.remove(k(10))
    assert p.copy_victim() is None and p.victim() in {k(0), k(1)}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_copies_leave_before_any_owned_block_and_make_room_only_for_copies(name: str) -> None:
    p = CopiesFirst(make_policy(name))
    fill(p, 3)  # owned
    p.insert(k(10), MiB, copy=True)
    p.insert(k(11), MiB, copy=True)
    assert len(p) == 5 and p.copy_bytes == 2 * MiB and k(10) in p and p.size_of(k(10)) == MiB
    p.access(k(10))  # copies in least-recently-used order among themselves
    assert p.victim() == k(11) and p.victim(copies_only=True) == k(11)
    p.remove(k(11))
    p.remove(k(10))
    assert p.victim(copies_only=True) is None  # a copy never displaces an owned block
    assert p.victim() in {k(0), k(1), k(2)}
    assert len(drain(p)) == 3 and len(p) == 0 and p.copy_bytes == 0


def test_pins_keep_owned_blocks_not_copies() -> None:
    p = CopiesFirst(make_policy("lru"))
    p.pin(k(1))  # e.g. a warm-up through this member: counted before anything arrives
    p.pin(k(2))
    p.insert(k(1), MiB, copy=True)  # arrives as a copy: still the first to leave
    p.insert(k(2), MiB)  # arrives owned: kept while pinned
    p.insert(k(3), MiB)
    assert p.pinned(k(2)) and not p.pinned(k(1))
    assert p.victim(copies_only=True) == k(1) and p.victim() == k(1)
    p.remove(k(1))
    assert p.victim() == k(3)
    p.remove(k(3))
    assert p.victim() is None
    p.unpin(k(1))
    p.unpin(k(2))
    assert p.victim() == k(2)


def test_copies_are_reclassified_by_owner() -> None:
    p = CopiesFirst(make_policy("s3fifo"))
    fill(p, 6)  # the index knows no owner: everything comes back as owned
    p.pin(k(4))
    assert p.reclassify(p.resident_keys(), lambda key: key[1] % 2 == 0) == 2  # 4 is pinned
    assert p.copy_bytes == 2 * MiB and len(p) == 6
    assert sorted(p.resident_keys()) == [k(i) for i in range(6)]
    assert {p.victim(copies_only=True)} <= {k(0), k(2)}
    # Members changed: 0 is this member's now, 1 another's; keys not resident are skipped.
    assert p.reclassify([k(0), k(1), k(99)], lambda key: key[1] != 0) == 2
    assert p.victim(copies_only=True) in {k(1), k(2)} and p.copy_bytes == 2 * MiB
    assert sorted(drain(p)[:2]) == [k(1), k(2)]


# -- fair shares ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def shares(name: str = "lru", clock: Clock | None = None, **reserved: Share) -> Shares:
    """``Shares`` over ``name``; a key's dataset is its version string (``k(i, "a")``)."""
    return Shares(make_policy(name), dataset_of=lambda key: key[0], clock=clock or Clock(),
                  shares=reserved)


def evict_for(p: Shares, dataset: str) -> BlockKey | None:
    key = p.victim_for(dataset)
    if key is not None:
        p.remove(key)
    return key


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_reservation_in_use_is_never_evicted_for_others(name: str) -> None:
    p = shares(name, a=Share(min_bytes=4 * MiB))
    for i in range(4):
        p.insert(k(i, "a"), MiB)
    for i in range(3):
        p.insert(k(i, "b"), MiB)
    assert [evict_for(p, "b") for _ in range(3)] and not any(key in p for key in
                                                             (k(0, "b"), k(1, "b"), k(2, "b")))
    assert p.victim_for("b") is None  # only a's reservation is left: b's block passes through
    assert p.victim_for("a") in {k(i, "a") for i in range(4)}  # a may evict its own
    assert p.victim() is not None  # no requester (the store shrinking): anything unpinned
    assert len(p) == 4 and p.resident_bytes_of("a") == 4 * MiB


def test_the_one_furthest_over_its_reservation_gives_first() -> None:
    p = shares(a=Share(min_bytes=2 * MiB))
    for i in range(4):
        p.insert(k(i, "a"), MiB)  # 2 MiB over its reservation
    p.insert(k(0, "b"), MiB)  # b has none: all of its 1 MiB is over
    assert p.victim_for("b") == k(0, "a")  # a is further over: its oldest block
    p.insert(k(1, "b"), MiB)
    p.insert(k(2, "b"), MiB)
    assert p.victim_for("a") == k(0, "b")  # now b is: its oldest
    p.remove(k(0, "b"))
    p.remove(k(1, "b"))
    p.remove(k(2, "b"))
    assert [evict_for(p, "b"), evict_for(p, "b"), p.victim_for("b")] == [k(0, "a"), k(1, "a"),
                                                                        None]


def test_an_idle_reservation_is_not_held() -> None:
    clock = Clock()
    p = shares(clock=clock, a=Share(min_bytes=8 * MiB, idle_s=600))
    p.insert(k(0, "a"), MiB)
    p.insert(k(1, "a"), MiB)
    clock.t = 500
    p.access(k(0, "a"))  # read: in use for another 600 s
    clock.t = 1000
    assert p.in_use("a") and p.victim_for("b") is None
    clock.t = 1101
    assert p.in_use("a") is False and p.in_use("b") is None
    assert p.victim_for("b") == k(1, "a")  # its own order: k(1) was read least lately


def test_a_class_over_its_ceiling_gives_first() -> None:
    p = shares(a=Share(min_bytes=MiB, max_bytes=2 * MiB))
    for i in range(3):
        p.insert(k(i, "a"), MiB)
    for i in range(5):
        p.insert(k(i, "b"), MiB)  # further over than a, but a is past its ceiling
    assert p.victim_for("b") == k(0, "a")


def test_reservations_set_at_run_time_move_blocks_and_keep_pins() -> None:
    """The spoke wraps its filled policy when a reload brings the first min_share: blocks
    already resident move to their class as they come up, pins stay exact, and the last
    reservation gone gives the plain policy back with every pin."""
    inner = make_policy("lru")
    for i in range(3):
        inner.insert(k(i, "a"), MiB)
        inner.insert(k(i, "b"), MiB)
    inner.pin(k(0, "a"))  # from before the shares
    held = {"a": 3 * MiB, "b": 3 * MiB}
    p = Shares(inner, dataset_of=lambda key: key[0], clock=Clock(), resident=held.__getitem__,
               shares={"a": Share(min_bytes=3 * MiB)})
    p.pin(k(1, "a"))
    p.pin(k(1, "a"))
    victims = []
    while (key := p.victim_for("b")) is not None:
        victims.append(key)
        p.remove(key)
        held[key[0]] -= MiB
    assert victims == [k(0, "b"), k(1, "b"), k(2, "b")]  # a's moved aside, none evicted
    p.unpin(k(1, "a"))
    p.configure({})  # reservation removed: back to the shared instance
    plain = p.unwrap()
    assert plain is inner and sorted(plain.resident_keys()) == [k(i, "a") for i in range(3)]
    assert drain(plain) == [k(2, "a")]  # both pins held
    plain.unpin(k(0, "a"))
    plain.unpin(k(1, "a"))
    assert sorted(drain(plain)) == [k(0, "a"), k(1, "a")]


def test_pins_follow_a_block_through_shares() -> None:
    p = shares(a=Share(min_bytes=MiB))
    p.pin(k(0, "a"))  # before it arrives
    p.insert(k(0, "a"), MiB)
    p.insert(k(1, "a"), MiB)
    assert p.pinned(k(0, "a")) and p.victim() == k(1, "a")
    p.remove(k(0, "a"))  # corrupt: dropped, still pinned
    p.insert(k(0, "a"), MiB)
    p.remove(k(1, "a"))
    assert p.victim() is None
    p.unpin(k(0, "a"))
    assert p.victim() == k(0, "a")


def test_announced_futures_go_to_the_streams_dataset() -> None:
    p = shares("belady", a=Share(min_bytes=8 * MiB))
    for i in range(4):
        p.insert(k(i, "a"), MiB)
    p.set_future([k(0, "a"), k(1, "a")], stream="a/job")
    order = []
    while (key := p.victim_for("a")) is not None and key[0] == "a" and len(order) < 4:
        order.append(key)
        p.remove(key)
    assert order[:2] == [k(2, "a"), k(3, "a")] and order[2:] == [k(1, "a"), k(0, "a")]


def contention(name: str, *, reserve: bool, with_b: bool = True, steps: int = 3000
               ) -> float:
    """A store of 100 blocks through ``name``: job A re-reads its 30 blocks in a loop, job
    B (beside it, ``with_b``) scans 2,000 blocks, 5 of them to each of A's reads, so A's
    reuse distance (180 blocks) is beyond the cache. B reads each block in three parts (a
    loader's small reads), which makes s3fifo take its blocks for reused ones. A's hit
    ratio."""
    clock = Clock()
    capacity = 100 * MiB
    plain = make_policy(name, capacity=capacity)
    p: EvictionPolicy = (Shares(plain, dataset_of=lambda key: key[0], clock=clock,
                                make=lambda: make_policy(name, capacity=capacity),
                                shares={"a": Share(min_bytes=40 * MiB)})
                         if reserve else plain)
    used = 0

    def read(key: BlockKey) -> bool:
        nonlocal used
        clock.t += 0.01
        if key in p:
            p.access(key)
            return True
        while used + MiB > capacity:
            v = p.victim_for(key[0])
            if v is None:
                return False  # served, not kept
            p.remove(v)
            used -= MiB
        p.insert(key, MiB)
        used += MiB
        return False

    hits = 0
    b = 0
    for step in range(steps):
        hits += read(k(step % 30, "a"))
        for _ in range(5 if with_b else 0):
            for _part in range(3):
                read(k(b % 2000, "b"))
            b += 1
    return hits / steps


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_reserved_working_set_keeps_its_hit_ratio_beside_a_scan(name: str) -> None:
    alone = contention(name, reserve=False, with_b=False)
    assert alone > 0.98
    assert contention(name, reserve=True) >= 0.95 * alone
    assert contention(name, reserve=False) < 0.5 * alone  # what the reservation is for


def test_a_tier_members_copies_still_leave_before_reserved_and_shared_blocks() -> None:
    p = CopiesFirst(shares(a=Share(min_bytes=2 * MiB)))
    p.insert(k(0, "a"), MiB)
    p.insert(k(0, "b"), MiB)
    p.insert_copy(k(9, "c"), MiB)
    assert p.victim_for("b") == k(9, "c")  # a copy first, whoever asks
    p.remove(k(9, "c"))
    assert p.victim_for("b") == k(0, "b") and p.victim_for("a") == k(0, "b")
    p.remove(k(0, "b"))
    assert p.victim_for("b") is None and p.victim_for("a") == k(0, "a")
