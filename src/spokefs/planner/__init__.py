"""The prefetch planner (sans-I/O): events in, actions out.

What it does, per (dataset, job):

1. Sequential readahead inside a file: a window that starts at one block when a file is read
   from its start, doubles per block read in sequence, and stops at ``readahead_max_bytes``
   (the link's bandwidth-delay product).
2. Working-set learning without hints: ``scan_threshold`` distinct files read once each mark
   an epoch scan; the prediction is the manifest subtree under their common directory, then
   (from the second epoch on) exactly what the last epoch read. If it fits its share of the
   cache it is fetched and pinned whole; if not, a fixed part of it is pinned (what is
   resident first, then unread files) and the rest streams through the unpinned reserve,
   which a fresh shuffle cannot beat anyway (every reuse crosses an epoch boundary, so a
   fixed resident part is hit every epoch, where LRU keeps the wrong blocks). When the part
   of an epoch left unread fits beside the pinned part, it is all fetched (endgame). At each
   epoch end a ``WorkingSetLearned`` action carries the set to persist; a
   ``WorkingSetRestored`` event takes it back and starts filling before the first read.
3. Announced order: blocks up to ``lookahead_bytes`` ahead of the reader's position are
   pinned and fetched, nearest first; each read advances the position (reads may run up to
   ``disorder_window`` positions ahead of the oldest unread one); a ``SetFuture`` action
   hands the block order to a ``belady`` eviction policy.
4. An in-flight budget: at most ``max_inflight_bytes`` of prefetches are outstanding; demand
   fetches (priority 0) are never held back and jump ahead of queued prefetches.

The parts, one module each: ``Readahead`` (readahead.py), ``OrderPlanner`` (announced.py,
over the ``OrderCursor`` of order.py), ``WorkingSetPlanner`` (learned.py, over the
``ScanState`` of workingset.py), ``Budget`` (budget.py: fetches in flight, queued
prefetches), ``PinLedger`` (pins.py: every pin, by holder); ``Planner`` (planner.py) routes
events to them. ``Interpreter`` (interpreter.py) carries actions out through injected
callbacks, for the spoke and ``bench policy`` alike.

How the spoke service drives it (``spokefs.spoke.service`` and ``spokefs.spoke.prefetch``)::

    planner = Planner(capacity=store.capacity, resident=store,   # ``Resident``: ``key in``
                      max_inflight_bytes=prefetch_inflight, readahead_max_bytes=readahead_max)
    interp = Interpreter(planner, store, fetch, cancel, loop.call_soon, loop.time, persist)
    interp.handle(ManifestAdded(dataset, Manifest.of(snapshot)))  # a snapshot resolved
    interp.handle(WorkingSetRestored(saved))       # for each persisted set, at start
    interp.handle(Read(...))                       # each block of a read, before it is sent;
                                                   # reads other processes served, when reported
    interp.finished(key, resident)                 # a fetch ended: FetchDone or FetchFailed
    interp.handle(OrderAnnounced(...))             # a client posted its order for an epoch
    interp.handle(EpochBoundary(...))              # a client said a new epoch starts
    interp.handle(JobEnded(...))                   # a client said it is done
    interp.handle(CapacityChanged(bytes))          # the cache was resized (the spoke's never is)

where the interpreter carries out, in order: ``Pin``/``Unpin`` on the store (its eviction
policy), ``Fetch`` through the spoke's fetch queue for the dataset it names (batch reads,
priority 0 first; a Fetch of a key in flight raises its priority; a key already resident is
answered ``FetchDone``), ``Cancel`` (drop it if not started, then report ``FetchFailed``),
``SetFuture`` (``policy.extend_future(keys, stream)``, or ``set_future`` when not
``append``, where the policy has them) and ``WorkingSetLearned`` (persist
``working_set.to_json()`` under (dataset, job)). The service waits for the demand blocks
of a read; every Fetch must end in FetchDone or FetchFailed. A block fetched but not
admitted (everything resident is pinned) is served from memory and reported as FetchFailed.
An event the planner refuses (a bad order) raises; what it had done before the refusal
(released idle jobs) comes with the next call's actions.
"""

from spokefs.planner.events import (
    DEMAND,
    Action,
    Cancel,
    CapacityChanged,
    EpochBoundary,
    Event,
    Evicted,
    Fetch,
    FetchDone,
    FetchFailed,
    JobEnded,
    ManifestAdded,
    OrderAnnounced,
    Pin,
    Read,
    SetFuture,
    Unpin,
    WorkingSetLearned,
    WorkingSetRestored,
)
from spokefs.planner.learned import WORKING_SET_PRIORITY
from spokefs.planner.manifest import DEFAULT_BLOCK_SIZE, Manifest
from spokefs.planner.planner import Planner, Resident, as_indexes
from spokefs.planner.workingset import WorkingSet

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEMAND",
    "WORKING_SET_PRIORITY",
    "Action",
    "Cancel",
    "CapacityChanged",
    "EpochBoundary",
    "Event",
    "Evicted",
    "Fetch",
    "FetchDone",
    "FetchFailed",
    "JobEnded",
    "Manifest",
    "ManifestAdded",
    "OrderAnnounced",
    "Pin",
    "Planner",
    "Read",
    "Resident",
    "SetFuture",
    "Unpin",
    "WorkingSet",
    "WorkingSetLearned",
    "WorkingSetRestored",
    "as_indexes",
]
