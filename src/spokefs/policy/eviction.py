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

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

from spokefs.errors import ConfigError

BlockKey = tuple[str, int]  # (version_id, block_index)

_NEVER = 1 << 62  # the next use of a block the announced future does not read again


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
            attached = key not in self._pins
            if attached:
                self._detach(key)
            self.resident_bytes += size - old
            self._sizes[key] = size
            if attached:
                self._attach(key)
            return
        self._sizes[key] = size
        self.resident_bytes += size
        if key not in self._pins:
            self._attach(key)

    def access(self, key: BlockKey) -> None:
        if key in self._sizes and key not in self._pins:
            self._touch(key)

    def remove(self, key: BlockKey) -> None:
        size = self._sizes.get(key)
        if size is None:
            return
        if key not in self._pins:
            self._detach(key)  # hooks may still look up the size
        del self._sizes[key]
        self.resident_bytes -= size

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


@register_policy
class S3FIFOPolicy(_PinnedBase):
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO with
    reinsertion (CLOCK) and a ghost set of keys recently evicted from the small queue.

    Chosen over ARC because it resists one-time scans just as well with three FIFOs and no
    list surgery on hits (a hit bumps a 2-bit counter), its ghost set is bounded in bytes, and
    ``victim()`` can do its queue moves lazily and still answer the same key twice.

    A new block enters the small queue; at eviction time a small-queue block read at least
    twice (``promote_at``, counting the read that filled it) moves to main, others leave and
    are remembered in the ghost set; a block that comes back while remembered goes straight to
    main. Main evicts blocks whose counter is 0, giving each reread block another lap.

    ``capacity`` (bytes) sizes the small queue (``small_ratio`` of it) and the ghost set (the
    rest); without it the high-water mark of resident bytes stands in for the capacity.
    """

    name = "s3fifo"

    def __init__(
        self, capacity: int | None = None, small_ratio: float = 0.1, promote_at: int = 2
    ) -> None:
        super().__init__()
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"s3fifo capacity must be > 0 bytes, got {capacity}")
        if not 0.0 < small_ratio < 1.0:
            raise ConfigError(f"s3fifo small_ratio must lie in (0, 1), got {small_ratio}")
        self.capacity = capacity
        self.small_ratio = small_ratio
        self.promote_at = promote_at
        self._small: OrderedDict[BlockKey, None] = OrderedDict()
        self._main: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, int] = OrderedDict()
        self._freq: dict[BlockKey, int] = {}
        self._small_bytes = 0
        self._ghost_bytes = 0
        self._high_water = 0

    def _capacity(self) -> int:
        if self.capacity is not None:
            return self.capacity
        self._high_water = max(self._high_water, self.resident_bytes)
        return self._high_water

    def _attach(self, key: BlockKey) -> None:
        if key in self._freq:  # back from a pin: it was worth keeping
            self._main[key] = None
            return
        self._freq[key] = 0
        size = self._ghost.pop(key, None)
        if size is not None:
            self._ghost_bytes -= size
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += self._sizes[key]

    def _detach(self, key: BlockKey) -> None:
        if key in self._small:
            del self._small[key]
            self._small_bytes -= self._sizes[key]
        else:
            self._main.pop(key, None)

    def _touch(self, key: BlockKey) -> None:
        self._freq[key] = min(self._freq[key] + 1, 3)

    def remove(self, key: BlockKey) -> None:
        size = self._sizes.get(key)
        if size is None:
            return
        if key in self._small:  # left during probation: remember it
            self._ghost[key] = size
            self._ghost_bytes += size
            limit = self._capacity() * (1.0 - self.small_ratio)
            while self._ghost_bytes > limit and self._ghost:
                self._ghost_bytes -= self._ghost.popitem(last=False)[1]
        super().remove(key)
        if key not in self._pins:
            del self._freq[key]

    def victim(self) -> BlockKey | None:
        small_target = self._capacity() * self.small_ratio
        while True:
            if self._small and (self._small_bytes > small_target or not self._main):
                key = next(iter(self._small))
                if self._freq[key] < self.promote_at:
                    return key
                del self._small[key]  # reread during probation: promote
                self._small_bytes -= self._sizes[key]
                self._main[key] = None
                self._freq[key] = 0
                continue
            if not self._main:
                return None
            key = next(iter(self._main))
            if self._freq[key] == 0:
                return key
            self._freq[key] -= 1  # another lap
            self._main.move_to_end(key)


@register_policy
class BeladyPolicy(_PinnedBase):
    """Belady's MIN against an announced future: evict the block whose next use is farthest.

    ``set_future(order)`` / ``extend_future(order)`` give the block keys in the order the
    reader(s) will read them (the planner derives it from an announced sample order). Blocks
    the future never reads again go first, least recently used first; with no future at all
    the policy is plain LRU.

    The reader's position follows its reads: ``access(key)`` consumes the key's next
    occurrence when it lies less than ``window`` positions past the farthest one read, so
    DataLoader workers may read slightly out of order; a position left unread while reads run
    more than ``window`` past it counts as read. Several small reads of one block consume one
    occurrence. A read farther ahead than the window is taken as unannounced (it only counts
    as recent use); ``advance(position)`` moves the position explicitly, for a reader that
    jumps.
    """

    name = "belady"

    def __init__(self, window: int = 256) -> None:
        super().__init__()
        if window < 1:
            raise ConfigError(f"belady window must be >= 1, got {window}")
        self.window = window
        self._order: list[BlockKey] = []
        self._next: list[int] = []  # index of the same key's next occurrence, or _NEVER
        self._consumed = bytearray()
        self._cur: dict[BlockKey, int] = {}  # each key's oldest unconsumed occurrence
        self._last: dict[BlockKey, int] = {}  # each key's last occurrence in the order
        self._recent: OrderedDict[BlockKey, int] = OrderedDict()  # key -> position just read
        self._pos = 0  # every occurrence before this one has been read
        self._max_read = -1
        self._heap: list[tuple[int, int, BlockKey]] = []  # (-next use, stamp, key)
        self._stamp: dict[BlockKey, int] = {}  # attached keys -> their live heap stamp
        self._clock = 0

    # -- the future ---------------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self._pos

    def set_future(self, order: Sequence[BlockKey]) -> None:
        """Replace the future with ``order``; the reader is at its start."""
        self._order, self._next, self._consumed = [], [], bytearray()
        self._cur, self._last, self._recent = {}, {}, OrderedDict()
        self._pos, self._max_read = 0, -1
        self.extend_future(order)

    def extend_future(self, order: Sequence[BlockKey]) -> None:
        """Append ``order`` (the next epoch) to the future."""
        self._compact()
        base = len(self._order)
        self._order.extend(order)
        self._next.extend([_NEVER] * (len(self._order) - base))
        self._consumed.extend(bytes(len(self._order) - base))
        cur, last, nxt = self._cur, self._last, self._next
        for j in range(base, len(self._order)):
            key = self._order[j]
            prev = last.get(key)
            if prev is not None:
                nxt[prev] = j
            if key not in cur:
                cur[key] = j
            last[key] = j
        self._rebuild_heap()

    def advance(self, position: int) -> None:
        """The reader has read everything before ``position``."""
        self._consume_until(min(position, len(self._order)))
        self._max_read = max(self._max_read, self._pos - 1)

    def next_use(self, key: BlockKey) -> int:
        return self._cur.get(key, _NEVER)

    def _consume(self, i: int) -> None:
        key = self._order[i]
        self._consumed[i] = 1
        nxt = self._next[i]
        if nxt == _NEVER:
            del self._cur[key]
            if self._last.get(key) == i:
                del self._last[key]
        else:
            self._cur[key] = nxt
        self._recent[key] = i
        self._recent.move_to_end(key)
        if len(self._recent) > 4 * self.window:
            self._recent.popitem(last=False)
        if key in self._stamp:
            self._push(key)

    def _consume_until(self, limit: int) -> None:
        consumed = self._consumed
        while self._pos < limit:
            if not consumed[self._pos]:
                self._consume(self._pos)
            self._pos += 1
        while self._pos < len(consumed) and consumed[self._pos]:
            self._pos += 1

    def _compact(self) -> None:
        """Drop the read prefix of the future, so repeated epochs do not grow memory."""
        drop = self._pos
        if drop < 4096 or drop * 2 < len(self._order):
            return
        del self._order[:drop]
        del self._consumed[:drop]
        self._next = [n - drop if n != _NEVER else n for n in self._next[drop:]]
        self._cur = {key: i - drop for key, i in self._cur.items()}
        self._last = {key: i - drop for key, i in self._last.items()}
        self._recent = OrderedDict((key, i - drop) for key, i in self._recent.items())
        self._pos -= drop
        self._max_read -= drop

    # -- the heap of attached keys ----------------------------------------------------------
    def _push(self, key: BlockKey) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        heapq.heappush(self._heap, (-self._cur.get(key, _NEVER), self._clock, key))
        if len(self._heap) > 2 * len(self._stamp) + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        cur = self._cur
        self._heap = [(-cur.get(key, _NEVER), s, key) for key, s in self._stamp.items()]
        heapq.heapify(self._heap)

    def _attach(self, key: BlockKey) -> None:
        self._push(key)

    def _detach(self, key: BlockKey) -> None:
        del self._stamp[key]  # its heap entries go stale

    def _touch(self, key: BlockKey) -> None:
        self._push(key)

    def access(self, key: BlockKey) -> None:
        i = self._cur.get(key)
        read_at = self._recent.get(key)
        # Another small read of a block just read is the same occurrence, unless its next
        # occurrence is where the reader is now (a short loop that reads it again).
        repeat = (
            read_at is not None
            and read_at >= self._pos - self.window
            and i is not None
            and i > self._max_read + 1
        )
        if i is not None and not repeat and i < max(self._pos, self._max_read + 1) + self.window:
            self._consume(i)
            self._max_read = max(self._max_read, i)
            # Workers may run ahead, but not forever: a position the reader skipped by more
            # than the window is taken as read, so the future cannot stall on it.
            self._consume_until(max(self._pos, self._max_read - self.window))
        super().access(key)

    def victim(self) -> BlockKey | None:
        heap, stamp = self._heap, self._stamp
        while heap:
            _, s, key = heap[0]
            if stamp.get(key) == s:
                return key
            heapq.heappop(heap)
        return None
