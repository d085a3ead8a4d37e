"""Rendezvous (highest-random-weight) hashing: which member owns a block, and who is next.

Every member scores every key with a hash of (member, key); the highest score owns the key and
the others, by falling score, are its fallbacks. Each member computes this on its own from the
same member list, with no coordination and no table to share.

Why rendezvous hashing rather than a ring of virtual nodes: a member that joins takes ~1/N of
the keys, each from whichever member owned it, and a member that leaves gives back only its own
keys, spread evenly over the rest; balance needs no virtual nodes, and the fallback order for
a key is the same ranking one step further (AIStore places objects this way). The cost is N
hashes a look-up, a few microseconds for the tens of members a tier has.

A member is named by its URL (normalised: scheme and host lower-case, no trailing slash), so
every member must list the others by the same URL they advertise. The list's order does not
matter. Keys are ``(version id, block index)``: the identity of a cached block.

Weights (optional) give a member a share of the keys proportional to its weight, with the
logarithmic method of weighted rendezvous hashing (Schindelhauer and Schomaker): the score is
``-weight / ln(u)`` with ``u`` the hash mapped into (0, 1). With equal weights that ranks as the
plain hash does, and the plain hash is what is compared then (exact, no floating point).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import xxhash

from spokefs.errors import ConfigError

__all__ = ["Member", "Rendezvous", "block_key", "normalise_url"]

_TWO52 = float(1 << 52)


def normalise_url(url: str) -> str:
    """The member name for ``url``: ``scheme://host[:port][/path]``, lower-case scheme and
    host, no trailing slash. ConfigError for anything but an absolute http(s) URL."""
    text = url.strip()
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"tier member {url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"tier member {url!r}: no query, fragment or user in a member URL")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"tier member {url!r}: bad port") from exc
    host = parts.hostname.lower()
    if ":" in host:  # IPv6 literal: urlsplit drops its brackets
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def block_key(version: str, index: int) -> bytes:
    """The bytes a block is hashed by: its version id and its index (8 bytes, little end)."""
    return version.encode() + index.to_bytes(8, "little")


@dataclass(frozen=True)
class Member:
    url: str
    weight: float = 1.0


class Rendezvous:
    """Owners and fallbacks of block keys over a fixed member list (build a new one when the
    list changes: it is cheap, a hash per member)."""

    def __init__(self, members: Iterable[str | Member] | Mapping[str, float]) -> None:
        items: Iterable[tuple[str, float]]
        if isinstance(members, Mapping):
            items = members.items()
        else:
            items = ((m, 1.0) if isinstance(m, str) else (m.url, m.weight) for m in members)
        weights: dict[str, float] = {}
        for url, weight in items:
            if not (weight > 0 and math.isfinite(weight)):
                raise ConfigError(f"tier member {url!r}: weight must be a positive number, "
                                  f"not {weight!r}")
            name = normalise_url(url)
            if name in weights and weights[name] != weight:
                raise ConfigError(f"tier member {name} is listed twice with different weights")
            weights[name] = weight
        if not weights:
            raise ConfigError("a tier needs at least one member")
        # Sorted so that equal scores (astronomically rare) break ties the same on every member.
        self._names: tuple[str, ...] = tuple(sorted(weights))
        self._weights: tuple[float, ...] = tuple(weights[n] for n in self._names)
        # A member's hash seed is derived from its name: one hash call per (member, key).
        self._seeds: tuple[int, ...] = tuple(xxhash.xxh3_64_intdigest(n.encode())
                                             for n in self._names)
        self._weighted = len(set(self._weights)) > 1
        total = sum(self._weights)
        self._shares = {n: w / total for n, w in zip(self._names, self._weights, strict=True)}

    @property
    def members(self) -> tuple[str, ...]:
        """The member names, sorted."""
        return self._names

    def shares(self) -> dict[str, float]:
        """Each member's expected share of the keys (its weight over the total)."""
        return dict(self._shares)

    def _scores(self, key: bytes) -> list[tuple[float | int, str]]:
        h = xxhash.xxh3_64_intdigest
        if not self._weighted:
            return [(h(key, seed), name) for seed, name in zip(self._seeds, self._names,
                                                               strict=True)]
        out: list[tuple[float | int, str]] = []
        for seed, name, weight in zip(self._seeds, self._names, self._weights, strict=True):
            # The top 52 bits, plus a half: exact in a double and strictly inside (0, 1).
            u = ((h(key, seed) >> 12) + 0.5) / _TWO52
            out.append((-weight / math.log(u), name))
        return out

    def owner_of(self, key: bytes) -> str:
        return max(self._scores(key))[1]

    def ranked_of(self, key: bytes, n: int | None = None) -> list[str]:
        """The owner of ``key`` then its fallbacks in order; the first ``n`` when given."""
        scores = self._scores(key)
        scores.sort(reverse=True)
        return [name for _, name in (scores if n is None else scores[:n])]

    def owner(self, version: str, index: int) -> str:
        """The member that owns block ``index`` of file version ``version``."""
        return self.owner_of(block_key(version, index))

    def ranked(self, version: str, index: int, n: int | None = None) -> list[str]:
        """The owner of the block, then the member to ask when it does not answer, and so on."""
        return self.ranked_of(block_key(version, index), n)
