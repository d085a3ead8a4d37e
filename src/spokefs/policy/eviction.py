"""Eviction policies: which resident block leaves the cache next.

Sans-I/O. A policy only tracks keys and sizes; the block store owns the bytes and the capacity.
The store (``spokefs.cache.store.BlockStore``) drives it like this::

    policy.insert(key, size)          # a block became resident (its write was indexed, or it
                                      # was found in the index at open)
    policy.access(key)                # every read served from the resident block (the read
                                      # whose miss caused the fill is served from the fetched
                                      # buffer: not an access; bench policy counts it)
    while used + reserved > limit:    # room for a block about to be written (and at open)
        key = policy.victim()         # None: everything resident is pinned; do not admit
        policy.remove(key)            # the store drops the block; also after a purge or a
                                      # failed check

Rules every policy keeps (the parametrised suite in tests/test_policy.py checks them):

- ``victim()`` returns a resident, unpinned key or None, and does not remove it; calling it
  twice without a change in between returns the same key. ``victim_for(dataset)`` is the
  victim that makes room for a block of ``dataset``: the same as ``victim()`` for a plain
  policy; ``spokefs.policy.shares.Shares`` (reserved shares per dataset) answers it per
  dataset, and may answer None where ``victim()`` would not (the others' reservations).
- ``remove()`` of an unknown key is a no-op; remove never forgets a pin (a corrupt block that
  is fetched again is still pinned when it comes back).
- Pins nest: every ``pin`` needs its own ``unpin``, because several pin independently: the
  planner (announced orders, learned working sets), warm-ups (``spokefs warm --pin``), and the
  store itself while a read of 1 MiB or more is sent from the block's region (``hold`` /
  ``let_go``). Pinning a non-resident key is remembered for when it arrives; ``unpin`` of a
  key that is not pinned is a no-op.
- Pinned resident blocks sit outside the policy's ordering, so ``victim()`` stays O(1)
  amortised however many blocks are pinned; an unpinned block comes back as freshly used.

Every policy is built the same way, ``cls(capacity=bytes_or_None, **its_options)``: the
capacity is the store's (a policy that sizes its queues by it uses it, the others ignore it),
so a caller never asks a policy what it takes. Policies register by name
(``@register_policy``); ``make_policy(name, capacity=..., **options)`` builds one.

A tier member's copies of other members' blocks (``CopiesFirst``) are part of the protocol too,
so the store never asks which kind of policy it has: ``keeps_copies`` says whether
``insert_copy`` keeps a block as a copy (False: a plain policy, where a copy is an ordinary
block and the store admits none), ``copy_victim()`` is the next copy to leave (None for a
plain policy), ``copy_bytes`` what copies hold and ``reclassify`` moves blocks between the two
classes (a no-op without copies).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
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
    def victim_for(self, dataset: str) -> BlockKey | None: ...
    def pin(self, key: BlockKey) -> None: ...
    def unpin(self, key: BlockKey) -> None: ...
    def pinned(self, key: BlockKey) -> bool: ...
    def size_of(self, key: BlockKey) -> int | None: ...
    def resident_keys(self) -> list[BlockKey]: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...

    # A tier member's copies (see the module docstring); plain policies: none.
    @property
    def keeps_copies(self) -> bool: ...
    @property
    def copy_bytes(self) -> int: ...
    def insert_copy(self, key: BlockKey, size: int) -> None: ...
    def copy_victim(self) -> BlockKey | None: ...
    def reclassify(self, keys: Iterable[BlockKey], is_copy: Callable[[BlockKey], bool]
                   ) -> int: ...


POLICIES: dict[str, type[EvictionPolicy]] = {}

_P = TypeVar("_P", bound=type)


def register_policy(cls: _P) -> _P:
    """Class decorator: make ``cls`` available to ``make_policy(cls.name)``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` to be registered")
    POLICIES[name] = cls
    return cls


def make_policy(name: str, capacity: int | None = None, copies: bool = False,
                **options: object) -> EvictionPolicy:
    """Build the policy registered as ``name`` for a store of ``capacity`` bytes (None: not
    known), with its keyword ``options``. ``copies``: wrapped in ``CopiesFirst``, for a tier
    member that keeps copies of other members' blocks in spare room."""
    try:
        cls = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of: {known}") from None
    try:
        policy = cls(capacity=capacity, **options)  # type: ignore[call-arg]
    except TypeError as exc:
        raise ConfigError(f"bad options for eviction policy {name!r}: {exc}") from exc
    return CopiesFirst(policy) if copies else policy


class KeepsNoCopies:
    """A tier member's copies (``CopiesFirst``) for a policy that keeps none: a copy is an
    ordinary block (the store admits none anyway)."""

    def insert(self, key: BlockKey, size: int) -> None:
        raise NotImplementedError

    @property
    def keeps_copies(self) -> bool:
        return False

    @property
    def copy_bytes(self) -> int:
        return 0

    def insert_copy(self, key: BlockKey, size: int) -> None:
        self.insert(key, size)

    def copy_victim(self) -> BlockKey | None:
        return None

    def reclassify(self, keys: Iterable[BlockKey], is_copy: Callable[[BlockKey], bool]
                   ) -> int:
        return 0


class _PinnedBase(KeepsNoCopies):
    """Residency and nested pins; subclasses keep only their unpinned ordering.

    Subclass hooks: ``_attach(key)`` puts a resident unpinned key into the ordering (new or
    unpinned), ``_detach(key)`` takes it out (pinned or removed).
    """

    name: ClassVar[str]

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise ConfigError(f"{self.name} capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity  # the store's, in bytes (None: not known)
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

    def victim_for(self, dataset: str) -> BlockKey | None:
        """The victim that makes room for a block of ``dataset``: one order for every
        dataset here (reserved shares: ``spokefs.policy.shares``)."""
        return self.victim()

    def size_of(self, key: BlockKey) -> int | None:
        return self._sizes.get(key)

    def resident_keys(self) -> list[BlockKey]:
        return list(self._sizes)

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

    def __init__(self, *, capacity: int | None = None) -> None:  # the capacity is not used
        super().__init__(capacity)
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

    A new block enters the small queue; at eviction time a small-queue block accessed at least
    ``promote_at`` times (2) since it was inserted moves to main, others leave and are
    remembered in the ghost set; a block that comes back while remembered goes straight to
    main. Main evicts blocks whose counter is 0, giving each reread block another lap.

    ``capacity`` (bytes) sizes the small queue (``small_ratio`` of it) and the ghost set (the
    rest); without it the high-water mark of resident bytes stands in for the capacity.
    """

    name = "s3fifo"

    def __init__(
        self, capacity: int | None = None, small_ratio: float = 0.1, promote_at: int = 2
    ) -> None:
        super().__init__(capacity)
        if capacity == 0:  # its queues are shares of the capacity
            raise ConfigError(f"s3fifo capacity must be > 0 bytes, got {capacity}")
        if not 0.0 < small_ratio < 1.0:
            raise ConfigError(f"s3fifo small_ratio must lie in (0, 1), got {small_ratio}")
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


class _Future:
    """One reader's announced block order and where that reader is in it."""

    def __init__(self, window: int, clock: int) -> None:
        self.window = window
        self.order: list[BlockKey] = []
        self.next: list[int] = []  # index of the same key's next occurrence, or _NEVER
        self.consumed = bytearray()
        self.cur: dict[BlockKey, int] = {}  # each key's oldest unconsumed occurrence
        self.last: dict[BlockKey, int] = {}  # each key's last occurrence
        # Keys read for the last time in the announced order: training reads them again next
        # epoch, so their next use is guessed one period (the last epoch's length) later.
        self.dead: dict[BlockKey, int] = {}
        self.period = 0
        self.recent: OrderedDict[BlockKey, int] = OrderedDict()  # key -> position just read
        self.pos = 0  # every occurrence before this one has been read
        self.max_read = -1
        self.read = 0  # positions consumed
        self.started = clock  # the policy's clock when this future began

    def extend(self, order: Sequence[BlockKey]) -> None:
        self.compact()
        base = len(self.order)
        self.order.extend(order)
        n = len(self.order) - base
        self.period = n
        dead = self.dead
        self.next.extend([_NEVER] * n)
        self.consumed.extend(bytes(n))
        cur, last, nxt = self.cur, self.last, self.next
        for j in range(base, len(self.order)):
            key = self.order[j]
            prev = last.get(key)
            if prev is not None:
                nxt[prev] = j
            if key not in cur:
                cur[key] = j
                dead.pop(key, None)
            last[key] = j

    def next_at(self, key: BlockKey) -> int | None:
        """Position of the key's next use: announced, or guessed for a read key."""
        i = self.cur.get(key)
        if i is not None:
            return i
        i = self.dead.get(key)
        if i is not None and i < self.pos:  # the guess passed without the key coming back
            del self.dead[key]
            return None
        return i

    def consume(self, i: int) -> BlockKey:
        key = self.order[i]
        self.consumed[i] = 1
        self.read += 1
        nxt = self.next[i]
        if nxt == _NEVER:
            del self.cur[key]
            if self.last.get(key) == i:
                del self.last[key]
            self.dead[key] = i + max(self.period, 1)
        else:
            self.cur[key] = nxt
        self.recent[key] = i
        self.recent.move_to_end(key)
        if len(self.recent) > 4 * self.window:
            self.recent.popitem(last=False)
        return key

    def consume_until(self, limit: int) -> list[BlockKey]:
        """Count every position before ``limit`` as read; returns the keys that moved."""
        moved = []
        consumed = self.consumed
        while self.pos < limit:
            if not consumed[self.pos]:
                moved.append(self.consume(self.pos))
            self.pos += 1
        while self.pos < len(consumed) and consumed[self.pos]:
            self.pos += 1
        return moved

    def on_access(self, key: BlockKey) -> list[BlockKey]:
        """A read of ``key``: consume its occurrence if the reader is there."""
        i = self.cur.get(key)
        if i is None:
            return []
        # Another small read of a block just read is the same occurrence, unless its next
        # occurrence is where the reader is now (a short loop that reads it again).
        read_at = self.recent.get(key)
        if read_at is not None and read_at >= self.pos - self.window and i > self.max_read + 1:
            return []
        if i >= max(self.pos, self.max_read + 1) + self.window:
            return []  # far ahead of every reader: not this occurrence
        moved = [self.consume(i)]
        self.max_read = max(self.max_read, i)
        # Workers may run ahead, but not forever: a position the reads have passed by more
        # than the window is taken as read, so the future cannot stall on it.
        return moved + self.consume_until(max(self.pos, self.max_read - self.window))

    def compact(self) -> None:
        """Drop the read prefix, so repeated epochs do not grow memory."""
        drop = self.pos
        if drop < 4096 or drop * 2 < len(self.order):
            return
        del self.order[:drop]
        del self.consumed[:drop]
        self.next = [n - drop if n != _NEVER else n for n in self.next[drop:]]
        self.cur = {key: i - drop for key, i in self.cur.items()}
        self.last = {key: i - drop for key, i in self.last.items()}
        self.dead = {key: i - drop for key, i in self.dead.items() if i >= drop}
        self.recent = OrderedDict((key, i - drop) for key, i in self.recent.items())
        self.pos -= drop
        self.max_read -= drop


@register_policy
class BeladyPolicy(_PinnedBase):
    """Belady's MIN against announced futures: evict the block whose next use is farthest.

    ``set_future(order, stream)`` / ``extend_future(order, stream)`` give the block keys in
    the order a reader will read them (the planner derives it from an announced sample
    order); ``stream`` names the reader (one per job), so several jobs can share a cache.
    Blocks no future reads go first, least recently used first; with no future at all the
    policy is plain LRU. A block a stream read for the last time in its announced order is
    expected again one epoch (the length of the last announcement) after that read, since
    training reads its dataset epoch after epoch: so a cyclic scan keeps the blocks the next
    epoch starts with even before that epoch is announced. ``set_future([], stream)`` forgets
    a stream.

    Each stream's position follows its reads: ``access(key)`` consumes the key's next
    occurrence when it lies less than ``window`` positions past the farthest one read, so
    DataLoader workers may read slightly out of order; a position left unread while reads run
    more than ``window`` past it counts as read. Several small reads of one block consume one
    occurrence. A read farther ahead than the window is taken as unannounced (it only counts
    as recent use); ``advance(position)`` moves a position explicitly, for a reader that
    jumps.

    Next uses of different streams are compared on one clock, the positions consumed by all
    streams: a stream that has advanced ``n`` positions while the clock advanced ``c`` is
    expected to reach a block ``d`` positions ahead in ``d * c / n`` ticks.
    """

    name = "belady"

    def __init__(self, window: int = 256, *, capacity: int | None = None) -> None:
        super().__init__(capacity)  # the capacity is not used: the future orders everything
        if window < 1:
            raise ConfigError(f"belady window must be >= 1, got {window}")
        self.window = window
        self._futures: dict[str, _Future] = {}
        self._ticks = 0  # positions consumed, all streams together
        self._heap: list[tuple[int, int, BlockKey]] = []  # (-next use, stamp, key)
        self._stamp: dict[BlockKey, int] = {}  # attached keys -> their live heap stamp
        self._clock = 0

    # -- the future ---------------------------------------------------------------------------
    def position(self, stream: str = "") -> int:
        f = self._futures.get(stream)
        return f.pos if f else 0

    def set_future(self, order: Sequence[BlockKey], stream: str = "") -> None:
        """Replace ``stream``'s future with ``order``; its reader is at the start."""
        self._futures.pop(stream, None)
        if order:
            self.extend_future(order, stream)
        else:
            self._rebuild_heap()

    def extend_future(self, order: Sequence[BlockKey], stream: str = "") -> None:
        """Append ``order`` (the next epoch) to ``stream``'s future."""
        f = self._futures.get(stream)
        if f is None:
            f = self._futures[stream] = _Future(self.window, self._ticks)
        f.extend(order)
        self._rebuild_heap()

    def advance(self, position: int, stream: str = "") -> None:
        """``stream``'s reader has read everything before ``position``."""
        f = self._futures.get(stream)
        if f is None:
            return
        self._moved(f, f.consume_until(min(position, len(f.order))))
        f.max_read = max(f.max_read, f.pos - 1)

    def next_use(self, key: BlockKey) -> int:
        """When ``key`` is read next, on the clock of positions consumed (``_NEVER``: not)."""
        best = _NEVER
        for f in self._futures.values():
            i = f.next_at(key)
            if i is not None:
                elapsed = self._ticks - f.started
                rate = elapsed / f.read if f.read else 1.0
                best = min(best, self._ticks + int((i - f.pos) * rate))
        return best

    def _moved(self, f: _Future, keys: list[BlockKey]) -> None:
        self._ticks += len(keys)
        for key in keys:
            if key in self._stamp:
                self._push(key)

    # -- the heap of attached keys ----------------------------------------------------------
    def _push(self, key: BlockKey) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        heapq.heappush(self._heap, (-self.next_use(key), self._clock, key))
        if len(self._heap) > 2 * len(self._stamp) + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(-self.next_use(key), s, key) for key, s in self._stamp.items()]
        heapq.heapify(self._heap)

    def _attach(self, key: BlockKey) -> None:
        self._push(key)

    def _detach(self, key: BlockKey) -> None:
        del self._stamp[key]  # its heap entries go stale

    def _touch(self, key: BlockKey) -> None:
        self._push(key)

    def access(self, key: BlockKey) -> None:
        for f in self._futures.values():
            moved = f.on_access(key)
            if moved:
                self._moved(f, moved)
        super().access(key)

    def victim(self) -> BlockKey | None:
        heap, stamp = self._heap, self._stamp
        while heap:
            _, s, key = heap[0]
            if stamp.get(key) == s:
                return key
            heapq.heappop(heap)
        return None


class CopiesFirst:
    """A tier member's eviction: the blocks it owns, ordered by its configured policy, and
    copies of blocks other members own, kept while there is room.

    A member that serves a block another member owns keeps a copy if it can (the next read
    through it is local, not a hop to the owner), but copies only fill room the owned blocks
    do not use: every copy leaves before any owned block (least recently used copy first),
    and a copy is admitted only by evicting other copies (``copy_victim()``), so
    the tier's capacity for one regional copy of each block is never spent on a second one.
    Pins keep owned blocks only: a copy is spare room's guest, and a pin on it (a warm-up or
    an order read through this member) must not make it crowd out an owned block. The owner
    holds the block either way; a copy in the middle of being sent keeps its bytes until the
    send ends (the store's ``hold``).

    Everything else follows the rules of ``EvictionPolicy``; anything else asked of it (an
    announced future) goes to the owned policy. ``make_policy(name, copies=True)`` builds
    one."""

    def __init__(self, owned: EvictionPolicy) -> None:
        self.owned = owned
        self.copies = LRUPolicy()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.owned.name

    @property
    def keeps_copies(self) -> bool:
        return True

    @property
    def copy_bytes(self) -> int:
        return self.copies.resident_bytes

    def insert(self, key: BlockKey, size: int, copy: bool = False) -> None:
        if copy and key not in self.owned:
            self.copies.insert(key, size)
        else:
            self.copies.remove(key)
            self.owned.insert(key, size)

    def insert_copy(self, key: BlockKey, size: int) -> None:
        """A copy of a block another member owns (owned already: stays owned)."""
        self.insert(key, size, copy=True)

    def copy_victim(self) -> BlockKey | None:
        """The next copy to leave; None when there is none (owned blocks stay)."""
        return self.copies.victim()

    def access(self, key: BlockKey) -> None:
        (self.copies if key in self.copies else self.owned).access(key)

    def remove(self, key: BlockKey) -> None:
        self.copies.remove(key)
        self.owned.remove(key)

    def victim(self, copies_only: bool = False) -> BlockKey | None:
        key = self.copies.victim()
        if key is None and not copies_only:
            key = self.owned.victim()
        return key

    def victim_for(self, dataset: str) -> BlockKey | None:
        key = self.copies.victim()
        return self.owned.victim_for(dataset) if key is None else key

    def pin(self, key: BlockKey) -> None:  # counted by the owned policy, resident there or not
        self.owned.pin(key)

    def unpin(self, key: BlockKey) -> None:
        self.owned.unpin(key)

    def pinned(self, key: BlockKey) -> bool:
        return key in self.owned and self.owned.pinned(key)

    def size_of(self, key: BlockKey) -> int | None:
        size = self.owned.size_of(key)
        return self.copies.size_of(key) if size is None else size

    def resident_keys(self) -> list[BlockKey]:
        return self.owned.resident_keys() + self.copies.resident_keys()

    def reclassify(self, keys: Iterable[BlockKey], is_copy: Callable[[BlockKey], bool]) -> int:
        """Put each of ``keys`` (resident ones; others are skipped) in the class ``is_copy``
        says: a member that restarts finds every block in its index as owned, and when
        members join or leave, blocks change owners. Pinned owned blocks stay owned. How
        many moved."""
        moved = 0
        for key in keys:
            copy = is_copy(key)
            size = self.copies.size_of(key)
            if size is not None:
                if not copy:
                    self.copies.remove(key)
                    self.owned.insert(key, size)
                    moved += 1
                continue
            size = self.owned.size_of(key)
            if size is not None and copy and not self.owned.pinned(key):
                self.owned.remove(key)
                self.copies.insert(key, size)
                moved += 1
        return moved

    def __getattr__(self, name: str) -> object:  # set_future and the like: the owned policy's
        return getattr(self.owned, name)

    def __len__(self) -> int:
        return len(self.owned) + len(self.copies)

    def __contains__(self, key: object) -> bool:
        return key in self.owned or key in self.copies

    def __repr__(self) -> str:
        return f"<CopiesFirst owned={self.owned!r} copies={self.copies!r}>"

