"""Fair shares: a reserved share of the cache per dataset, over any eviction policy.

Sans-I/O. ``Shares`` is an ``EvictionPolicy`` that the store holds in place of its policy
(inside ``CopiesFirst`` for a tier member) only while some dataset has a reserved share
(``min_share`` in the spoke's dataset rules): without one the store keeps its plain policy and
pays nothing.

Each dataset with a reservation orders its blocks with an instance of the policy of its own
(a *class*); every other dataset's blocks stay in the one shared instance, so among them the
configured policy decides as before (belady's futures, s3fifo's queues). To make room for a
block of dataset X (``victim_for(X)``), a victim comes from:

1. a class over its ceiling (``max_bytes``, after the rules were lowered), first;
2. else whoever is furthest over its reserved share, in bytes: the shared instance (no
   reservation, so all it holds is excess) or a class above its ``min_bytes`` or idle (not
   read for ``idle_s``: an idle reservation does not waste the cache), each by its own order.
   A class in use gives nothing that would take it below its ``min_bytes``;
3. else X's own class (nothing else can go: X evicts its own blocks);
4. else nothing: the store serves the block without keeping it.

``victim()`` (no requester: the store shrinking at open) falls back to any class instead of
nothing. A dataset that gets a reservation at run time has its blocks in the shared instance:
they move to its class when they come up as a victim or are read (so the class's order starts
approximate), which keeps a rules reload O(1). A class whose reservation is removed goes back
into the shared instance in its own eviction order (``configure``); ``unwrap`` gives the shared
instance back with every pin, when no reservation is left.

Pins: ``Shares`` counts every pin it is given and lends the block's instance one pin while
the count is above 0, so a block keeps its pins as it moves. Pins the shared instance held
before ``Shares`` wrapped it stay there (an unpin ``Shares`` has no count for goes to it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from spokefs.policy.eviction import BlockKey, EvictionPolicy, KeepsNoCopies, make_policy

IDLE_S = 600.0  # a reservation is held this long after its dataset's last read (default)


@dataclass(frozen=True)
class Share:
    """One dataset's share of the cache, in bytes."""

    min_bytes: int = 0             # reserved while in use: never evicted for others' blocks
    max_bytes: int | None = None   # its ceiling (the store refuses blocks past it)
    idle_s: float = IDLE_S         # in use while read within this long


class _Class:
    """A dataset with a reservation: its blocks, in an instance of the policy of its own."""

    __slots__ = ("bytes", "dataset", "policy", "share", "used_at")

    def __init__(self, dataset: str, policy: EvictionPolicy, share: Share, now: float) -> None:
        self.dataset = dataset
        self.policy = policy
        self.share = share
        self.used_at = now  # a new reservation counts as in use for one idle window
        self.bytes = 0      # what this instance holds


class Shares(KeepsNoCopies):  # a tier member's copies live in CopiesFirst, around this
    """An ``EvictionPolicy`` with a reserved share per dataset; see the module docstring.

    ``shared``: the configured policy (it keeps the blocks of datasets without a reservation);
    ``make()``: a new instance of it, for a class (default: ``make_policy(shared.name)``);
    ``dataset_of(key)``: a resident block's dataset (asked on insert, access and eviction,
    never on remove); ``resident(dataset)``: its resident bytes wherever they sit (the store's
    count; default: the class's own, exact unless blocks were resident before the dataset got
    its reservation); ``clock``: seconds, for "in use"."""

    def __init__(self, shared: EvictionPolicy, *, dataset_of: Callable[[BlockKey], str],
                 clock: Callable[[], float], make: Callable[[], EvictionPolicy] | None = None,
                 resident: Callable[[str], int] | None = None,
                 shares: Mapping[str, Share] | None = None) -> None:
        self.shared = shared
        self.make = make or (lambda: make_policy(shared.name))
        self.dataset_of = dataset_of
        self.clock = clock
        self._resident = resident
        self._classes: dict[str, _Class] = {}
        self._class_of: dict[BlockKey, _Class] = {}
        self._pins: dict[BlockKey, int] = {}
        held = getattr(shared, "resident_bytes", None)  # it may hold blocks already
        self._shared_bytes = held if isinstance(held, int) else sum(
            shared.size_of(k) or 0 for k in shared.resident_keys())
        self._mixed = False  # blocks of a reserved dataset may still sit in the shared one
        if shares:
            self.configure(shares)

    @property
    def name(self) -> str:  # type: ignore[override]  # what the store reports: its policy
        return self.shared.name

    # -- configuration ------------------------------------------------------------------------
    @property
    def shares(self) -> dict[str, Share]:
        return {ds: c.share for ds, c in self._classes.items()}

    def configure(self, shares: Mapping[str, Share]) -> None:
        """The reservations in force (datasets with ``min_bytes`` 0 have none)."""
        now = self.clock()
        for ds, cls in list(self._classes.items()):
            share = shares.get(ds)
            if share is None or share.min_bytes <= 0:
                self._merge(cls)
        for ds, share in shares.items():
            if share.min_bytes <= 0:
                continue
            cls = self._classes.get(ds)
            if cls is None:
                self._classes[ds] = _Class(ds, self.make(), share, now)
            else:
                cls.share = share
        self._mixed = self._resident is not None and any(
            self._resident(c.dataset) > c.bytes for c in self._classes.values())

    def unwrap(self) -> EvictionPolicy:
        """The shared instance with every block and pin (the last reservation went)."""
        for cls in list(self._classes.values()):
            self._merge(cls)
        for key, n in self._pins.items():  # it holds one of them for a resident key
            for _ in range(n - 1 if key in self.shared else n):
                self.shared.pin(key)
        self._pins.clear()
        return self.shared

    def _merge(self, cls: _Class) -> None:
        """Give a class's blocks back to the shared instance, in the class's eviction order."""
        p = cls.policy
        order = []
        while (key := p.victim()) is not None:
            order.append((key, p.size_of(key) or 0))
            p.remove(key)
        order += [(key, p.size_of(key) or 0) for key in p.resident_keys()]  # pinned
        for key, size in order:
            p.remove(key)
            del self._class_of[key]
            if key in self._pins:
                self.shared.pin(key)
            self.shared.insert(key, size)
            self._shared_bytes += size
        del self._classes[cls.dataset]

    def _migrate(self, key: BlockKey, cls: _Class) -> None:
        """An unpinned block of a reserved dataset, still in the shared instance, to its class."""
        size = self.shared.size_of(key) or 0
        self.shared.remove(key)
        self._shared_bytes -= size
        cls.policy.insert(key, size)
        cls.bytes += size
        self._class_of[key] = cls

    # -- the share rules -----------------------------------------------------------------------
    def resident_bytes_of(self, dataset: str) -> int:
        cls = self._classes.get(dataset)
        if self._resident is not None:
            return self._resident(dataset)
        return cls.bytes if cls is not None else 0

    def in_use(self, dataset: str, now: float | None = None) -> bool | None:
        """Whether a reserved dataset was read within its idle window (None: no reservation)."""
        cls = self._classes.get(dataset)
        if cls is None:
            return None
        return (self.clock() if now is None else now) - cls.used_at <= cls.share.idle_s

    def last_use(self, dataset: str) -> float | None:
        cls = self._classes.get(dataset)
        return cls.used_at if cls is not None else None

    def _shared_victim(self) -> BlockKey | None:
        """The shared instance's victim, once reserved datasets' blocks in it have moved on."""
        while (key := self.shared.victim()) is not None:
            cls = self._classes.get(self.dataset_of(key))
            if cls is None:
                return key
            self._migrate(key, cls)
        return None

    def victim_for(self, dataset: str | None) -> BlockKey | None:
        """The next block to leave to make room for one of ``dataset`` (None: no requester)."""
        if self._mixed and self._resident is not None:
            self._mixed = any(self._resident(c.dataset) > c.bytes
                              for c in self._classes.values())
        now = self.clock()
        best, most = self._shared_victim(), self._shared_bytes
        own = None
        for cls in self._classes.values():
            key = cls.policy.victim()
            if key is None:
                continue
            held = self.resident_bytes_of(cls.dataset)
            share = cls.share
            if share.max_bytes is not None and held > share.max_bytes:
                return key  # over its ceiling: first
            if now - cls.used_at > share.idle_s:
                excess = held  # idle: its reservation is not held
            elif held - (cls.policy.size_of(key) or 0) >= share.min_bytes:
                excess = held - share.min_bytes
            else:  # in use and at its reservation: not for others
                if cls.dataset == dataset or dataset is None:
                    own = own or key
                continue
            if best is None or excess > most:
                best, most = key, excess
        return best if best is not None else own

    # -- the policy protocol ----------------------------------------------------------------
    def victim(self) -> BlockKey | None:
        return self.victim_for(None)

    def insert(self, key: BlockKey, size: int) -> None:
        cls = self._class_of.get(key)
        if cls is not None:  # re-insert (refetched after corruption)
            cls.bytes += size - (cls.policy.size_of(key) or 0)
            cls.policy.insert(key, size)
            cls.used_at = self.clock()
            return
        shared = self.shared
        if key not in shared and self._classes:
            cls = self._classes.get(self.dataset_of(key))
            if cls is not None and not shared.pinned(key):  # pinned there: its pin lives there
                if key in self._pins:
                    cls.policy.pin(key)
                cls.policy.insert(key, size)
                cls.bytes += size
                cls.used_at = self.clock()
                self._class_of[key] = cls
                return
        old = shared.size_of(key)
        if old is None and key in self._pins:
            shared.pin(key)
        shared.insert(key, size)
        self._shared_bytes += size - (old or 0)

    def access(self, key: BlockKey) -> None:
        cls = self._class_of.get(key)
        if cls is not None:
            cls.used_at = self.clock()
            cls.policy.access(key)
            return
        self.shared.access(key)
        if self._mixed and key in self.shared and not self.shared.pinned(key):
            cls = self._classes.get(self.dataset_of(key))
            if cls is not None:  # read: in use, and its block belongs in its class now
                cls.used_at = self.clock()
                self._migrate(key, cls)

    def remove(self, key: BlockKey) -> None:
        cls = self._class_of.pop(key, None)
        if cls is not None:
            cls.bytes -= cls.policy.size_of(key) or 0
            cls.policy.remove(key)
            if key in self._pins:
                cls.policy.unpin(key)  # the count stays here, for when it comes back
            return
        size = self.shared.size_of(key)
        if size is None:
            return
        self.shared.remove(key)
        self._shared_bytes -= size
        if key in self._pins:
            self.shared.unpin(key)

    def _holder(self, key: BlockKey) -> EvictionPolicy | None:
        cls = self._class_of.get(key)
        if cls is not None:
            return cls.policy
        return self.shared if key in self.shared else None

    def pin(self, key: BlockKey) -> None:
        n = self._pins.get(key, 0)
        self._pins[key] = n + 1
        if n == 0 and (holder := self._holder(key)) is not None:
            holder.pin(key)

    def unpin(self, key: BlockKey) -> None:
        n = self._pins.get(key, 0)
        if n == 0:
            self.shared.unpin(key)  # a pin from before the shares, or none (a no-op)
        elif n > 1:
            self._pins[key] = n - 1
        else:
            del self._pins[key]
            if (holder := self._holder(key)) is not None:
                holder.unpin(key)

    def pinned(self, key: BlockKey) -> bool:
        if key in self._pins:
            return True
        cls = self._class_of.get(key)
        return cls.policy.pinned(key) if cls is not None else self.shared.pinned(key)

    def size_of(self, key: BlockKey) -> int | None:
        cls = self._class_of.get(key)
        return (cls.policy if cls is not None else self.shared).size_of(key)

    def resident_keys(self) -> list[BlockKey]:
        return self.shared.resident_keys() + list(self._class_of)

    def __len__(self) -> int:
        return len(self.shared) + len(self._class_of)

    def __contains__(self, key: object) -> bool:
        return key in self._class_of or key in self.shared

    # -- announced futures (belady): to the instance that holds the stream's dataset ----------
    def _future_target(self, stream: str) -> EvictionPolicy:
        cls = self._classes.get(stream.split("/", 1)[0])  # streams are "dataset/job"
        return cls.policy if cls is not None else self.shared

    def set_future(self, keys: Sequence[BlockKey], stream: str = "") -> None:
        fn = getattr(self._future_target(stream), "set_future", None)
        if fn is not None:
            fn(keys, stream)

    def extend_future(self, keys: Sequence[BlockKey], stream: str = "") -> None:
        fn = getattr(self._future_target(stream), "extend_future", None)
        if fn is not None:
            fn(keys, stream)

    def __repr__(self) -> str:
        return (f"<Shares shared={self.shared!r} classes="
                f"{ {ds: c.bytes for ds, c in self._classes.items()} }>")
