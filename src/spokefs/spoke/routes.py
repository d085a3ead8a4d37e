"""The spoke's own routes: announced orders, epochs, warm-up, residency, purge, and the
cache's locations for processes on the same host that read it directly (replica workers,
mounts).

See docs/protocol.md ("Spoke control", "Reading the cache directly"). Paths in a request
name files of one snapshot (``snapshot``, default latest, resolved once); an unknown path is
a 400 naming it.

Every value a body carries is checked before it is used (``Fields``): a wrong type or an
out-of-range number is a 400 naming the field, a body or list past its bound a 413, never a
TypeError deep inside (a 500) or work that grows with a number the client picked.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from typing import Any

from aiohttp import web

from spokefs.errors import BadRequest, TooLarge
from spokefs.hub.routes import chunks, commit_request, upload_request
from spokefs.hub.uploads import check_upload_path
from spokefs.manifest import Manifest
from spokefs.planner.order import MAX_ORDER_ENTRIES, check_order
from spokefs.spoke.jobsignal import MAX_STEPS, check_steps
from spokefs.spoke.service import SpokeBackend
from spokefs.wire.backend import ReadContext
from spokefs.wire.bodies import MAX_BODY, decode_json, read_body
from spokefs.wire.paths import check_dataset_name, check_snapshot_id
from spokefs.wire.server import check_version, parse_block_list

MAX_LISTED = MAX_ORDER_ENTRIES  # files a request may name by "paths" or "indexes"
MAX_READS = 100_000         # reads in one "reads" body
MAX_READ_BYTES = 1 << 40    # bytes the reads of one body (or a locate's read) may span
MAX_KEEP = 1024             # snapshots a purge may keep
MAX_TEXT = 4096             # characters of a string field (a path, a prefix, a snapshot)
INT_MAX = (1 << 63) - 1     # every integer field fits an int64 (arrays, sqlite, metrics)


_KINDS: dict[type, str] = {dict: "an object", list: "a list", str: "a string", int: "an integer",
                           float: "a number", bool: "a boolean", type(None): "null"}


def _show(value: object) -> str:
    """What a JSON value is, for a message: its kind, and a short form of a scalar."""
    kind = _KINDS.get(type(value), type(value).__name__)
    if isinstance(value, dict | list) or value is None:
        return kind
    text = repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


class Fields:
    """A request's JSON object, read field by field with the type and range each must have.

    A value that is not of the exact JSON type (a boolean is no integer, a float no integer,
    a number no string) or out of range is a BadRequest naming the field (``where`` prefixes
    the name inside a nested object: ``read.start``, ``reads[3].size``). null is absent.
    Unknown fields are ignored (a newer client may send more).
    """

    def __init__(self, doc: object, where: str = "") -> None:
        if type(doc) is not dict:
            label = f'"{where}"' if where else "the request body"
            raise BadRequest(f"{label} must be a JSON object, not {_show(doc)}")
        self.doc: dict[str, Any] = doc
        self.where = where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def name(self, key: str) -> str:
        """The field's name as a message shows it: ``"read.start"``."""
        return f'"{self.path(key)}"'

    def has(self, key: str) -> bool:
        return self.doc.get(key) is not None

    def raw(self, key: str) -> object:
        """The value as sent, for a checker of its own (``check_order``)."""
        return self.doc.get(key)

    def integer(self, key: str, default: int = 0, hi: int = INT_MAX) -> int:
        v = self.doc.get(key)
        if v is None:
            return default
        if type(v) is not int or not 0 <= v <= hi:
            raise BadRequest(f"{self.name(key)} must be an integer in [0, {hi}], not {_show(v)}")
        return v

    def flag(self, key: str) -> bool:
        v = self.doc.get(key)
        if v is None:
            return False
        if type(v) is not bool:
            raise BadRequest(f"{self.name(key)} must be true or false, not {_show(v)}")
        return v

    def text(self, key: str, default: str = "", most: int = MAX_TEXT) -> str:
        v = self.doc.get(key)
        if v is None:
            return default
        if type(v) is not str or len(v) > most:
            raise BadRequest(f"{self.name(key)} must be a string of at most {most} characters, "
                             f"not {_show(v)}")
        return v

    def items(self, key: str, kind: type, what: str, most: int) -> list[Any] | None:
        """A list whose every item has JSON type ``kind`` (``what`` names it), at most
        ``most`` long; None when absent."""
        v = self.doc.get(key)
        if v is None:
            return None
        if type(v) is not list:
            raise BadRequest(f"{self.name(key)} must be a list of {what}, not {_show(v)}")
        if len(v) > most:
            raise TooLarge(f"{self.name(key)} lists {len(v):,} items; at most {most:,}")
        if not set(map(type, v)) <= {kind}:  # one pass in C; the loop below finds the culprit
            i, bad = next((i, x) for i, x in enumerate(v) if type(x) is not kind)
            raise BadRequest(f"{self.name(key)} must be a list of {what}; item {i} is "
                             f"{_show(bad)}")
        return v

    def object(self, key: str) -> Fields | None:
        v = self.doc.get(key)
        return None if v is None else Fields(v, self.path(key))


def parse_json_body(raw: bytes | bytearray) -> Fields:
    """A control request's body (JSON, gzip'd or zlib'd JSON) as ``Fields``; {} when empty."""
    return Fields(decode_json(raw))


async def _body(request: web.Request) -> Fields:
    return parse_json_body(await read_body(request))


def _read_context(read: Fields, limit: int = MAX_READ_BYTES
                  ) -> tuple[ReadContext, tuple[int, int]]:
    """``{"start", "end", "path"?, "size"?, "reader"?, "job"?}``: a read, for the planner.
    The bytes it spans are bounded: the blocks it touches are counted and looked at one by
    one."""
    start, end = read.integer("start", -1), read.integer("end", -1)
    if start < 0 or end < 0 or end < start:
        raise BadRequest(f'a read needs integers 0 <= {read.name("start")} <= '
                         f'{read.name("end")}')
    if end - start > limit:
        raise BadRequest(f"a read spans at most {limit:,} bytes, not {end - start:,}")
    path = read.text("path") if read.has("path") else None
    size = read.integer("size") if read.has("size") else None
    # A reader's or job's name comes from a client's header: kept short, not refused.
    reader, job = read.text("reader", most=MAX_BODY), read.text("job", most=MAX_BODY)
    return ReadContext(path, size, reader[:200], job[:200]), (start, end)


def _job(request: web.Request) -> str:
    job = request.match_info["job"]
    if not job or len(job) > 200 or "/" in job:
        raise BadRequest(f"invalid job name {job!r}")
    return job


def _files_under(m: Manifest, path: str) -> range:
    """The manifest indexes of a file, or of every file in a folder (paths are sorted)."""
    path = path.strip("/")
    i = m.index(path) if path else None
    if i is not None:
        return range(i, i + 1)
    if path and not m.is_dir(path):
        raise BadRequest(f"{path[:200]!r} is neither a file nor a folder of "
                         f"{m.dataset}@{m.snapshot}")
    prefix = f"{path}/" if path else ""
    return range(bisect.bisect_left(m.paths, prefix),
                 bisect.bisect_left(m.paths, prefix + "\U0010ffff"))


def select_files(m: Manifest, doc: Fields) -> list[int]:
    """Manifest indexes named by ``paths`` (list), ``indexes`` (list) or ``prefix`` (folder)."""
    n = len(m)
    if doc.has("indexes"):
        idx = doc.items("indexes", int, "manifest indexes (integers)", MAX_LISTED)
        assert idx is not None
        if idx and (min(idx) < 0 or max(idx) >= n):
            bad = next(i for i in idx if not 0 <= i < n)
            raise BadRequest(f'"indexes" must be integers in [0, {n}), not {bad}')
        return idx
    if doc.has("paths"):
        paths = doc.items("paths", str, "paths (strings)", MAX_LISTED)
        assert paths is not None
        out, unknown = [], []
        for p in paths:
            i = m.index(p.strip("/"))
            if i is None:
                unknown.append(p)
            else:
                out.append(i)
        if unknown:
            raise BadRequest(f"{len(unknown)} paths are not in {m.dataset}@{m.snapshot}, "
                             f"e.g. {[p[:200] for p in unknown[:3]]}")
        return out
    prefix = doc.text("prefix").strip("/")
    if prefix and not m.is_dir(prefix) and m.lookup(prefix) is None:
        raise BadRequest(f"{prefix[:200]!r} is not a file or folder of "
                         f"{m.dataset}@{m.snapshot}")
    if m.lookup(prefix) is not None:
        return [m.index(prefix)]  # type: ignore[list-item]
    start = f"{prefix}/" if prefix else ""
    return [i for i, p in enumerate(m.paths) if p.startswith(start)]


def parse_order(m: Manifest, doc: Fields) -> tuple[int, list[int], list[tuple[int, int]] | None]:
    """An order body as the planner takes it: (epoch, manifest indexes, ranges clipped to
    their files or None), every entry checked (``check_order``) before anything is built."""
    epoch = doc.integer("epoch")
    files = select_files(m, doc)
    ranges = check_order(m.sizes, m.block_size, files, doc.raw("ranges"))
    return epoch, files, ranges


class SpokeRoutes:
    """The spoke's own handlers; their paths and scopes are in ``wire.routetable``."""

    def __init__(self, backend: SpokeBackend) -> None:
        self.backend = backend

    async def _manifest(self, ds: str, doc: Fields) -> Manifest:
        snap = check_snapshot_id(doc.text("snapshot") or "latest")
        return await self.backend.manifest(ds, await self.backend.resolve(ds, snap))

    async def order(self, request: web.Request) -> web.Response:
        ds, job = check_dataset_name(request.match_info["ds"]), _job(request)
        doc = await _body(request)
        m = await self._manifest(ds, doc)
        # Checked whole before the planner sees it: a bad entry leaves no order behind.
        epoch, files, ranges = parse_order(m, doc)
        prefetch = self.backend.prefetch  # the planner, unless --no-prefetch
        if prefetch is None:
            raise BadRequest("this spoke runs without prefetch (--no-prefetch)")
        prefetch.use_manifest(m)
        prefetch.announce(m.dataset, job, epoch, files, ranges)
        return web.json_response({"dataset": ds, "snapshot": m.snapshot, "job": job,
                                  "files": len(files),
                                  "bytes": sum(m.sizes[i] for i in files)})

    async def epoch(self, request: web.Request) -> web.Response:
        ds, job = check_dataset_name(request.match_info["ds"]), _job(request)
        epoch = (await _body(request)).integer("epoch")
        if self.backend.prefetch is not None:
            self.backend.prefetch.epoch(ds, job, epoch)
        return web.json_response({"dataset": ds, "job": job, "epoch": epoch})

    async def steps(self, request: web.Request) -> web.Response:
        """``{"steps": [[data_wait_s, step_s], ...]}``: a training job's batches, for the
        data-wait share next to the cache's state (spoke.jobsignal; ``spokefs.torch``)."""
        ds, job = check_dataset_name(request.match_info["ds"]), _job(request)
        raw = (await _body(request)).items("steps", list, "[data_wait_s, step_s] pairs",
                                           MAX_STEPS)
        if raw is None:
            raise BadRequest('a step report needs "steps": [[data_wait_s, step_s], ...]')
        js = self.backend.jobs.report(ds, job, check_steps(raw), time.monotonic())
        return web.json_response({"dataset": ds, "job": job, "steps": js.steps})

    async def end_job(self, request: web.Request) -> web.Response:
        ds, job = check_dataset_name(request.match_info["ds"]), _job(request)
        if self.backend.prefetch is not None:
            self.backend.prefetch.job_ended(ds, job)
        return web.json_response({"dataset": ds, "job": job, "ended": True})

    async def warm(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        pin = doc.flag("pin")
        m = await self._manifest(ds, doc)
        files = select_files(m, doc)
        plan = self.backend.warmups.warm(m, files, pin=pin)
        return web.json_response({"dataset": ds, "snapshot": m.snapshot, **plan}, status=202)

    async def inventory(self, request: web.Request) -> web.Response:
        """What the spoke holds: per dataset and snapshot (``spoke.warmup.Warmups.inventory``)."""
        return web.json_response({"datasets": await self.backend.warmups.inventory()})

    async def unpin(self, request: web.Request) -> web.Response:
        """Release warm-up pins of the selected files (same selection as ``warm``)."""
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        m = await self._manifest(ds, doc)
        files = select_files(m, doc)
        return web.json_response({"dataset": ds, "snapshot": m.snapshot,
                                  **self.backend.warmups.unpin(m, files)})

    async def residency(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        m = await self._manifest(ds, doc)
        files = select_files(m, doc)
        return web.json_response({"dataset": ds, "snapshot": m.snapshot,
                                  **await self.backend.warmups.residency(m, files)})

    async def locate(self, request: web.Request) -> web.Response:
        """``{"blocks": [[version, index], ...], "fetch"?: bool, "damaged"?: bool, "read"?:
        {"start", "end", "path"?, "size"?, "reader"?, "job"?}, "since"?: cursor}`` -> where
        each block is in the cache (or null), the cache folder's path and id
        (spokefs.cache.shared), and with ``since`` the blocks that became resident since."""
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        keys = parse_block_list(doc.doc)
        if any(i > INT_MAX for _, i in keys):
            raise BadRequest(f'a block index in "blocks" is at most {INT_MAX}')
        fetch, damaged, since = doc.flag("fetch"), doc.flag("damaged"), self._since(doc)
        read = doc.object("read")
        ctx = span = None
        if read is not None:
            ctx, span = _read_context(read)
        if damaged:  # a reader found these bytes wrong: check, drop if so
            self.backend.local.recheck(keys)
        self._snapshots_used(ds, doc)
        blocks = await self.backend.local.locate(ds, keys, fetch, ctx, span)
        return web.json_response({"cache": self.backend.local.cache_info(), "blocks": blocks,
                                  **self._news(ds, since)})

    async def reads(self, request: web.Request) -> web.Response:
        """``{"reads": [[version, start, end, {context}], ...], "by"?: "mount", "bytes"?:
        n}``: reads served elsewhere from the cache, for the planner (and the eviction
        order, and the counts; ``bytes``: more bytes read so, of reads already told of)."""
        ds = check_dataset_name(request.match_info["ds"])
        doc = await _body(request)
        raw = doc.items("reads", list, "[version, start, end, {context}]", MAX_READS)
        if raw is None:
            raise BadRequest('"reads" must be a list of [version, start, end, {context}]')
        extra, by, since = doc.integer("bytes"), doc.text("by"), self._since(doc)
        reads = []
        left = MAX_READ_BYTES  # for the whole body: each block read is touched one by one
        for n, r in enumerate(raw):
            if len(r) != 4 or type(r[0]) is not str or not check_version(r[0]):
                raise BadRequest(f'"reads[{n}]" must be [version id, start, end, {{context}}], '
                                 f"not {str(r)[:100]}")
            where = f"reads[{n}]"
            context = Fields({} if r[3] is None else r[3], where).doc
            ctx, (start, end) = _read_context(Fields({**context, "start": r[1], "end": r[2]},
                                                     where), left)
            left -= end - start
            reads.append((r[0], start, end, ctx))
        self._snapshots_used(ds, doc)
        self.backend.local.reads_elsewhere(ds, reads, by_mount=by == "mount", extra_bytes=extra)
        return web.json_response({"reads": len(reads), **self._news(ds, since)})

    def _snapshots_used(self, ds: str, doc: Fields) -> None:
        """``"snapshots": [id, ...]`` in a locate or reads body: the reader (a mount, a
        replica worker) uses them, so their files stay cached (``spoke.retention``)."""
        snaps = doc.items("snapshots", str, "snapshot ids", MAX_KEEP)
        if snaps:
            self.backend.snapshots_used(ds, [check_snapshot_id(s) for s in snaps])

    @staticmethod
    def _since(doc: Fields) -> int | None:
        """``"since": cursor`` in a locate or reads body asks for the blocks that became
        resident since (spokefs.cache.feed); the answer carries them as ``"news"``."""
        return doc.integer("since") if doc.has("since") else None

    def _news(self, ds: str, since: int | None) -> dict[str, object]:
        return {} if since is None else {"news": self.backend.local.news(ds, since)}

    async def counts(self, request: web.Request) -> web.Response:
        """What a replica worker counted since it last said (its served bytes; hits and
        misses come with its reads and locates)."""
        doc = await _body(request)
        if len(doc.doc) > 64:
            raise BadRequest(f"counts name at most 64 counters, not {len(doc.doc)}")
        counts = {k: doc.integer(k) for k in doc.doc}
        self.backend.local.add_counts(counts)
        return web.json_response({})

    async def purge(self, request: web.Request) -> web.Response:
        """``{}``: every block; ``{"dataset": ds}``: the dataset's; ``{"dataset": ds, "keep":
        ["latest", SNAPSHOT...]}``: the dataset's blocks of versions in none of those
        snapshots (stale after a source change); ``{"dataset": ds, "paths": [FILE or
        FOLDER...], "snapshot"?: id}``: the blocks of those files (in that snapshot, or
        latest)."""
        doc = await _body(request)
        ds = check_dataset_name(doc.raw("dataset")) if doc.has("dataset") else None
        if doc.has("paths"):
            if ds is None:
                raise BadRequest('purging "paths" needs a "dataset"')
            m = await self._manifest(ds, doc)
            paths = doc.items("paths", str, "file or folder paths", MAX_LISTED) or []
            versions = {m.versions[i] for p in paths for i in _files_under(m, p)}
            freed = await self.backend.retention.purge_versions(ds, versions)
            return web.json_response({"dataset": ds, "files": len(versions),
                                      "freed_bytes": freed})
        keep = doc.items("keep", str, 'snapshot ids or "latest"', MAX_KEEP)
        if keep is not None:
            if not keep:
                raise BadRequest('"keep" must be a non-empty list of snapshot ids or "latest"')
            keep = [check_snapshot_id(k) for k in keep]
        freed = await self.backend.retention.purge(ds, keep)
        return web.json_response({"dataset": ds, "freed_bytes": freed})


class WriteRoutes:
    """Writes to a writable dataset of the hub, written back (``spoke.writeback``): the
    hub's protocol (``hub.routes``), answered by the primary worker."""

    def __init__(self, backend: SpokeBackend) -> None:
        self.wb = backend.writeback

    async def uploads(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        return web.json_response(await self.wb.listing(ds))

    async def upload(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        path, size, offset, version = upload_request(request)
        done = await self.wb.receive(ds, path, size, version, offset, chunks(request))
        return web.json_response({"dataset": ds, **done}, status=201 if done["whole"] else 200)

    async def upload_state(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        path = check_upload_path(request.match_info["path"])
        inc = await self.wb.incoming(ds)
        return web.json_response({"dataset": ds, **await asyncio.to_thread(inc.state, path)})

    async def discard_upload(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        path = check_upload_path(request.match_info["path"])
        await self.wb.discard(ds, path)
        return web.json_response({"dataset": ds, "path": path, "discarded": True})

    async def commit(self, request: web.Request) -> web.Response:
        ds = check_dataset_name(request.match_info["ds"])
        paths, prefix = await commit_request(request)
        return web.json_response(await self.wb.commit(ds, paths, prefix), status=202)
