"""The spoke's twin of its upstream's published snapshots: dataset info, manifests, which
snapshots readers use, and what each file version commits to.

Dataset info is trusted for ``latest_ttl`` seconds, then asked again; manifests are immutable
and kept on disk (checked against their snapshot id when loaded), so a restarted spoke
serves what it has even while the upstream is down: a dataset it saw before is then served
from its last known state (and marked *unconfirmed*: nothing leaves the cache on a guess).
Every snapshot a reader names (a read, a manifest, an order, a mount's report) counts as in
use from then on; ``spoke.retention`` keeps their files cached.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spokefs.cache.durable import load_manifest_checked, store_manifest
from spokefs.cache.store import BlockStore
from spokefs.errors import BadUpstream, NotFound, SpokeError, Transient, UpstreamUnavailable
from spokefs.integrity import DEFAULT_BLOCK_SIZE
from spokefs.manifest import Manifest, is_snapshot_id
from spokefs.retry import UPSTREAM, retrying
from spokefs.spoke.commitments import Commitments
from spokefs.spoke.metrics import SpokeMetrics
from spokefs.spoke.upstreams import Routes
from spokefs.tasks import Tasks
from spokefs.wire.backend import DatasetInfo, DatasetVersions, ManifestMemo
from spokefs.wire.client import UpstreamClient

log = logging.getLogger(__name__)


class Metadata:
    """Dataset info, manifests and snapshots in use, from the upstream and kept on disk.
    ``on_manifest(m)`` hears every manifest decoded here (the planner's, when it runs)."""

    def __init__(self, routes: Routes, upstreams: Sequence[UpstreamClient], store: BlockStore,
                 tasks: Tasks, metrics: SpokeMetrics, *, deadline: float,
                 latest_ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.routes = routes        # which upstream serves which dataset (spoke.upstreams)
        self.upstreams = upstreams  # one client each, in the routes' order
        self.store = store  # the manifests' folder and small facts (dataset info) kept there
        self.tasks = tasks
        self.metrics = metrics
        self.deadline = deadline
        self.latest_ttl = latest_ttl
        self.clock = clock
        self.on_manifest: Callable[[Manifest], None] | None = None
        self.last_error: str | None = None  # the last transient failure, until a success
        # Snapshots readers named lately: (dataset, snapshot id) -> when (``clock``). With
        # each dataset's latest, they say which file versions are in use (spoke.retention).
        self.used: dict[tuple[str, str], float] = {}
        self.unconfirmed: set[str] = set()  # datasets whose latest upstream could not confirm
        self._datasets: dict[str, tuple[float, DatasetInfo]] = {}
        self._manifests = ManifestMemo()
        # One upstream fetch of a manifest however many ask at once, and one decode for the
        # planner per client that fetched it (see manifest_blob).
        self._blob_loads: dict[tuple[str, str], asyncio.Task[bytes]] = {}
        self._telling: set[tuple[str, str]] = set()
        self.versions = DatasetVersions(self.dataset, self.manifest, self.in_use)
        self.commitments = Commitments(self.known, self.dataset, self.upstream_digests)

    def upstream(self, name: str) -> tuple[UpstreamClient, str]:
        """The client and URL of the upstream serving ``name``; NotFound when none does."""
        i = self.routes.index(name)
        if i is None:
            raise NotFound(f"dataset {name!r} is served by no upstream of this spoke")
        return self.upstreams[i], self.routes.specs[i].url

    async def retrying(self, up: str, what: str, fn: Any, *args: Any) -> Any:
        """Call an upstream coroutine, retrying transient failures with backoff until the
        deadline; then UpstreamUnavailable naming the upstream (``up``) and the cause."""
        def failed(exc: Transient) -> None:
            self.metrics.upstream_errors.labels("transient").inc()
            self.last_error = str(exc)

        dl = self.deadline
        result = await retrying(
            lambda: fn(*args), UPSTREAM.within(dl), on_transient=failed,
            give_up=lambda cause: UpstreamUnavailable(
                f"upstream {up} unreachable for {dl:g}s while fetching {what}: {cause}",
                up, cause))
        self.last_error = None
        return result

    # -- datasets ----------------------------------------------------------------------------
    async def dataset(self, name: str) -> DatasetInfo:
        now = self.clock()
        cached = self._datasets.get(name)
        if cached is not None and now - cached[0] < self.latest_ttl:
            return cached[1]
        client, url = self.upstream(name)
        try:
            doc = await client.get_json(f"/v1/datasets/{name}")
        except Transient as exc:
            # Upstream down: keep serving with what we knew (memory, then disk).
            stale = cached[1] if cached else self._persisted(name)
            if stale is not None:
                self.unconfirmed.add(name)
                log.warning("upstream down (%s); using the last known state of %r", exc, name)
                self._datasets[name] = (now, stale)  # ask again after the ttl, not per read
                return stale
            raise UpstreamUnavailable(
                f"upstream {url} is unreachable and dataset {name!r} was "
                f"never seen by this spoke: {exc}", url, str(exc)) from exc
        info = DatasetInfo.from_json(doc, DEFAULT_BLOCK_SIZE)
        self._datasets[name] = (now, info)
        self.unconfirmed.discard(name)
        self.store.kv_set(f"dataset:{name}", json.dumps(info.to_json()), soon=True)
        return info

    def forget(self, name: str) -> None:
        """The dataset's info asked again at its next use (a commit made it stale)."""
        self._datasets.pop(name, None)

    def known(self, name: str) -> DatasetInfo | None:
        """The dataset's info as this spoke has it now (memory, then disk); no I/O upstream."""
        cached = self._datasets.get(name)
        return cached[1] if cached is not None else self._persisted(name)

    def block_size(self, name: str) -> int | None:
        """The dataset's block size if its info is in memory (None: not asked for yet)."""
        cached = self._datasets.get(name)
        return cached[1].block_size if cached is not None else None

    def _persisted(self, name: str) -> DatasetInfo | None:
        raw = self.store.kv_get(f"dataset:{name}")
        if raw is None:
            return None
        return DatasetInfo.from_json(json.loads(raw), DEFAULT_BLOCK_SIZE)

    async def datasets(self) -> list[DatasetInfo]:
        """Every upstream's list, each name from the upstream that serves it (another's
        list may name it too). With several upstreams, one that stays down past the deadline
        contributes the datasets this spoke saw of it before (their last known state, as a
        read would get); with one, its failure is the answer."""
        async def listed(i: int) -> list[str]:
            url = self.routes.specs[i].url
            try:
                doc = await self.retrying(url, "the dataset list", self.upstreams[i].get_json,
                                          "/v1/datasets")
            except UpstreamUnavailable as exc:
                if len(self.upstreams) == 1:
                    raise
                log.warning("dataset list without upstream %s's live list: %s", url, exc)
                return sorted(n for n in self.kept_datasets() if self.routes.serves(i, n))
            return [str(d["name"]) for d in doc["datasets"]]

        names = await asyncio.gather(*(listed(i) for i in range(len(self.upstreams))))
        out: list[DatasetInfo] = []
        for i, some in enumerate(names):
            for name in some:
                if self.routes.serves(i, name):
                    try:
                        out.append(await self.dataset(name))
                    except UpstreamUnavailable:
                        if len(self.upstreams) == 1:
                            raise  # else: down, and never seen here: not listed
        return out

    async def create_snapshot(self, name: str) -> dict[str, object]:
        # Snapshots are the hub's to make; forward, so `spokefs` commands work via a spoke.
        client, _ = self.upstream(name)
        doc = await client.post_json(f"/v1/datasets/{name}/snapshots", {})
        self._datasets.pop(name, None)
        return doc

    # -- snapshots ---------------------------------------------------------------------------
    async def resolve(self, name: str, snap: str) -> str:
        """A snapshot's id (``snap``: an id or "latest"); it counts as in use from now."""
        snap_id = await self._resolve(name, snap)
        self.used[(name, snap_id)] = self.clock()
        return snap_id

    def snapshots_used(self, name: str, snap_ids: list[str]) -> None:
        """Readers elsewhere (a mount's short circuit, a replica worker) use these."""
        now = self.clock()
        for snap_id in snap_ids:
            if is_snapshot_id(snap_id):  # not "latest": that is always in use
                self.used[(name, snap_id)] = now

    def in_use(self, name: str) -> list[str]:
        return [snap for (ds, snap) in self.used if ds == name]

    async def _resolve(self, name: str, snap: str) -> str:
        info = await self.dataset(name)
        if snap == "latest":
            if info.latest is None:
                raise NotFound(f"dataset {name!r} has no snapshot yet")
            return info.latest
        if any(s.get("id") == snap for s in info.snapshots) or (
                is_snapshot_id(snap) and self._manifest_file(name, snap).exists()):
            return snap
        # Maybe newer than our cached dataset info: ask upstream (404 if unknown there too).
        self._datasets.pop(name, None)
        info = await self.dataset(name)
        if any(s.get("id") == snap for s in info.snapshots):
            return snap
        raise NotFound(f"dataset {name!r} has no snapshot {snap!r}")

    # -- manifests ---------------------------------------------------------------------------
    def _manifest_file(self, name: str, snap_id: str) -> Path:
        # Both names may have come from upstream (a dataset's "latest"): checked, then joined.
        return self.store.manifest_path(name, snap_id)

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        key = (name, snap_id)
        self.used[key] = self.clock()  # a client will read from it
        if (self.on_manifest is not None and key not in self._manifests
                and key not in self._telling):
            # A client that fetched the manifest will read from it: let the planner know it.
            # (manifest() loads through _manifest_blob, not here: before, each load spawned
            # another until the first was decoded -- a mount's start fetched a 113 KB
            # manifest 30-64 times over the link, 3.5-8 MB on 30-64 new connections.)
            self._telling.add(key)
            self.tasks.spawn(self.manifest(name, snap_id), "decode-manifest",
                             quiet=(SpokeError,)).add_done_callback(
                lambda _t: self._telling.discard(key))
        return await self._manifest_blob(name, snap_id)

    async def _manifest_blob(self, name: str, snap_id: str) -> bytes:
        """The manifest's bytes from disk or upstream; concurrent callers share one load."""
        key = (name, snap_id)
        load = self._blob_loads.get(key)
        if load is None:
            load = self._blob_loads[key] = self.tasks.spawn(
                self._load_manifest_blob(name, snap_id), "load-manifest", quiet=(SpokeError,))
            load.add_done_callback(lambda _t: self._blob_loads.pop(key, None))
        return await asyncio.shield(load)

    async def _load_manifest_blob(self, name: str, snap_id: str) -> bytes:
        path = self._manifest_file(name, snap_id)
        # A kept copy is served only if it decodes and matches its snapshot id; a damaged one
        # is deleted (None) and fetched again.
        blob = await asyncio.to_thread(load_manifest_checked, path, snap_id, name)
        if blob is not None:
            return blob
        client, url = self.upstream(name)
        blob = await self.retrying(url, f"the manifest of {name}@{snap_id}",
                                   client.manifest_blob, name, snap_id)
        try:
            # Checked first (ManifestError, a 502: nothing kept, nothing served), then
            # written durably (temporary file, fsync, rename, fsync of the folder).
            await asyncio.to_thread(store_manifest, path, blob, snap_id, name)
        except OSError as exc:
            log.warning("cannot keep manifest %s@%s on disk: %s", name, snap_id, exc)
        return blob

    async def manifest(self, name: str, snap_id: str) -> Manifest:
        m, new = await self._manifests.get(name, snap_id, self._manifest_blob)
        if new and self.on_manifest is not None:
            self.on_manifest(m)
        return m

    async def latest_manifest(self, name: str) -> Manifest | None:
        info = await self.dataset(name)
        return None if info.latest is None else await self.manifest(name, info.latest)

    def kept_snapshots(self, name: str) -> list[str]:
        """The snapshots of ``name`` whose manifests are kept on disk, by id."""
        folder = self.store.root / "manifests" / name
        return [p.name.removesuffix(".json.gz") for p in sorted(folder.glob("*.json.gz"))]

    def kept_datasets(self) -> set[str]:
        """The datasets with a folder of kept manifests."""
        folder = self.store.root / "manifests"
        return {p.name for p in folder.glob("*") if p.is_dir()}

    # -- what versions commit to -------------------------------------------------------------
    async def upstream_digests(self, name: str, versions: list[str]) -> dict[str, object]:
        client, url = self.upstream(name)
        doc = await self.retrying(url, f"the digests of {len(versions)} versions",
                                  client.post_json, f"/v1/datasets/{name}/digests",
                                  {"versions": versions})
        got = doc.get("digests") if isinstance(doc, dict) else None
        if not isinstance(got, dict):
            raise BadUpstream("the upstream's digests answer is malformed")
        return got

    async def digests(self, name: str, versions: list[str]) -> dict[str, object]:
        """What each version commits to, for a downstream spoke: learned from the upstream
        (and checked against the version id) once, then from memory."""
        out: dict[str, object] = {}
        for v in versions:
            try:
                await self.versions.check(name, v)
                await self.commitments.learn(name, v)
            except NotFound:
                out[v] = None
                continue
            c = self.commitments.digests_of(v)
            if c is None:  # one block: the upstream's list, as it said (checked on use)
                got = (await self.upstream_digests(name, [v])).get(v)
                out[v] = got
                continue
            out[v] = {"size": c.size, "digests": c.digests.hex()}
        return out
