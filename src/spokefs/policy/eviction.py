"""Eviction policies: which resident block leaves the cache next.

Sans-I/O. A policy only tracks keys and sizes; the block store owns the bytes and the capacity.
The store drives it like this::

    policy.insert(key, size)          # a block became resident (prefetch or demand fill)
    policy.access(key)                # every read served from the block, including the read
                                      # whose miss caused the fill, once it is resident
    while store.full():
        key = policy.victim()         # None: everything resident is pinned; do not admit
        store.delete(key)
        policy.remove(key)            # also after a purge or a failed checksum

Rules every policy keeps (the parametrised suite in tests/test_policy.py checks them):

- ``victim()`` returns a resident, unpinned key or None, and does not remove it; calling it
  twice without a change in between returns the same key.
- ``remove()`` of an unknown key is a no-op; remove never forgets a pin (a corrupt block that
  is fetched again is still pinned when it comes back).
- Pins nest: every ``pin`` needs its own ``unpin``, because the planner (announced order) and
  the store (a read in progress) pin independently. Pinning a non-resident key is remembered
  for when it arrives; ``unpin`` of a key that is not pinned is a no-op.
- Pinned resident blocks sit outside the policy's ordering, so ``victim()`` stays O(1)
  amortised however many blocks are pinned; an unpinned block comes back as freshly used.

Policies register by name (``@register_policy``); ``make_policy(name, **options)`` builds one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

from spokefs.errors import ConfigError

BlockKey = tuple[str, int]  # (version_id, block_index)


@runtime_checkable
class EvictionPolicy(Protocol):
    """Tracks resident blocks and chooses victims; see the module docstring for the rules."""

    name: ClassVar[str]

    def insert(self, key: BlockKey, size: int) -> None: ...
    def access(self, key: BlockKey) -> None: ...
    def remove(self, key: BlockKey) -> None: ...
    def victim(self) -> BlockKey | None: ...
    def pin(self, key: BlockKey) -> None: ...
    def unpin(self, key: BlockKey) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


POLICIES: dict[str, type[EvictionPolicy]] = {}

_P = TypeVar("_P", bound=type)


def register_policy(cls: _P) -> _P:
    """Class decorator: make ``cls`` available to ``make_policy(cls.name)``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` to be registered")
    POLICIES[name] = cls
    return cls


def make_policy(name: str, **options: object) -> EvictionPolicy:
    """Build the policy registered as ``name`` with its keyword ``options``."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of: {known}") from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"bad options for eviction policy {name!r}: {exc}") from exc


class _PinnedBase:
    """Residency and nested pins; subclasses keep only their unpinned ordering.

    Subclass hooks: ``_attach(key)`` puts a resident unpinned key into the ordering (new or
    unpinned), ``_detach(key)`` takes it out (pinned or removed).
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._sizes: dict[BlockKey, int] = {}  # every resident key, pinned or not
        self._pins: dict[BlockKey, int] = {}  # pin counts, resident or not
        self.resident_bytes = 0

    # -- hooks ----------------------------------------------------------------------------
    def _attach(self, key: BlockKey) -> None:
        raise NotImplementedError

    def _detach(self, key: BlockKey) -> None:
        raise NotImplementedError

    def _touch(self, key: BlockKey) -> None:
        """A read hit an unpinned resident key."""
        raise NotImplementedError

    # -- the protocol -----------------------------------------------------------------------
    def insert(self, key: BlockKey, size: int) -> None:
        if size < 0:
            raise ValueError(f"block size must be >= 0, got {size}")
        old = self._sizes.get(key)
        if old is not None:  # re-insert (refetched after corruption): new size, counts as use
            self.resident_bytes += size - old
            self._sizes[key] = size
            self.access(key)
            return
        self._sizes[key] = size
        self.resident_bytes += size
        if key not in self._pins:
            self._attach(key)

    def access(self, key: BlockKey) -> None:
        if key in self._sizes and key not in self._pins:
            self._touch(key)

    def remove(self, key: BlockKey) -> None:
        size = self._sizes.pop(key, None)
        if size is None:
            return
        self.resident_bytes -= size
        if key not in self._pins:
            self._detach(key)

    def pin(self, key: BlockKey) -> None:
        count = self._pins.get(key, 0)
        self._pins[key] = count + 1
        if count == 0 and key in self._sizes:
            self._detach(key)

    def unpin(self, key: BlockKey) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            return
        if count > 1:
            self._pins[key] = count - 1
            return
        del self._pins[key]
        if key in self._sizes:
            self._attach(key)

    def pinned(self, key: BlockKey) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} resident={len(self._sizes)} "
            f"bytes={self.resident_bytes} pinned={len(self._pins)}>"
        )


@register_policy
class LRUPolicy(_PinnedBase):
    """Least recently used: O(1) everything with one OrderedDict (oldest first)."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def _attach(self, key: BlockKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def _detach(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def _touch(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def victim(self) -> BlockKey | None:
        return next(iter(self._order), None)
