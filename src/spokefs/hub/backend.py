"""The hub's backend: a directory tree published as snapshots (see hub/snapshot.py).

A read costs little per block: the version is a dictionary lookup (``HubState`` keeps what
reads ask in memory), the file is usually already open (a small cache of open files, each
checked against the identity it was hashed under on every read), and the bytes go out with
sendfile. Batch reads (``read_blocks``) serve many blocks per request.

The tree may change or turn hostile under a published version: a file is opened only if it is
still a regular file (no symlink followed, no FIFO or device opened blocking) with the device,
inode, size, mtime and ctime it was hashed under; anything else answers 410 ``version_gone``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO, Protocol

from prometheus_client import CollectorRegistry, Counter

from spokefs.errors import BadRequest, NotFound, SpokeError, VersionGone
from spokefs.hub.snapshot import (
    HubState,
    NotRegularFile,
    SnapshotInfo,
    StoredFile,
    identity,
    open_regular,
)
from spokefs.integrity import DIGEST_SIZE, block_count
from spokefs.manifest import Manifest
from spokefs.wire.backend import (
    BlockPart,
    DatasetInfo,
    FileSegment,
    ManifestMemo,
    ReadContext,
    Segment,
)

RESERVED_NAMES = {"v1", "metrics", "healthz", "readyz"}
OPEN_FILES = 1024      # files kept open between reads
REFRESH_EVERY = 1.0    # seconds between checks for a snapshot made by another process


class SnapshotState(Protocol):
    """What a hub keeps of a dataset (a folder's HubState, a bucket's BucketState)."""

    block_size: int

    def snapshots(self) -> list[SnapshotInfo]: ...
    def resolve(self, snap: str) -> SnapshotInfo: ...
    def manifest_path(self, snap_id: str) -> Path: ...
    def usable(self) -> str | None: ...  # blocking; None: reads can use it


class PublishedSnapshots:
    """The metadata half of a hub's Backend: datasets, snapshots, manifests. The same for a
    folder and a bucket; each says how it finds a dataset's state (``_state``)."""

    content_ids = False  # whether version ids are content digests (DatasetInfo.content_ids)

    _manifests: ManifestMemo

    def _state(self, name: str) -> SnapshotState:
        raise NotImplementedError

    def _ledgers(self) -> list[SnapshotState]:
        raise NotImplementedError

    async def ready(self) -> str | None:
        """``/readyz`` (``wire.backend.Ready``): every dataset's state open and answering."""
        def check() -> str | None:
            return next((r for r in (st.usable() for st in self._ledgers()) if r), None)

        return await asyncio.to_thread(check)

    async def dataset(self, name: str) -> DatasetInfo:
        st = self._state(name)
        snaps = st.snapshots()
        return DatasetInfo(name, st.block_size, snaps[-1].id if snaps else None,
                           [s.to_json() for s in snaps], content_ids=self.content_ids)

    async def resolve(self, name: str, snap: str) -> str:
        return self._state(name).resolve(snap).id

    def snapshots_used(self, name: str, snap_ids: list[str]) -> None:
        """A hub keeps every snapshot's manifest; which ones readers use changes nothing."""

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        st = self._state(name)
        st.resolve(snap_id)
        return await asyncio.to_thread(st.manifest_path(snap_id).read_bytes)

    async def manifest(self, name: str, snap_id: str) -> Manifest:
        return (await self._manifests.get(name, snap_id, self.manifest_blob))[0]


class HubBackend(PublishedSnapshots):
    content_ids = True  # a folder's version ids digest its content (integrity.version_id)
    role = "hub"

    def __init__(self, states: list[HubState]) -> None:
        self.states = {s.name: s for s in states}
        for name in self.states:
            if name in RESERVED_NAMES:
                raise BadRequest(f"dataset name {name!r} is reserved; pick another with --name")
        self.registry = CollectorRegistry()
        self._manifests = ManifestMemo()
        self._scan_lock = asyncio.Lock()
        # By (dataset, version): a version opened for one dataset is never served through
        # another's URL (identical content has one version id in both: each checks its own).
        self._open: OrderedDict[tuple[str, str], tuple[BinaryIO, StoredFile]] = OrderedDict()
        self._checked: dict[str, float] = {}  # dataset -> when refresh() last ran
        self.gone = Counter("spokefs_hub_versions_gone", "Reads of versions no longer on disk",
                            registry=self.registry)

    def _state(self, name: str) -> HubState:
        try:
            st = self.states[name]
        except KeyError:
            raise NotFound(f"no dataset {name!r} on this hub "
                           f"(it has: {', '.join(sorted(self.states))})") from None
        now = time.monotonic()
        if now - self._checked.get(name, 0.0) > REFRESH_EVERY:
            self._checked[name] = now
            st.refresh()  # one cheap pragma; reloads only after an outside scan
        return st

    async def datasets(self) -> list[DatasetInfo]:
        return [await self.dataset(n) for n in sorted(self.states)]

    def _ledgers(self) -> list[HubState]:  # type: ignore[override]
        return list(self.states.values())

    def _stored(self, name: str, version: str) -> StoredFile:
        st = self._state(name)
        stored = st.stored(version)
        if stored is None and st.refresh():  # maybe a snapshot another process just made
            stored = st.stored(version)
        if stored is None:
            self.gone.inc()
            raise VersionGone(f"version {version} of a file in {name!r} is no longer available "
                              "on the hub (the file changed or was deleted); "
                              "use a newer snapshot")
        return stored

    def _file(self, name: str, version: str) -> tuple[BinaryIO, StoredFile]:
        """An open file holding ``version``, checked against the identity it was hashed under
        on every read: the path must still name that inode with that size, mtime and ctime (a
        file rewritten, replaced or deleted: 410, never other bytes). The caller owns the
        returned file object (a duplicate of the cached descriptor)."""
        root = self.states[name].root
        key = (name, version)
        hit = self._open.get(key)
        if hit is not None:
            f, stored = hit
            try:
                same = identity(os.stat(os.path.join(root, stored.path),
                                        follow_symlinks=False)) == stored.identity
            except OSError:
                same = False
            if same:
                self._open.move_to_end(key)
                return os.fdopen(os.dup(f.fileno()), "rb", buffering=0), stored
            del self._open[key]
            f.close()
        stored = self._stored(name, version)
        # No realpath walk: the identity check below refuses any other file, one reached
        # through a folder swapped for a symlink to outside the dataset included.
        try:
            fd, s = open_regular(os.path.join(root, stored.path))
        except NotRegularFile as exc:
            self.gone.inc()
            raise VersionGone(f"{stored.path!r} can no longer be served: {exc}; version "
                              f"{version} is no longer available: use a newer snapshot") from exc
        except OSError as exc:
            self.gone.inc()
            raise VersionGone(f"{stored.path!r} can no longer be read: {exc.strerror}") from exc
        f = os.fdopen(fd, "rb", buffering=0)
        if identity(s) != stored.identity:
            f.close()
            self.gone.inc()
            raise VersionGone(f"{stored.path!r} changed on the hub since its snapshot; version "
                              f"{version} is no longer available: use a newer snapshot")
        self._open[key] = (f, stored)
        while len(self._open) > OPEN_FILES:
            self._open.popitem(last=False)[1][0].close()
        return os.fdopen(os.dup(f.fileno()), "rb", buffering=0), stored

    async def object_size(self, name: str, version: str) -> int:
        return self._stored(name, version).size

    async def digests(self, name: str, versions: list[str]) -> dict[str, object]:
        """What each version commits to: its size and block digests (``spoke.commitments``);
        null for a version this dataset does not have (any more)."""
        out: dict[str, object] = {}
        for v in versions:
            try:
                stored = self._stored(name, v)
            except SpokeError:
                out[v] = None
                continue
            out[v] = {"size": stored.size, "digests": stored.digests.hex()}
        return out

    async def block_digest(self, name: str, version: str, index: int) -> bytes | None:
        d = self._stored(name, version).digests
        return d[index * DIGEST_SIZE:(index + 1) * DIGEST_SIZE] or None

    async def read(self, name: str, version: str, start: int, end: int,
                   ctx: ReadContext | None = None) -> AsyncIterator[Segment]:
        f, _ = self._file(name, version)
        yield FileSegment(f, start, end - start)

    async def read_blocks(self, name: str, blocks: list[tuple[str, int]]) -> list[BlockPart]:
        bs = self._state(name).block_size
        parts: list[BlockPart] = []
        for version, index in blocks:
            try:
                f, stored = self._file(name, version)
            except SpokeError as exc:
                parts.append(BlockPart.error(exc))
                continue
            if index >= block_count(stored.size, bs):
                f.close()
                parts.append(BlockPart.error(BadRequest(
                    f"block {index} of {version} is past the end ({stored.size} bytes)")))
                continue
            start = index * bs
            parts.append(BlockPart(200, FileSegment(f, start, min(bs, stored.size - start)),
                                   stored.size,
                                   stored.digests[index * DIGEST_SIZE:(index + 1) * DIGEST_SIZE]))
        return parts

    async def create_snapshot(self, name: str) -> dict[str, object]:
        st = self._state(name)
        async with self._scan_lock:
            result = await asyncio.to_thread(st.scan)
        return {"dataset": name, "new": result.created_new,
                "files_hashed": result.files_hashed, **result.snapshot.to_json()}

    async def status(self) -> dict[str, object]:
        out = []
        for name, st in sorted(self.states.items()):
            snaps = st.snapshots()
            out.append({"name": name, "root": str(st.root), "snapshots": len(snaps),
                        "latest": snaps[-1].to_json() if snaps else None})
        return {"role": self.role, "datasets": out}


def open_state(directory: str, name: str | None, state_dir: str | None,
               block_size: int) -> HubState:
    from spokefs.hub.snapshot import default_state_dir
    from spokefs.wire.paths import check_dataset_name

    root = Path(directory).resolve()
    ds = check_dataset_name(name or root.name)
    sdir = Path(state_dir) if state_dir else default_state_dir(root, ds)
    return HubState(root, sdir, ds, block_size).open()
