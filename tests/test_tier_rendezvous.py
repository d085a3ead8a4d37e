"""Rendezvous hashing (spokefs.tier.rendezvous): movement on join and leave, balance, order
independence, weights, fallbacks."""

from __future__ import annotations

import random

import pytest

from spokefs.errors import ConfigError
from spokefs.tier.rendezvous import Member, Rendezvous, block_key, normalise_url

KEYS = 100_000
FOUR = [f"http://spoke-{i}.spokefs-spoke.ml.svc.cluster.local:8471" for i in range(4)]
FIFTH = "http://spoke-4.spokefs-spoke.ml.svc.cluster.local:8471"


def _keys(n: int = KEYS) -> list[bytes]:
    # Real-shaped keys: 32-hex version ids with a spread of block indexes.
    rng = random.Random(15)
    versions = [f"{rng.getrandbits(128):032x}" for _ in range(n // 50)]
    return [block_key(versions[i % len(versions)], i // len(versions)) for i in range(n)]


@pytest.fixture(scope="module")
def keys() -> list[bytes]:
    return _keys()


@pytest.fixture(scope="module")
def owners4(keys: list[bytes]) -> list[str]:
    ring = Rendezvous(FOUR)
    return [ring.owner_of(k) for k in keys]


def test_adding_a_fifth_member_moves_a_fifth_of_the_keys_all_to_it(keys, owners4):
    ring5 = Rendezvous([*FOUR, FIFTH])
    owners5 = [ring5.owner_of(k) for k in keys]
    moved = [(a, b) for a, b in zip(owners4, owners5, strict=True) if a != b]
    assert 0.17 <= len(moved) / len(keys) <= 0.23
    assert all(b == FIFTH for _, b in moved)  # nothing moves between the old four


def test_removing_a_member_moves_only_its_keys(keys, owners4):
    gone = FOUR[2]
    ring3 = Rendezvous([m for m in FOUR if m != gone])
    owners3 = [ring3.owner_of(k) for k in keys]
    for before, after in zip(owners4, owners3, strict=True):
        if before == gone:
            assert after != gone
        else:
            assert after == before
    # its keys spread over the other three, not onto one of them
    spread = {m: 0 for m in FOUR if m != gone}
    for before, after in zip(owners4, owners3, strict=True):
        if before == gone:
            spread[after] += 1
    mean = sum(spread.values()) / 3
    assert all(abs(c - mean) <= 0.1 * mean for c in spread.values())


def test_owners_are_balanced(keys):
    members = [*FOUR, FIFTH]
    ring = Rendezvous(members)
    counts = dict.fromkeys(members, 0)
    for k in keys:
        counts[ring.owner_of(k)] += 1
    mean = len(keys) / len(members)
    assert all(abs(c - mean) <= 0.1 * mean for c in counts.values()), counts


def test_member_order_and_spelling_do_not_matter(keys):
    a = Rendezvous(FOUR)
    shuffled = list(reversed(FOUR))
    b = Rendezvous([m.upper().replace("HTTP://", "http://") + "/" for m in shuffled])
    assert a.members == b.members
    assert all(a.owner_of(k) == b.owner_of(k) for k in keys[:5000])


def test_ranked_is_the_owner_then_the_fallback_after_removal(keys):
    ring = Rendezvous([*FOUR, FIFTH])
    for k in keys[:2000]:
        ranked = ring.ranked_of(k)
        assert ranked[0] == ring.owner_of(k)
        assert sorted(ranked) == sorted(ring.members)
        # the fallback is who owns the key once the owner is gone
        without = Rendezvous([m for m in ring.members if m != ranked[0]])
        assert without.owner_of(k) == ranked[1]
    assert len(ring.ranked("ab" * 16, 3, n=2)) == 2
    assert ring.owner("ab" * 16, 3) == ring.ranked("ab" * 16, 3)[0]


def test_weights_give_proportional_shares_and_keep_minimal_movement(keys):
    weighted = {FOUR[0]: 1.0, FOUR[1]: 1.0, FOUR[2]: 2.0}
    ring = Rendezvous(weighted)
    assert ring.shares()[FOUR[2]] == pytest.approx(0.5)
    counts = dict.fromkeys(weighted, 0)
    owners = [ring.owner_of(k) for k in keys]
    for o in owners:
        counts[o] += 1
    for m, w in weighted.items():
        expected = len(keys) * w / 4
        assert abs(counts[m] - expected) <= 0.1 * expected, counts
    # a weighted member joining takes only keys for itself
    ring2 = Rendezvous([*[Member(m, w) for m, w in weighted.items()], Member(FIFTH, 0.5)])
    for before, k in zip(owners, keys, strict=True):
        after = ring2.owner_of(k)
        assert after in (before, FIFTH)


def test_equal_weights_rank_as_unweighted(keys):
    plain = Rendezvous(FOUR)
    same = Rendezvous({m: 3.0 for m in FOUR})
    assert all(plain.ranked_of(k) == same.ranked_of(k) for k in keys[:2000])


@pytest.mark.parametrize("bad", ["spoke-0:8471", "ftp://x", "http://", "http://h:99999",
                                 "http://u@h", "http://h/?q=1"])
def test_bad_member_urls_are_refused(bad):
    with pytest.raises(ConfigError):
        Rendezvous([bad])


def test_bad_weights_and_empty_lists_are_refused():
    with pytest.raises(ConfigError):
        Rendezvous([])
    with pytest.raises(ConfigError):
        Rendezvous({FOUR[0]: 0.0})
    with pytest.raises(ConfigError):
        Rendezvous([Member(FOUR[0], 1.0), Member(FOUR[0] + "/", 2.0)])


def test_normalise_url():
    assert normalise_url("HTTP://Spoke-0.Example:8471/") == "http://spoke-0.example:8471"
    assert normalise_url("https://[FD00::1]:8471") == "https://[fd00::1]:8471"
    assert normalise_url("http://h/base/") == "http://h/base"
