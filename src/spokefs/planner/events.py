"""What goes into the planner (events) and what comes out (actions). Plain frozen records.

``now`` is the caller's clock in seconds (monotonic); the planner never reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spokefs.policy import BlockKey

if TYPE_CHECKING:
    from spokefs.planner.manifest import Manifest
    from spokefs.planner.workingset import WorkingSet

# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManifestAdded:
    """``dataset`` now resolves to this snapshot (learning and announced orders need it).
    A learner or order built on the dataset's earlier snapshot stops matching reads."""

    dataset: str
    manifest: Manifest = field(repr=False)
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkingSetRestored:
    """A working set persisted from a ``WorkingSetLearned``: fill it before the first read.
    Its dataset's manifest must have been added. A dict is ``WorkingSet.to_json()``'s."""

    working_set: WorkingSet | dict[str, Any]
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class Read:
    """A reader asked for bytes [offset, offset+length) of a file.

    ``reader_id`` names one sequential stream (a DataLoader worker, a FUSE file handle);
    ``job`` names the training job when the client says so ("" otherwise): announced orders
    and learned working sets belong to a (dataset, job).
    """

    dataset: str
    path: str
    version: str
    size: int
    offset: int
    length: int
    reader_id: str | int = 0
    job: str = ""
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class FetchDone:
    """A block the planner asked for is resident (verified and indexed)."""

    key: BlockKey
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class FetchFailed:
    """A fetch the planner asked for gave up (upstream error, cancelled, not admitted)."""

    key: BlockKey
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class Evicted:
    """A block left the cache (evicted, purged, corrupt). Needed only when the planner keeps
    its own residency set (no ``resident`` view given)."""

    key: BlockKey
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class OrderAnnounced:
    """A client announced the order it will read in ``epoch``.

    ``files`` are indexes into the dataset's manifest (compact: an ``array('l')`` of a
    million entries is 8 MB) or paths. ``ranges``, when given, holds one (offset, length) per
    entry for readers of samples inside larger files (shards); otherwise whole files.
    A later epoch of the same job extends the order: the reader runs from one into the next.
    """

    dataset: str
    job: str
    epoch: int
    files: Sequence[int] | Sequence[str]
    ranges: Sequence[tuple[int, int]] | None = None
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class EpochBoundary:
    """The client says a new epoch starts (without announcing its order)."""

    dataset: str
    job: str
    epoch: int
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class JobEnded:
    """The job is gone: release what the planner holds for it (pins, orders, fills)."""

    dataset: str
    job: str
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class CapacityChanged:
    """The cache's capacity in bytes, when it changes from the ``capacity`` the planner was
    built with (the spoke never sends it: its capacity is fixed; bench policy sends it at start)."""

    capacity: int
    now: float = 0.0


Event = (
    Read | FetchDone | FetchFailed | Evicted | OrderAnnounced | EpochBoundary | JobEnded
    | CapacityChanged | ManifestAdded | WorkingSetRestored
)  # fmt: skip

# -- actions ---------------------------------------------------------------------------------

DEMAND = 0  # the priority of a block a reader is waiting for


@dataclass(frozen=True, slots=True)
class Fetch:
    """Fetch block ``key`` (``size`` bytes). Lower ``priority`` first; 0 is a reader waiting.
    A Fetch for a key already in flight raises its priority (a prefetch the reader caught).
    ``dataset``: whose block it is (the upstream to ask, the dataset's cache rules); a fetch
    may be issued while another dataset's event is handled."""

    key: BlockKey
    size: int
    priority: int
    reason: str  # "demand", "readahead", "order", "working-set"
    dataset: str = ""


@dataclass(frozen=True, slots=True)
class Cancel:
    """An in-flight prefetch is no longer wanted; drop it if it has not started."""

    key: BlockKey


@dataclass(frozen=True, slots=True)
class Pin:
    """Ask the eviction policy to keep ``key`` (pins nest; see spokefs.policy)."""

    key: BlockKey


@dataclass(frozen=True, slots=True)
class Unpin:
    key: BlockKey


@dataclass(frozen=True, slots=True)
class SetFuture:
    """Block keys in the order a job will read them, for a policy that can use them:
    ``belady``'s ``extend_future(keys, stream)``, or ``set_future(keys, stream)`` when not
    ``append`` (empty ``keys``: forget the stream). ``stream`` is "dataset/job"."""

    keys: Sequence[BlockKey]
    append: bool = True
    stream: str = ""


@dataclass(frozen=True, slots=True)
class WorkingSetLearned:
    """A job finished an epoch: persist ``working_set`` (``WorkingSet.to_json()``) under
    (dataset, job) and send it back as ``WorkingSetRestored`` when the job comes back."""

    dataset: str
    job: str
    working_set: Any = field(repr=False)


Action = Fetch | Cancel | Pin | Unpin | SetFuture | WorkingSetLearned
