"""What the wire protocol serves, independent of where the bytes come from.

The hub (a directory on disk) and the spoke (a cache in front of an upstream) both implement
``Backend``; ``spokefs.wire.server`` turns any backend into the HTTP API of docs/protocol.md.
That is why a spoke is a valid upstream for a mount, another spoke, rclone or curl.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from prometheus_client import CollectorRegistry, Counter

from spokefs.errors import NotFound, SpokeError
from spokefs.manifest import Manifest


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    name: str
    block_size: int
    latest: str | None
    snapshots: list[dict[str, object]] = field(default_factory=list)
    # Version ids are content digests (integrity.version_id): a spoke checks every block
    # against them (spoke.commitments). A bucket hub's name a listing instead.
    content_ids: bool = False
    writable: bool = False  # the hub takes uploads to it (hub/uploads.py; a spoke writes back)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "block_size": self.block_size, "latest": self.latest,
                "snapshots": self.snapshots, "content_ids": self.content_ids,
                **({"writable": True} if self.writable else {})}

    @classmethod
    def from_json(cls, doc: dict[str, object], default_block_size: int) -> DatasetInfo:
        """A dataset document from an upstream, or as a spoke kept it."""
        bs = doc.get("block_size")
        return cls(str(doc["name"]), int(bs) if isinstance(bs, int) else default_block_size,
                   doc.get("latest"),  # type: ignore[arg-type]
                   list(doc.get("snapshots") or []),  # type: ignore[call-overload]
                   doc.get("content_ids") is True, doc.get("writable") is True)


@dataclass(slots=True)
class FileSegment:
    """Bytes [offset, offset+count) of an open file; the server sends them with sendfile,
    then closes the file if ``owned`` and calls ``done`` if set (a lease ends). Opening
    before sending keeps the bytes readable even if the path is unlinked meanwhile."""

    file: BinaryIO
    offset: int
    count: int
    owned: bool = True
    done: Callable[[], None] | None = None

    def release(self) -> None:
        if self.owned:
            self.file.close()
        if self.done is not None:
            done, self.done = self.done, None
            done()


@dataclass(slots=True)
class LaterBlock:
    """A block of ``count`` bytes read, and checked, only as it is sent (``read``: its bytes,
    or None when they fail their check): a batch holds one block at a time, and a client
    that leaves mid-batch costs no reads of the rest. A block that fails as it is sent cuts
    the response (its length was announced), never sends unchecked bytes, and its reader
    asks again (docs/protocol.md, "Batch reads")."""

    count: int
    read: Callable[[], Awaitable[bytes | memoryview | None]]


Segment = FileSegment | LaterBlock | bytes | memoryview


@dataclass(slots=True)
class BlockPart:
    """One block of a batch read (``wire.frames``): its bytes, or the error that took them.
    ``payload`` is the block (status 200) or a JSON error body."""

    status: int
    payload: Segment
    object_size: int = 0
    digest: bytes = bytes(16)

    @property
    def length(self) -> int:
        p = self.payload
        return p.count if isinstance(p, FileSegment | LaterBlock) else len(p)

    @classmethod
    def error(cls, exc: SpokeError) -> BlockPart:
        return cls(exc.status, json.dumps(exc.to_json()).encode())


@dataclass(frozen=True, slots=True)
class ReadContext:
    """What a read is part of, for prediction: the file (when read by path), the reader's
    stream (``X-Spokefs-Reader``) and job (``X-Spokefs-Job``)."""

    path: str | None = None
    size: int | None = None
    reader: str = ""
    job: str = ""


class Backend(Protocol):
    role: str                      # "hub" or "spoke", shown in /v1/status and metrics
    registry: CollectorRegistry    # prometheus metrics of this service

    async def datasets(self) -> list[DatasetInfo]: ...
    async def dataset(self, name: str) -> DatasetInfo: ...           # NotFound
    async def resolve(self, name: str, snap: str) -> str: ...        # "latest" or id -> id
    def snapshots_used(self, name: str, snap_ids: list[str]) -> None: ...  # readers name them
    async def manifest_blob(self, name: str, snap_id: str) -> bytes: ...   # gzip'd JSON
    async def manifest(self, name: str, snap_id: str) -> Manifest: ...
    async def object_size(self, name: str, version: str) -> int: ...  # NotFound, VersionGone
    async def block_digest(self, name: str, version: str, index: int) -> bytes | None: ...
    # What versions commit to: {version: {"size", "digests": hex} or None}
    async def digests(self, name: str, versions: list[str]) -> dict[str, object]: ...
    def read(self, name: str, version: str, start: int, end: int,
             ctx: ReadContext | None = None) -> AsyncIterator[Segment]: ...
    async def read_blocks(self, name: str, blocks: list[tuple[str, int]]
                          ) -> list[BlockPart]: ...  # whole blocks, a part per (version, idx)
    async def create_snapshot(self, name: str) -> dict[str, object]: ...
    async def status(self) -> dict[str, object]: ...
    # Optional (``Ready``): whether it can serve now, for ``/readyz``.


class GathersCounts(Protocol):
    """A backend whose served bytes and counters come from other processes too (a spoke's
    replica workers): the API hands it its served-bytes counter and asks it to gather the
    others' counts before each scrape of ``/metrics``."""

    def attach_served(self, served: Counter) -> None: ...
    async def before_scrape(self) -> None: ...


# request[PEER_KEY]: the tier member a request came from (spoke.tier.peer_middleware sets
# it), for the backend's batch reads.
PEER_KEY = "spokefs.peer"


class Ready(Protocol):
    """A backend that can tell whether it is ready to serve (``GET /readyz``, what an
    orchestrator's readiness probe asks). Optional: a backend without it is ready whenever
    its server answers."""

    async def ready(self) -> str | None:
        """None when ready; else a short, generic reason (no dataset, path, address or
        figure: anyone may ask, without a token)."""
        ...


async def readiness(backend: object) -> str | None:
    """``backend.ready()`` where the backend has it; None (ready) where it has not."""
    ready = getattr(backend, "ready", None)
    return None if ready is None else await ready()


class ManifestMemo:
    """The few most recently used decoded manifests (a million-file one is ~100 MB)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._m: OrderedDict[tuple[str, str], Manifest] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._m

    async def get(self, name: str, snap_id: str,
                  blob: Callable[[str, str], Awaitable[bytes]]) -> tuple[Manifest, bool]:
        """(manifest, whether it was decoded now), decoding ``blob(name, snap_id)`` once."""
        key = (name, snap_id)
        m = self._m.get(key)
        if m is not None:
            self._m.move_to_end(key)
            return m, False
        m = await asyncio.to_thread(Manifest.decode, await blob(name, snap_id))
        self._m[key] = m
        while len(self._m) > self.keep:
            self._m.popitem(last=False)
        return m, True


async def bound_blocks(versions: DatasetVersions, name: str, blocks: list[tuple[str, int]]
                       ) -> tuple[list[tuple[str, int]], dict[int, BlockPart]]:
    """A batch read's blocks split into those of ``name``'s versions and error frames (by
    position) for the others (``DatasetVersions``)."""
    bad: dict[str, SpokeError] = {}
    for version in dict.fromkeys(v for v, _ in blocks):
        try:
            await versions.check(name, version)
        except NotFound as exc:
            bad[version] = exc
    if not bad:
        return blocks, {}
    errors = {i: BlockPart.error(bad[v]) for i, (v, _) in enumerate(blocks) if v in bad}
    return [b for b in blocks if b[0] not in bad], errors


def merge_parts(parts: list[BlockPart], errors: dict[int, BlockPart]) -> list[BlockPart]:
    """``bound_blocks``' error frames put back in their places among the served parts."""
    if not errors:
        return parts
    it = iter(parts)
    return [errors[i] if i in errors else next(it) for i in range(len(parts) + len(errors))]


class DatasetVersions:
    """Whether a version id is a file of a dataset: a spoke serves a block read through
    ``/v1/datasets/DS/...`` or ``/DS/...`` only then. Its cache and fetcher key blocks by
    version, and identical content has one version id in every dataset, so a block kept for
    another dataset is served here only if DS has that content too; a version learned from a
    dataset the token may not read reads nothing through this one's URL (404).

    Looked up in the manifests of the dataset's latest snapshot, the snapshots readers named
    lately (``in_use``) and the newest ``RECENT`` others; what was found is remembered
    (``KEEP`` pairs), so a read pays one dictionary look-up.
    """

    RECENT = 8
    KEEP = 1 << 18

    def __init__(self, dataset: Callable[[str], Awaitable[DatasetInfo]],
                 manifest: Callable[[str, str], Awaitable[Manifest]],
                 in_use: Callable[[str], Iterable[str]] = lambda name: ()) -> None:
        self._dataset = dataset
        self._manifest = manifest
        self._in_use = in_use
        self._known: OrderedDict[tuple[str, str], int] = OrderedDict()  # -> the file's size
        self._sets: OrderedDict[tuple[str, str], dict[str, int]] = OrderedDict()

    async def check(self, name: str, version: str) -> int:
        """The version's size; NotFound unless ``version`` is a file of dataset ``name``."""
        key = (name, version)
        size = self._known.get(key)
        if size is not None:
            return size
        info = await self._dataset(name)
        snaps = [info.latest] if info.latest else []
        snaps += list(self._in_use(name))
        snaps += [str(s.get("id")) for s in reversed(info.snapshots[-self.RECENT:])]
        for snap in dict.fromkeys(snaps):  # once each, in that order
            size = (await self._versions(name, snap)).get(version)
            if size is not None:
                self._known[key] = size
                if len(self._known) > self.KEEP:
                    self._known.popitem(last=False)
                return size
        raise NotFound(f"{version} is not a file of dataset {name!r} (in its latest or recent "
                       "snapshots)")

    async def batch_bytes(self, name: str, blocks: list[tuple[str, int]], block_size: int
                          ) -> int:
        """The bytes a batch read of ``blocks`` holds at most (another dataset's: none)."""
        total = 0
        for version, index in blocks:
            try:
                size = await self.check(name, version)
            except NotFound:
                continue
            total += max(0, min(block_size, size - index * block_size))
        return total

    async def _versions(self, name: str, snap: str) -> dict[str, int]:
        key = (name, snap)
        got = self._sets.get(key)
        if got is None:
            m = await self._manifest(name, snap)
            got = self._sets[key] = dict(zip(m.versions, m.sizes, strict=True))
            while len(self._sets) > 4:
                self._sets.popitem(last=False)
        return got
