"""The hub's backend: one ``Backend`` over a namespace of datasets, each a ledger over an
origin (a folder: ``hub/snapshot.py``'s ``HubState``; an object store: ``hub/bucket.py``'s
``BucketState``), added and removed while it serves (``hub/namespace.py``).

What differs by origin is only how a block is read (``FolderReads``, here; ``BucketReads`` in
``hub/bucket.py``); datasets, snapshots, manifests, versions, snapshots on request and status
are one code path.

A folder's read costs little per block: the version is a dictionary lookup (the ledger keeps
what reads ask in memory), the file is usually already open (a small cache of open files,
each checked against the identity it was hashed under on every read), and the bytes go out
with sendfile. Batch reads (``read_blocks``) serve many blocks per request. The tree may
change or turn hostile under a published version: a file is opened only if it is still a
regular file (no symlink followed, no FIFO or device opened blocking) with the device, inode,
size, mtime and ctime it was hashed under; anything else answers 410 ``version_gone``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from prometheus_client import CollectorRegistry, Counter

from spokefs.errors import BadRequest, Forbidden, NotFound, SpokeError, VersionGone
from spokefs.hub.snapshot import HubState, SnapshotLedger, StoredFile
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
OPEN_FILES = 1024      # files kept open between reads, all datasets together
REFRESH_EVERY = 1.0    # seconds between checks for a snapshot made by another process


class HubCounters:
    """The hub's metrics, shared by every dataset's reads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.gone = Counter("spokefs_hub_versions_gone", "Reads of versions no longer at the "
                            "origin as snapshotted", registry=r)
        self.origin_gets = Counter("spokefs_hub_origin_gets", "Ranged GETs sent to object "
                                   "stores", registry=r)
        self.origin_bytes = Counter("spokefs_hub_origin_bytes", "Bytes read from object "
                                    "stores", registry=r)
        self.mismatches = Counter("spokefs_hub_digest_mismatches", "Blocks whose bytes "
                                  "differed from their recorded digest (not served)",
                                  registry=r)
        # Writes to writable datasets (hub/routes.py).
        self.upload_bytes = Counter("spokefs_hub_upload_bytes", "Bytes received into "
                                    "uploads and flushed", ["dataset"], registry=r)
        self.uploads_refused = Counter("spokefs_hub_uploads_refused", "Uploads refused: "
                                       "their bytes were not the version declared "
                                       "(digest_mismatch) or had no room (no_space)",
                                       ["dataset", "reason"], registry=r)
        self.committed_files = Counter("spokefs_hub_committed_files", "Files published by "
                                       "commits", ["dataset"], registry=r)


class DatasetReads(Protocol):
    """How one dataset's blocks are read (by the kind of its origin)."""

    async def digests(self, version: str) -> dict[str, object] | None: ...
    async def block_digest(self, version: str, index: int) -> bytes | None: ...
    def read(self, version: str, start: int, end: int) -> AsyncIterator[Segment]: ...
    async def read_blocks(self, blocks: list[tuple[str, int]]) -> list[BlockPart]: ...
    def status(self, snap_id: str | None) -> dict[str, object]: ...  # extra status keys
    async def close(self) -> None: ...


class FolderReads:
    """A folder dataset's blocks: sent from open files, checked against their identity."""

    def __init__(self, hub: HubBackend, st: HubState) -> None:
        self.hub = hub
        self.st = st

    def _file(self, version: str) -> tuple[BinaryIO, StoredFile]:
        """An open file holding ``version``, checked against the identity it was hashed under
        on every read: the path must still name that inode with that size, mtime and ctime (a
        file rewritten, replaced or deleted: 410, never other bytes). The caller owns the
        returned file object (a duplicate of the cached descriptor)."""
        opened = self.hub._open
        key = (self.st.name, version)
        hit = opened.get(key)
        if hit is not None:
            f, stored = hit
            if self.st.origin.identity(stored.path) == stored.identity:
                opened.move_to_end(key)
                return os.fdopen(os.dup(f.fileno()), "rb", buffering=0), stored
            del opened[key]
            f.close()
        stored = self.hub._stored(self.st.name, version)
        try:
            fd = self.st.origin.open_checked(stored.path, stored.identity, version)
        except VersionGone:
            self.hub.counters.gone.inc()
            raise
        f = os.fdopen(fd, "rb", buffering=0)
        opened[key] = (f, stored)
        while len(opened) > OPEN_FILES:
            opened.popitem(last=False)[1][0].close()
        return os.fdopen(os.dup(f.fileno()), "rb", buffering=0), stored

    async def digests(self, version: str) -> dict[str, object] | None:
        """What a version commits to: its size and block digests (``spoke.commitments``)."""
        try:
            stored = self.hub._stored(self.st.name, version)
        except SpokeError:
            return None
        return {"size": stored.size, "digests": stored.digests.hex()}

    async def block_digest(self, version: str, index: int) -> bytes | None:
        d = self.hub._stored(self.st.name, version).digests
        return d[index * DIGEST_SIZE:(index + 1) * DIGEST_SIZE] or None

    async def read(self, version: str, start: int, end: int) -> AsyncIterator[Segment]:
        f, _ = self._file(version)
        yield FileSegment(f, start, end - start)

    async def read_blocks(self, blocks: list[tuple[str, int]]) -> list[BlockPart]:
        bs = self.st.block_size
        parts: list[BlockPart] = []
        for version, index in blocks:
            try:
                f, stored = self._file(version)
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

    def status(self, snap_id: str | None) -> dict[str, object]:
        return {}

    async def close(self) -> None:
        """Its open files closed (a reader mid-send holds its own duplicate)."""
        for key in [k for k in self.hub._open if k[0] == self.st.name]:
            self.hub._open.pop(key)[0].close()


class PublishedSnapshots:
    """The metadata half of a hub's Backend: datasets, snapshots, manifests, from ledgers."""

    _manifests: ManifestMemo

    def _state(self, name: str) -> SnapshotLedger:
        raise NotImplementedError

    def _ledgers(self) -> list[SnapshotLedger]:
        raise NotImplementedError

    async def ready(self) -> str | None:
        """``/readyz`` (``wire.backend.Ready``): every dataset's state open and answering."""
        ledgers = self._ledgers()

        def check() -> str | None:
            return next((r for r in (st.usable() for st in ledgers) if r), None)

        return await asyncio.to_thread(check)

    async def dataset(self, name: str) -> DatasetInfo:
        st = self._state(name)
        snaps = st.snapshots()
        return DatasetInfo(name, st.block_size, snaps[-1].id if snaps else None,
                           [s.to_json() for s in snaps], content_ids=st.content_ids,
                           writable=isinstance(st, HubState) and st.writable)

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
    """Every dataset of a hub, whatever its origin; datasets come and go (``add``,
    ``remove``) while it serves."""

    role = "hub"

    def __init__(self, states: list[SnapshotLedger]) -> None:
        self.counters = HubCounters()
        self.registry = self.counters.registry
        self.gone = self.counters.gone
        self.states: dict[str, SnapshotLedger] = {}
        self._reads: dict[str, DatasetReads] = {}
        self._removed: set[str] = set()  # names taken out while serving: a clearer 404
        self._manifests = ManifestMemo()
        self._scan_lock = asyncio.Lock()
        # By (dataset, version): a version opened for one dataset is never served through
        # another's URL (identical content has one version id in both: each checks its own).
        self._open: OrderedDict[tuple[str, str], tuple[BinaryIO, StoredFile]] = OrderedDict()
        self._checked: dict[str, float] = {}  # dataset -> when refresh() last ran
        for st in states:
            self.add(st)

    # -- the namespace -----------------------------------------------------------------------
    def add(self, st: SnapshotLedger) -> None:
        """Serve ``st`` (opened, scanned) from now on: one assignment on the event loop."""
        if st.name in RESERVED_NAMES:
            raise BadRequest(f"dataset name {st.name!r} is reserved; pick another with --name")
        if st.name in self.states:
            raise BadRequest(f"a second dataset named {st.name!r}")
        if isinstance(st, HubState):
            reads: DatasetReads = FolderReads(self, st)
        else:
            from spokefs.hub.bucket import BucketReads, BucketState

            assert isinstance(st, BucketState)
            reads = BucketReads(self.counters, st)
        self._reads[st.name] = reads
        self.states[st.name] = st
        self._removed.discard(st.name)

    async def remove(self, name: str) -> SnapshotLedger:
        """Stop serving ``name``: its readers get 404 from the next request on (a send in
        progress finishes from its open file). The caller closes the ledger."""
        st = self.states.pop(name)
        self._removed.add(name)
        self._checked.pop(name, None)
        await self._reads.pop(name).close()
        return st

    def _state(self, name: str) -> SnapshotLedger:
        try:
            st = self.states[name]
        except KeyError:
            if name in self._removed:
                raise NotFound(f"dataset {name!r} was removed from this hub") from None
            raise NotFound(f"no dataset {name!r} on this hub "
                           f"(it has: {', '.join(sorted(self.states)) or 'none'})") from None
        now = time.monotonic()
        if now - self._checked.get(name, 0.0) > REFRESH_EVERY:
            self._checked[name] = now
            st.refresh()  # one cheap pragma; reloads only after an outside scan
        return st

    def _of(self, name: str) -> DatasetReads:
        self._state(name)
        return self._reads[name]

    async def datasets(self) -> list[DatasetInfo]:
        return [await self.dataset(n) for n in sorted(self.states)]

    def _ledgers(self) -> list[SnapshotLedger]:
        return list(self.states.values())

    # -- versions and blocks -----------------------------------------------------------------
    def _stored(self, name: str, version: str) -> Any:
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

    async def object_size(self, name: str, version: str) -> int:
        return int(self._stored(name, version).size)

    async def digests(self, name: str, versions: list[str]) -> dict[str, object]:
        """What each version commits to: null for a version this dataset does not have (any
        more), and for every version of an origin whose ids name a listing."""
        reads = self._of(name)
        return {v: await reads.digests(v) for v in versions}

    async def block_digest(self, name: str, version: str, index: int) -> bytes | None:
        return await self._of(name).block_digest(version, index)

    async def read(self, name: str, version: str, start: int, end: int,
                   ctx: ReadContext | None = None) -> AsyncIterator[Segment]:
        async for seg in self._of(name).read(version, start, end):
            yield seg

    async def read_blocks(self, name: str, blocks: list[tuple[str, int]]) -> list[BlockPart]:
        return await self._of(name).read_blocks(blocks)

    # -- writes (hub/uploads.py) -------------------------------------------------------------
    def writable(self, name: str) -> HubState:
        """``name``'s ledger if it takes uploads; Forbidden (whatever the token) if not."""
        st = self._state(name)
        if not (isinstance(st, HubState) and st.writable):
            raise Forbidden(f"dataset {name!r} is read-only on this hub: a writable dataset is a "
                            f"folder declared so (writable = true in its [datasets.{name}] "
                            f"table, or --writable {name})")
        return st

    async def commit(self, name: str, paths: list[str] | None, prefix: str | None
                     ) -> dict[str, object]:
        """Whole uploads published together as one new snapshot (in the scans' turn)."""
        st = self.writable(name)
        async with self._scan_lock:
            result, chosen = await asyncio.to_thread(st.commit, paths, prefix)
        self.counters.committed_files.labels(name).inc(len(chosen))
        return {"dataset": name, "committed": chosen, "new": result.created_new,
                "files_hashed": result.files_hashed, **result.snapshot.to_json()}

    # -- snapshots and status ----------------------------------------------------------------
    async def create_snapshot(self, name: str) -> dict[str, object]:
        st = self._state(name)
        async with self._scan_lock:
            result = await asyncio.to_thread(st.scan)
        return {"dataset": name, "new": result.created_new,
                "files_hashed": result.files_hashed, **result.snapshot.to_json()}

    async def status(self) -> dict[str, object]:
        out = []
        for name, st in sorted(self.states.items()):
            doc = st.status()
            latest = doc.get("latest")
            extra = self._reads[name].status(latest["id"] if isinstance(latest, dict)
                                             else None)
            if isinstance(st, HubState) and st.writable and st.uploads is not None:
                ups = await asyncio.to_thread(st.uploads.listing)
                extra = {**extra, "writable": True, "uploads": {
                    "files": len(ups), "whole": sum(u["whole"] for u in ups),
                    "bytes_received": sum(u["received"] for u in ups)}}
            out.append({**doc, **extra})
        return {"role": self.role, "datasets": out}

    async def close(self) -> None:
        for reads in self._reads.values():
            await reads.close()


def open_state(directory: str, name: str | None, state_dir: str | None,
               block_size: int, writable: bool = False) -> HubState:
    from spokefs.hub.snapshot import default_state_dir, folder_tag
    from spokefs.wire.paths import check_dataset_name

    root = Path(directory).resolve()
    ds = check_dataset_name(name or root.name)
    sdir = Path(state_dir) if state_dir else default_state_dir(folder_tag(root), ds)
    return HubState(root, sdir, ds, block_size, writable).open()
