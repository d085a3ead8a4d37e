"""The hub's own routes (``wire.routetable``, owner ``hub``): writes to a writable dataset,
answered by its ``Incoming`` (``hub/uploads.py``). Who may call them: a ``write:DS`` or admin
token (scope ``write``); a read-only dataset answers 403 whatever the token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from spokefs.errors import BadRequest, DigestMismatch, NoSpace
from spokefs.hub.backend import HubBackend
from spokefs.hub.uploads import Incoming, check_upload_path
from spokefs.wire.bodies import json_body
from spokefs.wire.headers import H_OFFSET, H_SIZE, H_VERSION
from spokefs.wire.paths import check_dataset_name
from spokefs.wire.server import check_version


def _int_header(request: web.Request, name: str, default: int | None = None) -> int:
    raw = request.headers.get(name)
    if raw is None:
        if default is None:
            raise BadRequest(f"an upload needs the {name} header")
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19):
        raise BadRequest(f"{name} must be a number of bytes, not {raw[:40]!r}")
    return int(raw)


def upload_request(request: web.Request) -> tuple[str, int, int, str]:
    """A PUT's path, size, offset and version, checked (a hub's and a spoke's alike)."""
    path = check_upload_path(request.match_info["path"])
    size = _int_header(request, H_SIZE)
    offset = _int_header(request, H_OFFSET, 0)
    version = request.headers.get(H_VERSION, "")
    if not check_version(version):
        raise BadRequest(f"an upload needs the {H_VERSION} header: the version the whole "
                         "file digests to (integrity.version_id)")
    return path, size, offset, version


async def commit_request(request: web.Request) -> tuple[list[str] | None, str | None]:
    """A commit's paths or prefix, checked."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise BadRequest("a commit's body is a JSON object: {\"paths\": [...]} or "
                         "{\"prefix\": \"FOLDER/\"}")
    paths, prefix = body.get("paths"), body.get("prefix")
    if (paths is None) == (prefix is None):
        raise BadRequest("a commit names either paths or a prefix")
    if paths is not None:
        if not (isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths)):
            raise BadRequest("paths must be a non-empty list of file paths")
        return [check_upload_path(p) for p in paths], None
    if not (isinstance(prefix, str) and prefix.strip("/")):
        raise BadRequest("prefix must name a folder of the dataset")
    return None, check_upload_path(prefix) + "/"


async def chunks(request: web.Request) -> AsyncIterator[bytes]:
    # As they arrive (iter_any), not in fixed sizes: a connection lost raises at the next
    # read and drops what the reader buffered, so a fixed-size read would lose a body cut
    # short's tail (``Incoming._write`` gathers the pieces into large writes).
    async for chunk in request.content.iter_any():
        yield chunk


class HubRoutes:
    def __init__(self, backend: HubBackend) -> None:
        self.backend = backend

    def _incoming(self, request: web.Request) -> tuple[str, Incoming]:
        ds = check_dataset_name(request.match_info["ds"])
        st = self.backend.writable(ds)
        assert st.uploads is not None
        return ds, st.uploads

    async def uploads(self, request: web.Request) -> web.Response:
        ds, inc = self._incoming(request)
        return web.json_response({"dataset": ds, "uploads": await asyncio.to_thread(inc.listing)})

    async def upload(self, request: web.Request) -> web.Response:
        """201 once the file is whole and checked; 200 while bytes are missing."""
        ds, inc = self._incoming(request)
        path, size, offset, version = upload_request(request)
        counters = self.backend.counters
        try:
            done = await inc.receive(path, size, version, offset, chunks(request),
                                     counters.upload_bytes.labels(ds).inc)
        except (DigestMismatch, NoSpace) as exc:
            counters.uploads_refused.labels(ds, exc.code).inc()
            raise
        return web.json_response({"dataset": ds, **done}, status=201 if done["whole"] else 200)

    async def upload_state(self, request: web.Request) -> web.Response:
        ds, inc = self._incoming(request)
        path = check_upload_path(request.match_info["path"])
        return web.json_response({"dataset": ds, **await asyncio.to_thread(inc.state, path)})

    async def discard_upload(self, request: web.Request) -> web.Response:
        ds, inc = self._incoming(request)
        path = check_upload_path(request.match_info["path"])
        await asyncio.to_thread(inc.discard, path)
        return web.json_response({"dataset": ds, "path": path, "discarded": True})

    async def commit(self, request: web.Request) -> web.Response:
        """``{"paths": [...]}`` or ``{"prefix": "step-100/"}``: published as one snapshot."""
        ds, _ = self._incoming(request)
        paths, prefix = await commit_request(request)
        return web.json_response(await self.backend.commit(ds, paths, prefix), status=201)
