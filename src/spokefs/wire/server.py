"""The HTTP API (docs/protocol.md) over any ``Backend``: hub and spoke share every route.

Two faces:
- ``/v1/...``: the API spokes and mounts use: datasets, snapshots, manifests, and byte ranges
  of file versions (``/v1/datasets/{ds}/objects/{version}``).
- ``/{dataset}[@{snapshot}]/{path}``: plain reads by path with Range and HEAD, and an HTML index
  for folders, so curl, rclone's ``:http:`` remote and fsspec's HTTP filesystem read as is.
Errors are JSON bodies ``{"error": {"code", "message", ...}}`` with the matching status.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import html
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from email.utils import formatdate
from pathlib import Path
from typing import Any
from urllib.parse import quote

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from spokefs import ui
from spokefs.audit import Audit
from spokefs.errors import (
    BadRequest,
    NotFound,
    RangeNotSatisfiable,
    RateLimited,
    SpokeError,
    TooLarge,
)
from spokefs.manifest import FileEntry, is_snapshot_id
from spokefs.wire.auth import TokenFile
from spokefs.wire.authz import (
    JobOwners,
    admin_audit_middleware,
    auth_middleware,
    rate_middleware,
    visible_metrics,
    visible_status,
    well_formed,
)
from spokefs.wire.backend import (
    PEER_KEY,
    Backend,
    BlockPart,
    DatasetInfo,
    FileSegment,
    GathersCounts,
    LaterBlock,
    ReadContext,
    Segment,
    readiness,
)
from spokefs.wire.bodies import json_body
from spokefs.wire.frames import HEADER_SIZE, encode_header
from spokefs.wire.headers import (
    H_BLOCK_SIZE,
    H_DIGEST,
    H_JOB,
    H_READER,
    H_SNAPSHOT,
    H_VERSION,
)
from spokefs.wire.looplag import HEALTH_MAX_LAG, LoopLag
from spokefs.wire.paths import check_dataset_name, clean_path, split_dataset_ref
from spokefs.wire.ranges import parse_range
from spokefs.wire.ratelimit import TokenBuckets
from spokefs.wire.routetable import Owner, bind, openapi

log = logging.getLogger(__name__)

MANIFEST_TYPE = "application/vnd.spokefs.manifest+json"
BLOCKS_TYPE = "application/vnd.spokefs.blocks"
MAX_BATCH = 4096             # blocks in one batch read
MAX_BATCH_BODY = 1 << 20     # bytes of a batch read's body (MAX_BATCH blocks is ~200 KiB)
# Bytes one batch read may ask for (its blocks times the block size; one block always fits):
# the answer is sized before its first byte goes out, so this is what a request can hold.
MAX_BATCH_BYTES = 64 << 20
# Bytes of batch reads a spoke holds at once, every request together (a spoke's blocks may
# be in memory, fetched or copied; a hub's are open files and are not counted).
BATCH_MEMORY = 256 << 20
MAX_DIGESTS = 1024           # versions in one digests request
_COALESCE = 1 << 20          # small frames are gathered into writes of about this size
_SMALL_PAYLOAD = 256 * 1024  # a file payload up to this is read and gathered, not sendfile'd
_GATHER = 1 << 20            # a read up to this is answered in one piece
READY_TIMEOUT = 2.0          # seconds a backend's readiness check may take (then: not ready)
HEALTH_TICK = 0.1            # seconds between the probe's own loop-lag wake-ups

BACKEND_KEY = web.AppKey("backend", Backend)


def error_response(exc: SpokeError) -> web.Response:
    resp = web.json_response(exc.to_json(), status=exc.status)
    if isinstance(exc, RangeNotSatisfiable) and exc.size >= 0:
        resp.headers["Content-Range"] = f"bytes */{exc.size}"
    if isinstance(exc, RateLimited):
        resp.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return resp


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except SpokeError as exc:
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.status, exc)
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            body = {"error": {"code": exc.reason.lower().replace(" ", "_"), "message": exc.reason}}
            # Its headers stay (a 405's Allow: RFC 9110 requires it), but for the body's.
            kept = {k: v for k, v in exc.headers.items()
                    if k.lower() not in ("content-type", "content-length")}
            return web.json_response(body, status=exc.status, headers=kept)
        raise
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        # Out of file descriptors (too many clients or open files): a clear, retryable
        # answer, and one log line a minute, not a 500 and a traceback per request.
        _log_fd_exhaustion(exc)
        return web.json_response(
            {"error": {"code": "overloaded", "message": "the server is out of file "
                       "descriptors; try again shortly"}}, status=503,
            headers={"Retry-After": "1"})


_fd_warned = 0.0


def _log_fd_exhaustion(exc: OSError) -> None:
    global _fd_warned
    now = time.monotonic()
    if now - _fd_warned > 60:
        _fd_warned = now
        log.error("out of file descriptors (%s): answering 503; raise the limit (ulimit -n) "
                  "or lower the number of clients", exc)


_PREAD_PIECE = 1 << 20  # where sendfile cannot be used: bytes read and written per step


async def send_file_range(request: web.Request, resp: web.StreamResponse,
                          seg: FileSegment) -> None:
    """Send bytes [offset, offset+count) of ``seg``'s file: sendfile(2) where the transport
    allows it, else positional reads (pread) written through ``resp``.

    Never asyncio's own sendfile fallback (taken for TLS transports): it ``seek``s the file
    object and reads from its position in a thread, and a spoke's segment file is one object
    shared by every concurrent answer, so two answers over TLS read each other's bytes (a
    mount over https once got block 1 of a file for block 0). pread has no shared position.
    """
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("client went away")
    if transport.get_extra_info("sslcontext") is None:  # TLS has no sendfile(2)
        try:
            await asyncio.get_running_loop().sendfile(transport, seg.file, seg.offset,
                                                      seg.count, fallback=False)
            return
        except (asyncio.SendfileNotAvailableError, NotImplementedError):
            pass  # not a file sendfile(2) takes: nothing was sent yet
    fd, pos, end = seg.file.fileno(), seg.offset, seg.offset + seg.count
    while pos < end:
        data = os.pread(fd, min(_PREAD_PIECE, end - pos), pos)
        if not data:
            raise ConnectionAbortedError(f"file shrank: {pos - seg.offset} of {seg.count} "
                                         "bytes")
        await resp.write(data)
        pos += len(data)


async def send_segments(request: web.Request, segments: AsyncIterator[Segment],
                        first: Segment | None, resp: web.StreamResponse,
                        sent: list[int] | None = None) -> web.StreamResponse:
    """Stream the segments; a file segment goes out with sendfile, no copy through Python.
    ``sent[0]`` counts the bytes handed to the connection (for the audit log)."""
    await resp.prepare(request)
    seg = first
    try:
        while seg is not None:
            if isinstance(seg, FileSegment) and seg.count <= _SMALL_PAYLOAD:
                try:  # a copy costs less than the sendfile dance for a small piece
                    await resp.write(os.pread(seg.file.fileno(), seg.count, seg.offset))
                finally:
                    seg.release()
            elif isinstance(seg, FileSegment):
                try:
                    await send_file_range(request, resp, seg)
                finally:
                    seg.release()
            else:
                await resp.write(seg)
            if sent is not None:
                sent[0] += seg.count if isinstance(seg, FileSegment) else len(seg)
            try:
                seg = await anext(segments, None)
            except SpokeError as exc:
                # Status and bytes are already out: only a cut connection tells the reader.
                # An error response here would be written into the body as if it were data.
                seg = None
                raise ConnectionAbortedError(f"read failed mid-response: {exc}") from exc
    finally:
        if seg is not None and isinstance(seg, FileSegment):
            seg.release()
        await segments.aclose()  # type: ignore[attr-defined]
    await resp.write_eof()
    return resp


async def send_frames(request: web.Request, resp: web.StreamResponse,
                      parts: list[BlockPart]) -> None:
    """Write a batch body (``wire.frames``): small payloads are gathered with their headers
    into large writes; a large file payload goes out with sendfile after its header."""
    chunk = bytearray()
    try:
        for seq, part in enumerate(parts):
            payload = part.payload
            if isinstance(payload, LaterBlock):
                data = await payload.read()
                if data is None or len(data) != payload.count:
                    raise ConnectionAbortedError(f"block {seq} of a batch failed its check as "
                                                 "it was sent: the batch is cut")
                payload = data
            chunk += encode_header(seq, part.status, part.length, part.object_size, part.digest)
            if isinstance(payload, FileSegment):
                if payload.count <= _SMALL_PAYLOAD:
                    at = len(chunk)
                    chunk.extend(bytes(payload.count))
                    with memoryview(chunk) as view:
                        got = os.preadv(payload.file.fileno(), [view[at:]], payload.offset)
                    payload.release()
                    if got != payload.count:
                        raise ConnectionAbortedError(f"block file shrank: {got} of "
                                                     f"{payload.count} bytes")
                else:
                    await resp.write(chunk)
                    chunk = bytearray()
                    try:
                        await send_file_range(request, resp, payload)
                    finally:
                        payload.release()
            else:
                chunk += payload
            if len(chunk) >= _COALESCE:
                await resp.write(chunk)
                chunk = bytearray()  # fresh: the transport may still hold the last one
        if chunk:
            await resp.write(chunk)
    finally:
        for part in parts:  # what an error or a gone client left unsent
            if isinstance(part.payload, FileSegment):
                part.payload.release()
    await resp.write_eof()


async def gather(segments: AsyncIterator[Segment], n: int) -> bytes | bytearray:
    """Every byte of a read, in one buffer. Each segment is copied as it comes, before the
    next is awaited (a view of the cache is valid only until then)."""
    first = await anext(segments, None)  # type: ignore[call-overload]
    if first is None:
        return b""
    if not isinstance(first, FileSegment) and len(first) == n:
        # The whole read in one piece: send its own buffer if it is all of one, else a copy.
        whole = first.obj if isinstance(first, memoryview) else first
        data = whole if isinstance(whole, bytes | bytearray) and len(whole) == n else bytes(first)
        async for _ in segments:
            raise ConnectionAbortedError(f"read produced more than {n} bytes")
        return data
    out = bytearray(n)
    with memoryview(out) as view:
        pos = _copy_into(view, first)
        async for seg in segments:
            pos += _copy_into(view[pos:], seg)
    if pos != n:
        raise ConnectionAbortedError(f"read produced {pos} of {n} bytes")
    return out


def _copy_into(view: memoryview, seg: Segment) -> int:
    if isinstance(seg, FileSegment):
        try:
            got = os.preadv(seg.file.fileno(), [view[:seg.count]], seg.offset)
        finally:
            seg.release()
        if got != seg.count:
            raise ConnectionAbortedError(f"file shrank: {got} of {seg.count} bytes")
        return got
    view[:len(seg)] = seg
    return len(seg)


def parse_block_list(doc: object) -> list[tuple[str, int]]:
    """``{"blocks": [[version, index], ...]}`` of a batch read, checked."""
    blocks = doc.get("blocks") if isinstance(doc, dict) else None
    if not isinstance(blocks, list) or not blocks:
        raise BadRequest('a batch read needs {"blocks": [[version, index], ...]}')
    if len(blocks) > MAX_BATCH:
        raise BadRequest(f"a batch read asks for at most {MAX_BATCH} blocks, not {len(blocks)}")
    out = []
    for b in blocks:
        if (not isinstance(b, list) or len(b) != 2 or not isinstance(b[0], str)
                or not check_version(b[0]) or type(b[1]) is not int
                or not 0 <= b[1] < 1 << 63):
            raise BadRequest(f"bad block {str(b)[:100]}: expected [version id, index >= 0]")
        out.append((b[0], b[1]))
    return out


class ByteRoom:
    """Room for ``capacity`` bytes, taken and given back by requests; a request waits for
    its room in turn (first come, first served), so a crowd of large batch reads waits
    instead of growing the process. One request never needs more than the capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = (
            collections.deque())

    @contextlib.asynccontextmanager
    async def take(self, n: int) -> AsyncIterator[None]:
        n = min(n, self.capacity)
        if self._waiting or self.free < n:
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append((n, fut))
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._give(n)  # granted as it was cancelled: pass it on
                else:
                    with contextlib.suppress(ValueError):  # _wake may have dropped it
                        self._waiting.remove((n, fut))
                    self._wake()
                raise
        else:
            self.free -= n
        try:
            yield
        finally:
            self._give(n)

    def _give(self, n: int) -> None:
        self.free += n
        self._wake()

    def _wake(self) -> None:
        while self._waiting:
            n, fut = self._waiting[0]
            if fut.done():  # cancelled while it waited
                self._waiting.popleft()
                continue
            if n > self.free:
                break
            self._waiting.popleft()
            self.free -= n
            fut.set_result(None)


def check_version(version: str) -> bool:
    return 0 < len(version) <= 64 and version.isascii() and version.isalnum()


class Api:
    """Route handlers. ``extra`` lets a role add its own routes (the spoke's hints, warm...)."""

    def __init__(self, backend: Backend, audit: Audit | None = None,
                 batch_memory: int | None = None, health: LoopLag | None = None,
                 counts: GathersCounts | None = None) -> None:
        self.backend = backend
        self.counts = counts
        # This process's loop, as /healthz sees it (``build_app`` runs its ticker).
        self.health = health or LoopLag(None, HEALTH_TICK)
        # Batch reads' bytes held at once (None: not counted, for a hub's file segments);
        # with it, the backend tells a batch's bytes (``batch_bytes``).
        self.batch_room = ByteRoom(batch_memory) if batch_memory else None
        self.audit = audit or Audit()  # a no-op without --audit-log
        self.requests = Counter("spokefs_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=backend.registry)
        self.bytes_served = Counter("spokefs_served_bytes", "Body bytes sent to readers",
                                    registry=backend.registry)
        if counts is not None:  # a spoke adds its replica workers' bytes here
            counts.attach_served(self.bytes_served)
        self._ok = self.requests.labels("object", "200")  # the children the hot path bumps
        self._partial = self.requests.labels("object", "206")

    async def openapi(self, request: web.Request) -> web.Response:
        """The routes this server answers, with the scope each needs (``wire.routetable``)."""
        owners = [Owner.API, Owner.UI, Owner.WRITES] + (
            [Owner.SPOKE] if self.backend.role == "spoke" else [])
        return web.json_response(openapi(owners, f"spokefs {self.backend.role}"))

    # -- probes ------------------------------------------------------------------------------
    # Public: no token, and nothing in the answer but ok and a generic reason.
    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: answered by this process's event loop, 503 when its recent lag is over
        ``HEALTH_MAX_LAG`` (a loop held for good does not answer at all)."""
        return _probe("the event loop is lagging" if self.health.lag() > HEALTH_MAX_LAG
                      else None)

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: the backend's own check (``wire.backend.Ready``), within
        ``READY_TIMEOUT``; a backend without one is ready when it answers."""
        try:
            reason = await asyncio.wait_for(readiness(self.backend), READY_TIMEOUT)
        except TimeoutError:
            reason = "the readiness check did not finish in time"
        except Exception as exc:  # the check itself failed: not ready, the cause to the log
            log.warning("readiness check failed: %s", exc)
            reason = "the readiness check failed"
        return _probe(reason)

    # -- JSON API ----------------------------------------------------------------------------
    async def metrics(self, request: web.Request) -> web.Response:
        if self.counts is not None:  # a spoke gathers its replica workers' counts first
            await self.counts.before_scrape()
        body = visible_metrics(generate_latest(self.backend.registry), request.get("token"))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(visible_status(await self.backend.status(),
                                                request.get("token")))

    async def _readable(self, request: web.Request) -> list[DatasetInfo]:
        """The datasets the request's token may read (every one without --auth)."""
        token = request.get("token")
        infos = await self.backend.datasets()
        return [i for i in infos if token is None or token.may_read(i.name)]

    async def list_datasets(self, request: web.Request) -> web.Response:
        infos = await self._readable(request)
        return web.json_response({"datasets": [i.to_json() for i in infos]})

    async def get_dataset(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        return web.json_response((await self.backend.dataset(ds)).to_json())

    async def create_snapshot(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        return web.json_response(await self.backend.create_snapshot(ds), status=201)

    async def _snap(self, request: web.Request) -> tuple[str, str]:
        ds = check_dataset_name(request.match_info["ds"])
        _, snap = split_dataset_ref(f"{ds}@{request.match_info['snap']}")
        return ds, await self.backend.resolve(ds, snap)

    async def get_snapshot(self, request: web.Request) -> web.Response:
        ds, snap_id = await self._snap(request)
        info = await self.backend.dataset(ds)
        for s in info.snapshots:
            if s["id"] == snap_id:
                return web.json_response({"dataset": ds, **s})
        return web.json_response({"dataset": ds, "id": snap_id})

    async def get_manifest(self, request: web.Request) -> web.Response:
        ds, snap_id = await self._snap(request)
        blob = await self.backend.manifest_blob(ds, snap_id)
        # Sent as stored (gzip'd JSON): the manifest is immutable, so it caches forever.
        return web.Response(body=blob, headers={
            "Content-Type": MANIFEST_TYPE, "Content-Encoding": "gzip", "ETag": f'"{snap_id}"',
            "Cache-Control": "public, max-age=31536000, immutable", H_SNAPSHOT: snap_id})

    async def get_entry(self, request: web.Request) -> web.Response:
        ds, snap_id = await self._snap(request)
        path = clean_path(request.match_info["path"])
        m = await self.backend.manifest(ds, snap_id)
        entry = m.lookup(path)
        if entry is not None:
            return web.json_response({"snapshot": snap_id, **entry.to_json()})
        if not m.is_dir(path):
            raise NotFound(f"{ds}@{snap_id} has no file or folder {path!r}")
        subdirs, files = m.listdir(path)
        return web.json_response({
            "snapshot": snap_id, "path": path, "type": "dir",
            "dirs": subdirs, "files": [f.to_json() for f in files]})

    async def get_object(self, request: web.Request) -> web.StreamResponse:
        ds = check_dataset_name(request.match_info["ds"])
        version = request.match_info["version"]
        if not check_version(version):
            raise BadRequest(f"invalid version id {version!r}")
        snap = request.headers.get(H_SNAPSHOT)
        if snap is not None:  # the reader's snapshot: in use (a spoke keeps its files)
            if not is_snapshot_id(snap):
                raise BadRequest(f"invalid {H_SNAPSHOT} header {snap[:80]!r}: a snapshot id")
            self.backend.snapshots_used(ds, [snap])
        return await self._serve(request, ds, version, extra_headers={H_VERSION: version})

    async def digests(self, request: web.Request) -> web.Response:
        """``{"versions": [id, ...]}`` -> ``{"digests": {id: {"size", "digests": hex} or
        null}}``: what each version commits to (docs/protocol.md, "Digests")."""
        ds = check_dataset_name(request.match_info["ds"])
        doc = await json_body(request, MAX_BATCH_BODY)
        versions = doc.get("versions") if isinstance(doc, dict) else None
        if (not isinstance(versions, list) or not versions or len(versions) > MAX_DIGESTS
                or not all(isinstance(v, str) and check_version(v) for v in versions)):
            raise BadRequest(f'a digests request needs {{"versions": [version id, ...]}}, '
                             f"1 to {MAX_DIGESTS} of them")
        return web.json_response({"digests": await self.backend.digests(ds, versions)})

    async def read_blocks(self, request: web.Request) -> web.StreamResponse:
        """Many whole blocks in one response, each framed with its digest (docs/protocol.md,
        "Batch reads"); a block that cannot be read is an error frame, not a failed batch."""
        ds = check_dataset_name(request.match_info["ds"])
        blocks = parse_block_list(await json_body(request, MAX_BATCH_BODY))
        if self.batch_room is None:  # a hub's blocks are open files, sent with sendfile
            return await self._send_blocks(request, ds, blocks)
        # A spoke's may be in memory (fetched now, or copied by a replica): sized from the
        # manifest first, then held only with room for them.
        bs = (await self.backend.dataset(ds)).block_size
        need = await self.backend.batch_bytes(ds, blocks)  # type: ignore[attr-defined]
        if need > max(MAX_BATCH_BYTES, bs):
            raise TooLarge(f"a batch read holds at most {MAX_BATCH_BYTES >> 20} MiB (or one "
                           f"block); these {len(blocks)} blocks hold {need:,} bytes")
        async with self.batch_room.take(need):
            return await self._send_blocks(request, ds, blocks)

    async def _send_blocks(self, request: web.Request, ds: str, blocks: list[tuple[str, int]]
                           ) -> web.StreamResponse:
        peer = request.get(PEER_KEY)  # a tier member's batch read (spoke.tier)
        parts = await (self.backend.read_blocks(ds, blocks) if peer is None
                       else self.backend.read_blocks(ds, blocks, peer))  # type: ignore[call-arg]
        resp = web.StreamResponse(status=200, headers={"Content-Type": BLOCKS_TYPE})
        resp.content_length = sum(HEADER_SIZE + p.length for p in parts)
        nbytes = sum(p.length for p in parts if p.status == 200)
        failed = sum(p.status != 200 for p in parts)
        try:
            await resp.prepare(request)
            await send_frames(request, resp, parts)
        except BaseException:
            # How much of a cut batch arrived is not known here (frames are gathered).
            self.audit.read(request, ds, None, 200, version=(v for v, _ in blocks),
                            blocks=len(blocks), complete=False)
            raise
        finally:
            # The blocks go now, not with this frame: a client gone mid-batch leaves its
            # exception (and so this frame) referenced past the request, and the batch's
            # bytes with it, outside the ByteRoom's count (measured: 64 MiB kept per
            # abandoned batch, ``spokefs bench abuse``).
            parts.clear()
        self.audit.read(request, ds, nbytes, 200, version=(v for v, _ in blocks),
                        blocks=len(blocks), failed=failed)
        self.bytes_served.inc(nbytes)
        self.requests.labels("blocks", "200").inc()
        return resp

    # -- byte ranges -------------------------------------------------------------------------
    async def _serve(self, request: web.Request, ds: str, version: str,
                     extra_headers: dict[str, str], entry: FileEntry | None = None
                     ) -> web.StreamResponse:
        t0 = time.monotonic()
        if entry is not None:
            size = entry.size
        else:
            # The spoke may have to fetch a block to learn the size: fetch the one asked for.
            size = await self.backend.object_size(ds, version)
        rng = parse_range(request.headers.get("Range"), size)
        start, end = rng if rng is not None else (0, size)
        info = await self.backend.dataset(ds)
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   "ETag": f'"{version}"', H_BLOCK_SIZE: str(info.block_size), **extra_headers}
        if entry is not None:
            headers["Last-Modified"] = _http_date(entry.mtime_ns)
        status = 200
        if rng is not None:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        bs = info.block_size
        path = entry.path if entry is not None else None
        if request.method == "HEAD" or end == start:
            resp = web.StreamResponse(status=status, headers=headers)
            resp.content_length = end - start
            await resp.prepare(request)
            await resp.write_eof()
            if request.method != "HEAD":  # HEAD reads nothing
                self.audit.read(request, ds, 0, status, path, version)
            return resp
        ctx = ReadContext(entry.path if entry else None, size,
                          request.headers.get(H_READER, "") or _peer(request),
                          request.headers.get(H_JOB, ""))
        segments = self.backend.read(ds, version, start, end, ctx)
        if end - start <= _GATHER:
            # Small: gather every byte first (an upstream failure is still a clean 503), then
            # one response, headers and body in one write.
            body = await gather(segments, end - start)
            if start % bs == 0 and (end == size or end - start == bs):
                digest = await self.backend.block_digest(ds, version, start // bs)
                if digest is not None:
                    headers[H_DIGEST] = digest.hex()
            self.bytes_served.inc(end - start)
            (self._ok if status == 200 else self._partial).inc()
            self.audit.read(request, ds, end - start, status, path, version)
            return web.Response(status=status, headers=headers, body=body)
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = end - start
        # Await the first bytes before sending headers: an upstream failure can still be a 503.
        first = await anext(segments)  # type: ignore[call-overload]
        if start % bs == 0 and end - start == bs:
            digest = await self.backend.block_digest(ds, version, start // bs)
            if digest is not None:
                resp.headers[H_DIGEST] = digest.hex()
        sent = [0]
        try:
            await send_segments(request, segments, first, resp, sent)
        except BaseException:
            self.audit.read(request, ds, sent[0], status, path, version, complete=False)
            raise
        self.audit.read(request, ds, sent[0], status, path, version)
        self.bytes_served.inc(end - start)
        (self._ok if status == 200 else self._partial).inc()
        log.debug("served %s/%s [%d,%d) in %.1f ms", ds, version, start, end,
                  1000 * (time.monotonic() - t0))
        return resp

    # -- plain reads by path -----------------------------------------------------------------
    async def root_index(self, request: web.Request) -> web.Response:
        infos = await self._readable(request)
        links = "".join(f'<li><a href="{quote(i.name)}/">{html.escape(i.name)}/</a></li>'
                        for i in infos)
        return _html_page("spokefs datasets", links)

    async def plain_redirect(self, request: web.Request) -> web.StreamResponse:
        ref = request.match_info["ref"]
        split_dataset_ref(ref)
        raise web.HTTPMovedPermanently(f"/{quote(ref)}/")

    async def plain_read(self, request: web.Request) -> web.StreamResponse:
        ds, snap = split_dataset_ref(request.match_info["ref"])
        raw = request.match_info["path"]
        path = clean_path(raw)
        snap_id = await self.backend.resolve(ds, snap)
        m = await self.backend.manifest(ds, snap_id)
        entry = m.lookup(path) if path else None
        if entry is not None:
            return await self._serve(request, ds, entry.version,
                                     {H_VERSION: entry.version, H_SNAPSHOT: snap_id}, entry)
        if path == "" or m.is_dir(path):
            if raw and not raw.endswith("/"):
                raise web.HTTPMovedPermanently(f"/{quote(request.match_info['ref'])}/"
                                               f"{quote(path)}/")
            subdirs, files = m.listdir(path)
            items = ['<li><a href="../">../</a></li>'] if path else []
            # surrogateescape: a name from an old snapshot may not be UTF-8 (500 otherwise)
            items += [f'<li><a href="{quote(d, errors="surrogateescape")}/">'
                      f'{html.escape(d)}/</a></li>' for d in subdirs]
            names = [(f.path.rsplit("/", 1)[-1], f.size) for f in files]
            items += [f'<li><a href="{quote(n, errors="surrogateescape")}">'
                      f'{html.escape(n)}</a> {size}</li>' for n, size in names]
            title = f"{ds}@{snap_id}/{path}"
            return _html_page(title, "".join(items), {H_SNAPSHOT: snap_id})
        raise NotFound(f"{ds}@{snap_id} has no file or folder {path!r}")


@functools.lru_cache(maxsize=4096)
def _http_date(mtime_ns: int) -> str:
    return formatdate(mtime_ns / 1e9, usegmt=True)


def _peer(request: web.Request) -> str:
    """Without a reader header, one connection is one stream (kept-alive clients)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return f"{peer[0]}:{peer[1]}" if peer else ""


def _probe(reason: str | None) -> web.Response:
    body: dict[str, object] = {"ok": True} if reason is None else {"ok": False,
                                                                  "reason": reason[:200]}
    return web.json_response(body, status=200 if reason is None else 503,
                             headers={"Cache-Control": "no-store"})


def _html_page(title: str, items: str, headers: dict[str, str] | None = None) -> web.Response:
    t = html.escape(title)
    body = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{t}</title></head>"
            f"<body><h1>{t}</h1><ul>{items}</ul></body></html>")
    return web.Response(text=body, content_type="text/html", headers=headers)


AUTH_KEY = web.AppKey("auth", TokenFile)
# What else SIGHUP reads again (a spoke's dataset rules): callables, run in order.
RELOAD_KEY = web.AppKey("reload", list)


def build_app(backend: Backend, handlers: dict[Owner, Any] | None = None,
              forward: Callable | None = None, auth: Path | None = None,
              jobs: JobOwners | None = None, audit: Audit | None = None,
              internal_key: Callable[[], bytes | None] | None = None,
              batch_memory: int | None = None,
              counts: GathersCounts | None = None) -> web.Application:
    """The API over ``backend``, with the table's routes of ``handlers``' owners besides
    (``wire.routetable``: its routes and nothing else; ``forward``: a replica worker's, for
    the routes the primary answers). With ``auth`` (a token file), every request is checked
    against its route's scope (``wire.authz``). ``jobs``: where job owners are kept (the
    process that keeps jobs). ``internal_key``: the cache folder's key, for same-host readers
    of a spoke's cache. ``audit``: the audit log (closed with the app). ``batch_memory``:
    bytes of batch reads held at once, all requests together (``ByteRoom``). ``counts``: a
    backend that gathers other processes' counts (``wire.backend.GathersCounts``)."""
    middlewares: list[Callable] = [errors_middleware, well_formed]
    tokens = TokenFile(auth) if auth is not None else None
    if tokens is not None:
        middlewares.append(auth_middleware(tokens, internal_key, jobs, audit))
    middlewares.append(rate_middleware(TokenBuckets()))  # inside auth: the token is known
    if audit is not None and audit.enabled:
        middlewares.append(admin_audit_middleware(audit))  # inside auth: the token is known
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    if tokens is not None:
        app[AUTH_KEY] = tokens
    app[BACKEND_KEY] = backend
    api = Api(backend, audit, batch_memory, counts=counts)
    app.add_routes(bind({Owner.API: api, Owner.UI: ui, **(handlers or {})},
                        forward))

    async def health_ticker(app: web.Application) -> AsyncIterator[None]:
        """/healthz's measurement of this process's loop, for as long as the app serves."""
        task = asyncio.create_task(api.health.run(), name="healthz-loop-lag")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(health_ticker)
    if audit is not None:
        async def close_audit(app: web.Application) -> None:  # after the backend's cleanup
            audit.close()

        app.on_cleanup.append(close_audit)
    return app
