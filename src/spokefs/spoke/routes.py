"""The spoke's own routes: announced orders, epochs, warm-up, residency, purge, and the
cache's locations for processes on the same host that read it directly (replica workers,
mounts).

See docs/protocol.md ("Spoke control", "Reading the cache directly"). Paths in a request
name files of one snapshot (``snapshot``, default latest, resolved once); an unknown path is
a 400 naming it.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

from aiohttp import web

from spokefs.errors import BadRequest
from spokefs.manifest import Manifest
from spokefs.spoke.service import SpokeBackend
from spokefs.wire.backend import ReadContext
from spokefs.wire.paths import check_dataset_name
from spokefs.wire.server import check_version, parse_block_list


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()  # aiohttp inflates a gzip'd body (orders compress ~10x)
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise BadRequest(f"request body is not valid gzip: {exc}") from exc
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"request body is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    return doc


def _read_context(doc: object) -> tuple[ReadContext, tuple[int, int]]:
    if not isinstance(doc, dict):
        raise BadRequest('"read" must be an object')
    start, end, size = doc.get("start"), doc.get("end"), doc.get("size")
    if (type(start) is not int or type(end) is not int or not 0 <= start <= end
            or (size is not None and type(size) is not int)):
        raise BadRequest('a read needs integers 0 <= "start" <= "end"')
    path = doc.get("path")
    return ReadContext(str(path) if path is not None else None, size,
                       str(doc.get("reader", ""))[:200], str(doc.get("job", ""))[:200]), (
        start, end)


def _job(request: web.Request) -> str:
    job = request.match_info["job"]
    if not job or len(job) > 200 or "/" in job:
        raise BadRequest(f"invalid job name {job!r}")
    return job


def select_files(m: Manifest, doc: dict[str, Any]) -> list[int]:
    """Manifest indexes named by ``paths`` (list), ``indexes`` (list) or ``prefix`` (folder)."""
    if "indexes" in doc:
        idx = doc["indexes"]
        if not isinstance(idx, list) or not all(isinstance(i, int) and 0 <= i < len(m)
                                                for i in idx):
            raise BadRequest(f"indexes must be integers in [0, {len(m)})")
        return idx
    if "paths" in doc:
        out, unknown = [], []
        for p in doc["paths"]:
            i = m.index(str(p).strip("/"))
            if i is None:
                unknown.append(p)
            else:
                out.append(i)
        if unknown:
            raise BadRequest(f"{len(unknown)} paths are not in {m.dataset}@{m.snapshot}, "
                             f"e.g. {unknown[:3]}")
        return out
    prefix = str(doc.get("prefix", "")).strip("/")
    if prefix and not m.is_dir(prefix) and m.lookup(prefix) is None:
        raise BadRequest(f"{prefix!r} is not a file or folder of {m.dataset}@{m.snapshot}")
    if m.lookup(prefix) is not None:
        return [m.index(prefix)]  # type: ignore[list-item]
    start = f"{prefix}/" if prefix else ""
    return [i for i, p in enumerate(m.paths) if p.startswith(start)]


class SpokeRoutes:
    def __init__(self, backend: SpokeBackend) -> None:
        self.backend = backend

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/datasets/{ds}/jobs/{job}/order", self.order),
            web.post("/v1/datasets/{ds}/jobs/{job}/epoch", self.epoch),
            web.delete("/v1/datasets/{ds}/jobs/{job}", self.end_job),
            web.post("/v1/datasets/{ds}/warm", self.warm),
            web.post("/v1/datasets/{ds}/residency", self.residency),
            web.post("/v1/purge", self.purge),
            web.post("/v1/datasets/{ds}/locate", self.locate),
            web.post("/v1/datasets/{ds}/reads", self.reads),
            web.post("/v1/workers/counts", self.counts),
        ]

    async def _manifest(self, ds: str, doc: dict[str, Any]) -> Manifest:
        snap = await self.backend.resolve(ds, str(doc.get("snapshot") or "latest"))
        return await self.backend.manifest(ds, snap)

    async def order(self, request: web.Request) -> web.Response:
        ds, job = check_dataset_name(request.match_info["ds"]), _job(request)
        doc = await _body(request)
        m = await self._manifest(ds, doc)
        files = select_files(m, doc)
        ranges = doc.get("ranges")
        if ranges is not None and len(ranges) != len(files):
            raise BadRequest("ranges must have one [offset, length] per file")
        if self.backend.prefetch is None:
            raise BadRequest("this spoke runs without prefetch (--no-prefetch)")
        self.backend.prefetch.use_manifest(m)
        self.backend.prefetch.announce(ds, job, int(doc.get("epoch", 0)), files,
                                       [tuple(r) for r in ranges] if ranges else None)
        return web.json_response({"dataset": ds, "snapshot": m.snapshot, "job": job,
                                  "files": len(files),
                                  "bytes": sum(m.sizes[i] for i in files)})

    async def epoch(self, request: web.Request) -> web.Response:
        ds, job = check_dataset_name(request.match_info["ds"]), _job(request)
        doc = await _body(request)
        if self.backend.prefetch is not None:
            self.backend.prefetch.epoch(ds, job, int(doc.get("epoch", 0)))
        return web.json_response({"dataset": ds, "job": job, "epoch": doc.get("epoch", 0)})

    async def end_job(self, request: web.Request) -> web.Response:
        ds, job = check_dataset_name(request.match_info["ds"]), _job(request)
        if self.backend.prefetch is not None:
            self.backend.prefetch.job_ended(ds, job)
        return web.json_response({"dataset": ds, "job": job, "ended": True})

    async def warm(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        m = await self._manifest(ds, doc)
        files = select_files(m, doc)
        plan = self.backend.warm(m, files, pin=bool(doc.get("pin", False)))
        return web.json_response({"dataset": ds, "snapshot": m.snapshot, **plan}, status=202)

    async def residency(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        m = await self._manifest(ds, doc)
        files = select_files(m, doc)
        return web.json_response({"dataset": ds, "snapshot": m.snapshot,
                                  **self.backend.residency(m, files)})

    async def locate(self, request: web.Request) -> web.Response:
        """``{"blocks": [[version, index], ...], "fetch"?: bool, "damaged"?: bool, "read"?:
        {"start", "end", "path"?, "size"?, "reader"?, "job"?}, "since"?: cursor}`` -> where
        each block is in the cache (or null), the cache folder's path and id
        (spokefs.cache.shared), and with ``since`` the blocks that became resident since."""
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        keys = parse_block_list(doc)
        read = doc.get("read")
        ctx = span = None
        if read is not None:
            ctx, span = _read_context(read)
        if doc.get("damaged"):  # a reader found these bytes wrong: check, drop if so
            self.backend.recheck(keys)
        blocks = await self.backend.locate(ds, keys, bool(doc.get("fetch", False)), ctx, span)
        return web.json_response({"cache": self.backend.cache_info(), "blocks": blocks,
                                  **self._news(ds, doc)})

    async def reads(self, request: web.Request) -> web.Response:
        """``{"reads": [[version, start, end, {context}], ...], "by"?: "mount", "bytes"?:
        n}``: reads served elsewhere from the cache, for the planner (and the eviction
        order, and the counts; ``bytes``: more bytes read so, of reads already told of)."""
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        raw = doc.get("reads")
        if not isinstance(raw, list) or len(raw) > 100_000:
            raise BadRequest('"reads" must be a list of [version, start, end, {context}]')
        reads = []
        for r in raw:
            if (not isinstance(r, list) or len(r) != 4 or not isinstance(r[0], str)
                    or not check_version(r[0])):
                raise BadRequest(f"bad read {str(r)[:100]}")
            ctx, (start, end) = _read_context({**(r[3] or {}), "start": r[1], "end": r[2]})
            reads.append((r[0], start, end, ctx))
        extra = doc.get("bytes", 0)
        if type(extra) is not int or extra < 0:
            raise BadRequest('"bytes" must be an integer >= 0')
        self.backend.reads_elsewhere(ds, reads, by_mount=doc.get("by") == "mount",
                                     extra_bytes=extra)
        return web.json_response({"reads": len(reads), **self._news(ds, doc)})

    def _news(self, ds: str, doc: dict[str, Any]) -> dict[str, object]:
        """``"since": cursor`` in a locate or reads body asks for the blocks that became
        resident since (spokefs.cache.feed); the answer carries them as ``"news"``."""
        since = doc.get("since")
        if since is None:
            return {}
        if type(since) is not int or since < 0:
            raise BadRequest('"since" must be an integer >= 0 (a cursor from "news")')
        return {"news": self.backend.news(ds, since)}

    async def counts(self, request: web.Request) -> web.Response:
        """What a replica worker counted (hits, misses, served bytes, damaged blocks)."""
        doc = await _body(request)
        if not all(isinstance(v, int) for v in doc.values()):
            raise BadRequest("counts must be integers")
        self.backend.add_counts(doc)
        return web.json_response({})

    async def purge(self, request: web.Request) -> web.Response:
        """``{}``: every block; ``{"dataset": ds}``: the dataset's; ``{"dataset": ds, "keep":
        ["latest", SNAPSHOT...]}``: the dataset's blocks of versions in none of those
        snapshots (stale after a source change)."""
        doc = await _body(request)
        ds = doc.get("dataset")
        if ds is not None:
            check_dataset_name(ds)
        keep = doc.get("keep")
        if keep is not None and (not isinstance(keep, list) or not keep
                                 or not all(isinstance(k, str) for k in keep)):
            raise BadRequest('"keep" must be a non-empty list of snapshot ids or "latest"')
        freed = await self.backend.purge(ds, keep)
        return web.json_response({"dataset": ds, "freed_bytes": freed})
