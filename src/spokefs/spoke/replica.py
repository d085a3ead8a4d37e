"""A replica worker of a spoke: serves reads from the shared cache, on another core.

``spokefs spoke serve --workers N`` runs one primary (the full spoke: the store, every
upstream fetch, the planner, every write) and N-1 replicas. All of them accept readers on
the same port. A replica keeps no cache of its own: it reads the primary's segment files
(``spokefs.cache.shared``: every byte checked in its own buffer), learns where blocks are
from the primary (``locate``, which fetches what is missing, as demand, and waits until it
is written), and forwards everything else to the primary over a Unix socket. So there is
one upstream fetch per block however many workers a block's readers reach, one place that
orders demand before prefetch, and one writer of the cache.

What the replicas see, the primary learns: reads served from the cache are reported in
batches (for the planner and the eviction order), and their hits, misses and bytes are
added to the primary's metrics, so /metrics and /v1/status speak for the whole spoke.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from spokefs.audit import Audit
from spokefs.cache.shared import SharedCache, SharedLoc
from spokefs.errors import (
    NotFound,
    SpokeError,
    Transient,
    UpstreamUnavailable,
    from_status,
)
from spokefs.integrity import DEFAULT_BLOCK_SIZE, blocks_in_range
from spokefs.manifest import Manifest
from spokefs.policy import BlockKey
from spokefs.retry import NEAR, retrying
from spokefs.spoke.writeback import WRITE_TIMEOUT
from spokefs.tasks import Tasks
from spokefs.wire.backend import (
    BlockPart,
    DatasetInfo,
    DatasetVersions,
    LaterBlock,
    ManifestMemo,
    ReadContext,
    Segment,
    bound_blocks,
    merge_parts,
)
from spokefs.wire.bodies import read_body
from spokefs.wire.client import UpstreamClient
from spokefs.wire.headers import (
    H_FORWARDED,
    H_INTERNAL,
    H_JOB,
    H_MEMBER,
    H_OFFSET,
    H_PEER,
    H_READER,
    H_SIZE,
    H_VERSION,
)
from spokefs.wire.routetable import Owner
from spokefs.wire.server import BATCH_MEMORY, build_app

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ANSWER_HEADERS = ("content-type", "content-encoding", "etag", "cache-control", "content-range")
_FORWARD_PIECE = 1 << 20  # bytes of a forwarded answer held at a time
CHECK_IN_THREAD = 1 << 20
REPORT_EVERY = 0.05      # seconds between reports of reads and counts to the primary
# Not Content-Encoding: the body goes as it came, and the primary knows a compressed one by
# its first bytes (spoke.routes).
# The reader's Authorization goes too: the primary checks it again (wire.authz).
_FORWARDED_HEADERS = ("Authorization", "Content-Type", "Range", H_READER, H_JOB, H_PEER,
                      H_MEMBER, H_INTERNAL, H_SIZE, H_OFFSET, H_VERSION)


class ReplicaBackend:
    role = "spoke"
    RECENT_SNAPSHOTS = 256  # (dataset, snapshot) pairs remembered as read here lately

    def __init__(self, primary_socket: Path, deadline: float = 30.0,
                 latest_ttl: float = 10.0, read_window: int = 64 << 20) -> None:
        self.deadline = deadline
        self.read_window = read_window  # as the primary's: how far a read asks ahead
        self.latest_ttl = latest_ttl
        self.registry = CollectorRegistry()
        # The primary answers within its deadline (a 503 naming the upstream at worst):
        # wait a little longer than that, and relay what it says.
        self.primary = UpstreamClient("http://spoke-primary", max_connections=32, token=None,
                                      request_timeout=deadline + 10.0,
                                      unix_socket=str(primary_socket), answers_final=True)
        self.writes = UpstreamClient("http://spoke-primary", max_connections=8, token=None,
                                     request_timeout=WRITE_TIMEOUT,
                                     unix_socket=str(primary_socket), answers_final=True)
        self.tasks = Tasks()
        self.cache: SharedCache | None = None
        self._unshared = False  # the cache folder is not readable here: all reads proxied
        self._locs: dict[BlockKey, SharedLoc] = {}
        self._datasets: dict[str, tuple[float, DatasetInfo]] = {}
        self._manifests = ManifestMemo()
        self._reads: dict[str, list[list[Any]]] = {}
        self._used: dict[str, set[str]] = {}  # snapshots read here since the last report
        self._counts = {"served_bytes": 0}  # hits and misses: counted with reads, locates
        self._checker = ThreadPoolExecutor(2, thread_name_prefix="spokefs-check")
        # Snapshots read here lately, newest last: what a read's version is looked up in.
        # Not ``_used``, which each report empties: a read resolved just before a report
        # would then find its own snapshot unknown (a 404 for a file it just named).
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.versions = DatasetVersions(self.dataset, self.manifest, self._recent_snapshots)
        self.served: Any = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.tasks.keep(self._report_loop, "report-to-primary")
        self.tasks.keep(self._sweep_loop, "close-deleted-segments")

    async def close(self) -> None:
        await self._report()
        await self.tasks.close()
        await self.primary.close()
        await self.writes.close()
        self._checker.shutdown(wait=True)
        if self.cache is not None:
            self.cache.close()

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY)
            await self._report()

    async def _report(self) -> None:
        """Tell the primary what was read here and what was counted (best effort: a report
        lost while the primary restarts costs a hint and a few counts, nothing more)."""
        reads, self._reads = self._reads, {}
        used, self._used = self._used, {}
        counts = {k: v for k, v in self._counts.items() if v}
        for k in counts:
            self._counts[k] = 0
        try:
            for ds in reads.keys() | used.keys():
                # The snapshots read here stay in use (their files stay cached) as if the
                # primary had served the reads.
                await self.primary.post_json(f"/v1/datasets/{ds}/reads", {
                    "reads": reads.get(ds, []), "snapshots": sorted(used.get(ds, ()))})
            if counts:
                await self.primary.post_json("/v1/workers/counts", counts)
        except (Transient, SpokeError) as exc:
            log.debug("replica: report to the primary lost: %s", exc)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            if self.cache is not None:
                self.cache.sweep()

    # -- talking to the primary --------------------------------------------------------------
    async def _call(self, what: str, fn: Any, *args: Any) -> Any:
        """A request to the primary, retried while it restarts, up to the deadline."""
        return await retrying(
            lambda: fn(*args), NEAR.within(self.deadline),
            give_up=lambda cause: UpstreamUnavailable(
                f"the spoke's primary worker did not answer for {self.deadline:g}s ({what}): "
                f"{cause}", "primary worker", cause))

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Pass a request to the primary and its answer back, a piece at a time as it
        comes (a batch read's frames, a manifest): nothing is held whole here."""
        headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        headers[H_FORWARDED] = "1"  # not the replica's own request: the token decides
        if request.method == "PUT":
            # An upload's body, of any size, streamed as it comes; sent once (its writer
            # resumes from what the primary holds, as after any broken send). Its answer
            # waits for the primary's read-back of the whole file: a longer timeout.
            if request.content_length is not None:
                headers["Content-Length"] = str(request.content_length)
            resp = await self.writes.open(request.method, request.raw_path, headers,
                                          request.content)
        elif request.method == "DELETE" or request.path.endswith("/commit"):
            # Not safe to send twice (a commit resent finds its uploads committing, a
            # discard resent finds none): once; the writer asks what became of it.
            resp = await self.writes.open(request.method, request.raw_path, headers,
                                          bytes(await read_body(request)))
        else:
            body = bytes(await read_body(request))  # bounded, like the primary's own
            # Retried until the primary answers; once its answer has begun, it goes on as is.
            resp = await self._call(f"{request.method} {request.path}", self.primary.open,
                                    request.method, request.raw_path, headers, body)
        try:
            out = web.StreamResponse(status=resp.status, headers={
                k: v for k, v in resp.headers.items() if k.lower() in _ANSWER_HEADERS
                or k.lower().startswith("x-spokefs-")})
            if resp.content_length is not None:
                out.content_length = resp.content_length
            await out.prepare(request)
            async for piece in resp.content.iter_chunked(_FORWARD_PIECE):
                await out.write(piece)
            await out.write_eof()
            return out
        finally:
            resp.release()

    async def _locate(self, name: str, keys: list[BlockKey], fetch: bool,
                      read: dict[str, Any] | None = None) -> list[SharedLoc | None]:
        """Ask the primary where blocks are (fetching missing ones with ``fetch``)."""
        doc: dict[str, Any] = {"blocks": [list(k) for k in keys], "fetch": fetch}
        if read is not None:
            doc["read"] = read
        answer = await self._call(f"the location of {len(keys)} blocks", self.primary.post_json,
                                  f"/v1/datasets/{name}/locate", doc)
        info = answer["cache"]
        if self.cache is None or self.cache.id != info["id"]:
            cache = SharedCache(Path(info["dir"]), info["id"], int(info["chunk_size"]))
            if not cache.usable():
                # Not the folder the primary writes (a container without it, a changed id):
                # every read goes through the primary instead.
                if not self._unshared:
                    log.error("replica: cannot read the spoke's cache folder %s; reading "
                              "through the primary", info["dir"])
                self._unshared = True
                return [None] * len(keys)
            self.cache = cache
            self._unshared = False
        out: list[SharedLoc | None] = []
        for key, entry in zip(keys, answer["blocks"], strict=True):
            loc = self.cache.loc(entry) if entry is not None else None
            if loc is not None:
                self._locs[key] = loc
            else:
                self._locs.pop(key, None)
            out.append(loc)
        return out

    # -- metadata (the primary's, cached here) ----------------------------------------------
    async def datasets(self) -> list[DatasetInfo]:
        doc = await self._call("the dataset list", self.primary.get_json, "/v1/datasets")
        return [await self.dataset(d["name"]) for d in doc["datasets"]]

    async def dataset(self, name: str) -> DatasetInfo:
        now = time.monotonic()
        cached = self._datasets.get(name)
        if cached is not None and now - cached[0] < self.latest_ttl:
            return cached[1]
        doc = await self._call(f"dataset {name}", self.primary.get_json, f"/v1/datasets/{name}")
        info = DatasetInfo.from_json(doc, DEFAULT_BLOCK_SIZE)
        self._datasets[name] = (now, info)
        return info

    async def resolve(self, name: str, snap: str) -> str:
        snap_id = await self._resolve(name, snap)
        self.snapshots_used(name, [snap_id])
        return snap_id

    def snapshots_used(self, name: str, snap_ids: list[str]) -> None:
        self._used.setdefault(name, set()).update(snap_ids)  # told with the next report
        for snap_id in snap_ids:
            self._recent[(name, snap_id)] = None
            self._recent.move_to_end((name, snap_id))
        while len(self._recent) > self.RECENT_SNAPSHOTS:
            self._recent.popitem(last=False)

    def _recent_snapshots(self, name: str) -> list[str]:
        return [snap for (ds, snap) in reversed(self._recent) if ds == name]

    async def _resolve(self, name: str, snap: str) -> str:
        info = await self.dataset(name)
        if snap == "latest":
            if info.latest is None:
                raise NotFound(f"dataset {name!r} has no snapshot yet")
            return info.latest
        if any(s.get("id") == snap for s in info.snapshots):
            return snap
        doc = await self._call(f"snapshot {snap}", self.primary.get_json,
                               f"/v1/datasets/{name}/snapshots/{snap}")
        return str(doc["id"])

    async def manifest_blob(self, name: str, snap_id: str) -> bytes:
        return await self._call(f"the manifest of {name}@{snap_id}", self.primary.manifest_blob,
                                name, snap_id)

    async def manifest(self, name: str, snap_id: str) -> Manifest:
        return (await self._manifests.get(name, snap_id, self.manifest_blob))[0]

    async def create_snapshot(self, name: str) -> dict[str, object]:
        return await self._call("a snapshot", self.primary.post_json,
                                f"/v1/datasets/{name}/snapshots", {})

    async def status(self) -> dict[str, object]:
        return await self._call("status", self.primary.get_json, "/v1/status")

    # -- data --------------------------------------------------------------------------------
    async def object_size(self, name: str, version: str) -> int:
        await self.versions.check(name, version)
        loc = self._locs.get((version, 0))
        if loc is None:
            loc = (await self._locate(name, [(version, 0)], fetch=True))[0]
        if loc is None:
            return await self._proxied_size(name, version)
        return loc.object_size

    async def block_digest(self, name: str, version: str, index: int) -> bytes | None:
        await self.versions.check(name, version)
        loc = self._locs.get((version, index))
        return None if loc is None else loc.digest

    async def read(self, name: str, version: str, start: int, end: int,
                   ctx: ReadContext | None = None) -> AsyncIterator[Segment]:
        await self.versions.check(name, version)
        bs = (await self.dataset(name)).block_size
        ctx = ctx or ReadContext()
        context = {"path": ctx.path, "size": ctx.size, "reader": ctx.reader, "job": ctx.job}
        indexes = blocks_in_range(start, end, bs)
        ahead = max(2, self.read_window // bs)
        # A window at a time, so a slow or abandoned reader of a huge range makes the primary
        # fetch one window, not the range.
        for first in range(indexes.start, indexes.stop, ahead):
            keys = [(version, i) for i in range(first, min(first + ahead, indexes.stop))]
            w_start, w_end = max(start, first * bs), min(end, (first + len(keys)) * bs)
            missing = [k for k in keys if k not in self._locs]
            if missing:
                # The primary fetches what is missing (and hears of the read, for its
                # planner and its counts).
                await self._locate(name, missing, fetch=True,
                                   read={**context, "start": w_start, "end": w_end})
            else:
                self._reads.setdefault(name, []).append([version, w_start, w_end, context])
            for key in keys:
                i = key[1]
                lo = max(start, i * bs) - i * bs
                hi = min(end, (i + 1) * bs) - i * bs
                data = await self._read_block(name, key, lo, hi)
                if data is None:  # the cache could not keep it: the primary passes it on
                    async for seg in self._proxied_read(name, version, i * bs + lo,
                                                        i * bs + hi):
                        yield seg
                    continue
                if missing:  # a reported read's bytes are counted by the primary
                    self._counts["served_bytes"] += hi - lo
                yield data

    async def _read_block(self, name: str, key: BlockKey, lo: int, hi: int
                          ) -> memoryview | None:
        """Checked bytes from the cache; a failed check asks the primary again (a stale
        location: the block moved or left), and a second one means damage, which the
        primary is told of and heals by fetching the block again."""
        for attempt in range(3):
            loc = self._locs.get(key)
            if loc is None:
                loc = (await self._locate(name, [key], fetch=True))[0]
                if loc is None or self.cache is None:
                    return None
            if hi - lo >= CHECK_IN_THREAD:
                data = await asyncio.get_running_loop().run_in_executor(
                    self._checker, self.cache.read, loc, lo, hi)
            else:
                data = self.cache.read(loc, lo, hi)
            if data is not None:
                return data
            self._locs.pop(key, None)
            if attempt:  # the same answer twice: the bytes there are damaged (the primary
                # checks them itself, drops and counts them)
                await self._call("a damaged block", self.primary.post_json,
                                 f"/v1/datasets/{name}/locate",
                                 {"blocks": [list(key)], "fetch": False, "damaged": True})
        return None

    async def _sent_block(self, name: str, key: BlockKey, size: int) -> memoryview | None:
        """A batch's block as it is sent; None (the batch is cut) if it cannot be had now."""
        try:
            return await self._read_block(name, key, 0, size)
        except SpokeError as exc:
            log.warning("block %d of %s left a batch read unfinished: %s", key[1], key[0], exc)
            return None

    async def _proxied_read(self, name: str, version: str, start: int, end: int
                            ) -> AsyncIterator[bytes]:
        status, _, data = await self._call(
            "a read", self.primary.forward, "GET", f"/v1/datasets/{name}/objects/{version}",
            {"Range": f"bytes={start}-{end - 1}"}, b"", max(end - start, 1 << 20))
        if status >= 300:
            try:
                doc = json.loads(data)
            except ValueError:
                doc = None
            raise from_status(status, doc, f"the primary answered {status}")
        yield data  # counted by the primary, which served it

    async def _proxied_size(self, name: str, version: str) -> int:
        status, headers, _ = await self._call(
            "a size", self.primary.forward, "HEAD", f"/v1/datasets/{name}/objects/{version}",
            {}, b"")
        if status >= 300:
            raise from_status(status, None, f"the primary answered {status}")
        return int(headers.get("Content-Length", "0"))

    async def batch_bytes(self, name: str, blocks: list[tuple[str, int]]) -> int:
        """The bytes a batch read of ``blocks`` holds at most (``wire.server.ByteRoom``)."""
        return await self.versions.batch_bytes(name, blocks,
                                               (await self.dataset(name)).block_size)

    async def read_blocks(self, name: str, blocks: list[tuple[str, int]]) -> list[BlockPart]:
        blocks, refused = await bound_blocks(self.versions, name, blocks)
        return merge_parts(await self._read_blocks(name, blocks), refused)

    async def _read_blocks(self, name: str, blocks: list[tuple[str, int]]) -> list[BlockPart]:
        missing = [k for k in blocks if k not in self._locs]
        if missing:
            await self._locate(name, missing, fetch=True)
        parts = []
        for key in blocks:
            loc = self._locs.get(key)
            if loc is None:
                parts.append(BlockPart.error(UpstreamUnavailable(
                    f"block {key[1]} of {key[0]} could not be kept", "primary worker",
                    "pass-through")))
                continue
            # Read and checked as it is sent (``LaterBlock``): one block held at a time.
            read = functools.partial(self._sent_block, name, key, loc.size)
            parts.append(BlockPart(200, LaterBlock(loc.size, read), loc.object_size,
                                   loc.digest))
        return parts


class _Own:
    """A replica worker's own route (``wire.routetable``: owner ``replica``)."""

    def __init__(self, backend: ReplicaBackend) -> None:
        self.backend = backend

    async def flush(self, request: web.Request) -> web.Response:
        await self.backend._report()
        return web.json_response({})


def build_replica_app(backend: ReplicaBackend, auth: Path | None = None,
                      audit: Audit | None = None,
                      internal_key: Callable[[], bytes | None] | None = None,
                      batch_memory: int = BATCH_MEMORY) -> web.Application:
    """Reads answered here; the table's ``primary`` routes forwarded to the primary, which
    checks the reader's token again (``wire.authz``)."""

    @web.middleware
    async def peers_to_primary(request: web.Request, handler: Handler) -> web.StreamResponse:
        """A tier member's batch read (``X-Spokefs-Peer``) is the primary's to answer: it
        fetches what is missing as the block's owner (the upstream, never a third member),
        and answers a handoff from its cache only; a replica would fetch as a reader does.
        (Only a batch read carries the mark: ``wire.authz.well_formed``.)"""
        if H_PEER in request.headers:
            return await backend.forward(request)
        return await handler(request)

    app = build_app(backend, {Owner.REPLICA: _Own(backend)},  # type: ignore[arg-type]
                    forward=backend.forward, auth=auth,
                    jobs=None,  # the primary keeps who owns a job
                    audit=audit,  # this worker's own file (spokefs.audit.worker_file)
                    internal_key=internal_key, batch_memory=batch_memory)
    app.middlewares.append(peers_to_primary)  # innermost: after the token was checked

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await backend.start()
        yield
        await backend.close()

    app.cleanup_ctx.append(lifecycle)
    return app
