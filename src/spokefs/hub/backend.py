"""The hub's backend: a directory tree published as snapshots (see hub/snapshot.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from spokefs.errors import BadRequest, NotFound, VersionGone
from spokefs.hub.snapshot import HubState
from spokefs.integrity import DIGEST_SIZE
from spokefs.manifest import Manifest
from spokefs.wire.backend import DatasetInfo, FileSegment, ManifestMemo, ReadContext, Segment

RESERVED_NAMES = {"v1", "metrics"}


class HubBackend:
    role = "hub"

    def __init__(self, states: list[HubState]) -> None:
        self.states = {s.name: s for s in states}
        for name in self.states:
            if name in RESERVED_NAMES:
                raise BadRequest(f"dataset name {name!r} is reserved; pick another with --name")
        self.registry = CollectorRegistry()
        self._manifests = ManifestMemo()
        self._scan_lock = asyncio.Lock()
        self.gone = Counter("spokefs_hub_versions_gone", "Reads of versions no longer on disk",
                            registry=self.registry)

    def _state(self, name: str) -> HubState:
        try:
            return self.states[name]
        except KeyError:
            raise NotFound(f"no dataset {name!r} on this hub "
                           f"(it has: {', '.join(sorted(self.states))})") from None

    async def datasets(self) -> list[DatasetInfo]:
        return [await self.dataset(n) for n in sorted(self.states)]

    async def dataset(self, name: str) -> DatasetInfo:
        st = self._state(name)
        snaps = st.snapshots()
        return DatasetInfo(name, st.block_size, snaps[-1].id if snaps else None,
                           [s.to_json() for s in snaps])

    async def resolve(self, name: str, snap: str) -> str:
        return self._state(name).resolve(snap).id

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        st = self._state(name)
        st.resolve(snap_id)
        return await asyncio.to_thread(st.manifest_path(snap_id).read_bytes)

    async def manifest(self, name: str, snap_id: str) -> Manifest:
        return (await self._manifests.get(name, snap_id, self.manifest_blob))[0]

    def _stored(self, name: str, version: str):
        stored = self._state(name).stored(version)
        if stored is None:
            self.gone.inc()
            raise VersionGone(f"version {version} of a file in {name!r} is no longer available "
                              "on the hub (the file changed or was deleted); "
                              "use a newer snapshot")
        return stored

    async def object_size(self, name: str, version: str) -> int:
        return self._stored(name, version).size

    async def block_digest(self, name: str, version: str, index: int) -> bytes | None:
        d = self._stored(name, version).digests
        return d[index * DIGEST_SIZE:(index + 1) * DIGEST_SIZE] or None

    async def read(self, name: str, version: str, start: int, end: int,
                   ctx: ReadContext | None = None) -> AsyncIterator[Segment]:
        st = self._state(name)
        stored = self._stored(name, version)
        path = os.path.join(st.root, stored.path)
        real = os.path.realpath(path)
        if os.path.commonpath([str(st.root), real]) != str(st.root):
            raise VersionGone(f"{stored.path!r} now points outside the dataset")
        try:
            f = open(real, "rb", buffering=0)  # noqa: SIM115 (closed by the sender)
        except OSError as exc:
            self.gone.inc()
            raise VersionGone(f"{stored.path!r} can no longer be read: {exc.strerror}") from exc
        s = os.fstat(f.fileno())
        if (s.st_ino, s.st_size, s.st_mtime_ns) != (stored.ino, stored.size, stored.mtime_ns):
            f.close()
            self.gone.inc()
            raise VersionGone(f"{stored.path!r} changed on the hub since its snapshot; version "
                              f"{version} is no longer available: use a newer snapshot")
        yield FileSegment(f, start, end - start)

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
