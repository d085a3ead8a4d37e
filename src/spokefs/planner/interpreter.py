"""Carrying out a planner's actions, sans-I/O: the one reading of them that the spoke
(``spokefs.spoke.prefetch``) and ``spokefs bench policy`` share, so the benchmark cannot
drift from what the spoke runs. What differs between them is injected:

- ``cache``: residency, pins and the eviction policy's announced future (``Cache``);
- ``fetch(dataset, action)``: start a ``Fetch``, or raise its priority when it is in flight;
  its end comes back as ``finished(key, resident)``;
- ``cancel(key)``: drop a queued prefetch (a dropped one ends in ``finished(key, False)``);
- ``soon(callback)``: run ``callback`` later, never inside ``Planner.handle`` (the spoke:
  the event loop's ``call_soon``);
- ``learned(action)``: persist a ``WorkingSetLearned`` (None: nothing to keep);
- ``clock()``: the ``now`` of the events it makes.

Every Fetch ends in exactly one FetchDone or FetchFailed: a Fetch of a key already resident
is answered FetchDone, one with no dataset to fetch from FetchFailed (both on ``soon``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from spokefs.planner.events import (
    Action,
    Cancel,
    Event,
    Fetch,
    FetchDone,
    FetchFailed,
    Pin,
    SetFuture,
    Unpin,
    WorkingSetLearned,
)
from spokefs.planner.planner import Planner
from spokefs.policy import BlockKey


class Cache(Protocol):
    def __contains__(self, key: object, /) -> bool: ...
    def pin(self, key: BlockKey) -> None: ...
    def unpin(self, key: BlockKey) -> None: ...
    def set_future(self, keys: Sequence[BlockKey], stream: str, append: bool = False
                   ) -> None: ...


class Interpreter:
    def __init__(self, planner: Planner, cache: Cache,
                 fetch: Callable[[str, Fetch], None],
                 cancel: Callable[[BlockKey], object],
                 soon: Callable[[Callable[[], None]], object],
                 clock: Callable[[], float],
                 learned: Callable[[WorkingSetLearned], None] | None = None) -> None:
        self.planner = planner
        self.cache = cache
        self.fetch = fetch
        self.cancel = cancel
        self.soon = soon
        self.clock = clock
        self.learned = learned
        self.fetching: dict[BlockKey, str] = {}  # the planner's fetches in flight -> dataset
        self._later: list[tuple[Event, str | None]] = []

    def handle(self, event: Event, dataset: str | None = None) -> None:
        """Tell the planner and carry out what it answers."""
        self.act(self.planner.handle(event), dataset)

    def finished(self, key: BlockKey, resident: bool) -> None:
        """A fetch ended: ``resident`` when its block is now in the cache."""
        ds = self.fetching.pop(key, None)
        if ds is None:
            return  # a fetch the planner did not ask for
        now = self.clock()
        self.handle(FetchDone(key, now) if resident else FetchFailed(key, now), ds)

    def act(self, actions: Iterable[Action], dataset: str | None = None) -> None:
        cache = self.cache
        for a in actions:
            if isinstance(a, Fetch):
                ds = a.dataset or dataset or self.fetching.get(a.key)
                if ds is None:
                    self._answer(FetchFailed(a.key, self.clock()), None)
                    continue
                if a.key in cache:
                    self._answer(FetchDone(a.key, self.clock()), ds)
                    continue
                self.fetching[a.key] = ds
                self.fetch(ds, a)
            elif isinstance(a, Cancel):
                self.cancel(a.key)
            elif isinstance(a, Pin):
                cache.pin(a.key)
            elif isinstance(a, Unpin):
                cache.unpin(a.key)
            elif isinstance(a, SetFuture):
                cache.set_future(a.keys, a.stream, a.append)  # a stream per job
            elif isinstance(a, WorkingSetLearned) and self.learned is not None:
                self.learned(a)

    def _answer(self, event: Event, dataset: str | None) -> None:
        # Answered later, never re-entering the planner while its actions are carried out:
        # queued, and delivered by one callback however many there are.
        if not self._later:
            self.soon(self._deliver)
        self._later.append((event, dataset))

    def _deliver(self) -> None:
        later, self._later = self._later, []
        for event, dataset in later:
            self.handle(event, dataset)
