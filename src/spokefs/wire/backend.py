"""What the wire protocol serves, independent of where the bytes come from.

The hub (a directory on disk) and the spoke (a cache in front of an upstream) both implement
``Backend``; ``spokefs.wire.server`` turns any backend into the HTTP API of docs/protocol.md.
That is why a spoke is a valid upstream for a mount, another spoke, rclone or curl.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from prometheus_client import CollectorRegistry

from spokefs.errors import SpokeError
from spokefs.manifest import Manifest


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    name: str
    block_size: int
    latest: str | None
    snapshots: list[dict[str, object]] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "block_size": self.block_size, "latest": self.latest,
                "snapshots": self.snapshots}


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


Segment = FileSegment | bytes | memoryview


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
        return p.count if isinstance(p, FileSegment) else len(p)

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
    def read(self, name: str, version: str, start: int, end: int,
             ctx: ReadContext | None = None) -> AsyncIterator[Segment]: ...
    async def read_blocks(self, name: str, blocks: list[tuple[str, int]]
                          ) -> list[BlockPart]: ...  # whole blocks, a part per (version, idx)
    async def create_snapshot(self, name: str) -> dict[str, object]: ...
    async def status(self) -> dict[str, object]: ...


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
