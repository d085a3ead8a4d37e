"""Every HTTP route of hub, spoke and replica worker, in one table: method, path, handler,
who may call it (``Scope``), and whether a replica worker forwards it to the primary.

Everything that depends on a route's scope is made from this table and nothing else: the
aiohttp routes (``bind``), the authorization check (``wire.server.auth_middleware``), a
replica's forwarding (``spoke.replica``), the admin audit and the OpenAPI document
(``openapi``). A route that is not in the table cannot be registered (``bind`` is the only
way in), and a request that matches none is answered 404 by aiohttp after its token was
checked, never forwarded.

Scopes:
- ``public``: no token; the dashboard's static files, the OpenAPI document and the probes
  (``/healthz``, ``/readyz``). Nothing in them names a dataset, a path or a figure.
- ``token``: any token the server knows; the answer holds only what the token may read
  (``/v1/datasets``, ``/v1/status``, the root index, ``/metrics``).
- ``read``: read of the dataset the path names (``{ds}``, or the dataset of ``{ref}``).
- ``write``: write of the dataset the path names (a ``write:DS`` or admin token): uploads
  to a writable dataset and their commits (``hub/uploads.py``).
- ``admin``: an admin token (purge, warm-up, pins, residency, inventory, snapshots).
- ``internal``: the spoke's own processes (replica workers over their unix socket; a mount
  on the spoke's host, which presents the cache folder's key) and tier members (a token of
  scope ``tier``). The locate, reads and counts routes, and every request a member marks
  with ``X-Spokefs-Peer``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from spokefs.wire.headers import H_JOB, H_OFFSET, H_READER, H_SIZE, H_SNAPSHOT, H_VERSION
from spokefs.wire.paths import NAME as DATASET_NAME


class Scope(enum.StrEnum):
    PUBLIC = "public"
    TOKEN = "token"
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"
    INTERNAL = "internal"


class Owner(enum.StrEnum):
    """Whose handler answers: every server's API, the spoke's own routes, writes (a hub's
    ``hub.routes.HubRoutes``, a spoke's write-back ``spoke.routes.WriteRoutes``: one
    protocol), a replica worker's, the dashboard's files."""

    API = "api"
    SPOKE = "spoke"
    WRITES = "writes"
    REPLICA = "replica"
    UI = "ui"


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: str        # the attribute of the owner that answers
    scope: Scope
    owner: Owner
    primary: bool = False  # on a replica worker: forwarded to the primary, which answers
    job: bool = False      # a job's route: the token that announced the job owns it
    summary: str = ""
    ok: tuple[int, ...] = (200,)  # the statuses of a success (the OpenAPI document's)


_A, _S, _W, _R, _U = Owner.API, Owner.SPOKE, Owner.WRITES, Owner.REPLICA, Owner.UI
_DS = "/v1/datasets/{ds}"
_UP = _DS + "/uploads"
_JOB = _DS + "/jobs/{job}"

ROUTES: tuple[Route, ...] = (
    # The spoke's own routes (spoke.routes.SpokeRoutes). Jobs: the primary keeps them.
    Route("POST", _JOB + "/order", "order", Scope.READ, _S, primary=True, job=True,
          summary="announce a job's order of reads for an epoch"),
    Route("POST", _JOB + "/epoch", "epoch", Scope.READ, _S, primary=True, job=True,
          summary="a job starts an epoch"),
    Route("POST", _JOB + "/steps", "steps", Scope.READ, _S, primary=True, job=True,
          summary="a job's step reports (data wait against step time)"),
    Route("DELETE", _JOB, "end_job", Scope.READ, _S, primary=True, job=True,
          summary="a job ended"),
    Route("POST", _DS + "/warm", "warm", Scope.ADMIN, _S, primary=True,
          summary="fetch (and pin) files ahead", ok=(202,)),
    Route("POST", _DS + "/unpin", "unpin", Scope.ADMIN, _S, primary=True,
          summary="release warm-up pins"),
    Route("GET", "/v1/inventory", "inventory", Scope.ADMIN, _S, primary=True,
          summary="what the cache holds, per dataset and snapshot"),
    Route("POST", _DS + "/residency", "residency", Scope.ADMIN, _S, primary=True,
          summary="how much of the selected files is cached"),
    Route("POST", "/v1/purge", "purge", Scope.ADMIN, _S, primary=True,
          summary="drop cached blocks"),
    Route("POST", _DS + "/locate", "locate", Scope.INTERNAL, _S, primary=True,
          summary="where blocks are in the cache files (same-host readers)"),
    Route("POST", _DS + "/reads", "reads", Scope.INTERNAL, _S, primary=True,
          summary="reads served from the cache files elsewhere (same-host readers)"),
    Route("POST", "/v1/workers/counts", "counts", Scope.INTERNAL, _S, primary=True,
          summary="a replica worker's counters"),
    # Writes to a writable dataset: the hub's (hub.routes.HubRoutes), or a spoke's
    # write-back (spoke.routes.WriteRoutes; its primary worker answers them).
    Route("GET", _UP, "uploads", Scope.WRITE, _W, primary=True,
          summary="a writable dataset's uploads not yet committed (a spoke: and its commits "
          "not yet published at the hub)"),
    Route("PUT", _UP + "/{path:.*}", "upload", Scope.WRITE, _W, primary=True, ok=(200, 201),
          summary="bytes of a file to publish, from an offset (resumable), checked whole "
          "against the version declared"),
    Route("GET", _UP + "/{path:.*}", "upload_state", Scope.WRITE, _W, primary=True,
          summary="how much of an upload was received, and whether it is whole"),
    Route("DELETE", _UP + "/{path:.*}", "discard_upload", Scope.WRITE, _W, primary=True,
          summary="drop an upload not yet committed"),
    Route("POST", _DS + "/commit", "commit", Scope.WRITE, _W, primary=True, ok=(201, 202),
          summary="publish whole uploads together, as one new snapshot (a spoke: 202, "
          "durable there, published at the hub once uploaded)"),
    # A replica worker's own.
    Route("POST", "/v1/workers/flush", "flush", Scope.INTERNAL, _R,
          summary="a replica worker reports what it counted now"),
    # Every server's (wire.server.Api).
    Route("GET", "/v1/openapi.json", "openapi", Scope.PUBLIC, _A,
          summary="this document"),
    # Probes (before "/{ref}", which would take them): no token, no data in the answer.
    # Each worker's own loop answers /healthz; /readyz is the spoke's (its primary's) state.
    Route("GET", "/healthz", "healthz", Scope.PUBLIC, _A, ok=(200, 503),
          summary="liveness: the event loop answers in time (503: it lags)"),
    Route("GET", "/readyz", "readyz", Scope.PUBLIC, _A, primary=True, ok=(200, 503),
          summary="readiness: the upstream or the cache is usable (hub: its datasets)"),
    Route("GET", "/metrics", "metrics", Scope.TOKEN, _A, primary=True,
          summary="Prometheus metrics"),
    Route("GET", "/v1/status", "status", Scope.TOKEN, _A, primary=True,
          summary="the server's state; without admin, only the token's datasets"),
    Route("GET", "/v1/datasets", "list_datasets", Scope.TOKEN, _A,
          summary="the datasets the token may read"),
    Route("GET", _DS, "get_dataset", Scope.READ, _A, summary="a dataset and its snapshots"),
    Route("POST", _DS + "/snapshots", "create_snapshot", Scope.ADMIN, _A, primary=True,
          summary="record a new snapshot (hub)", ok=(201,)),
    Route("GET", _DS + "/snapshots/{snap}", "get_snapshot", Scope.READ, _A,
          summary="a snapshot"),
    Route("GET", _DS + "/snapshots/{snap}/manifest", "get_manifest", Scope.READ, _A,
          summary="a snapshot's manifest (gzip'd JSON)"),
    Route("GET", _DS + "/snapshots/{snap}/entries/{path:.*}", "get_entry", Scope.READ, _A,
          summary="a file or folder of a snapshot"),
    Route("GET", _DS + "/objects/{version}", "get_object", Scope.READ, _A,
          summary="bytes of a file version (Range; HEAD too)", ok=(200, 206)),
    Route("POST", _DS + "/blocks", "read_blocks", Scope.READ, _A,
          summary="a batch read: many whole blocks, framed with their digests"),
    Route("POST", _DS + "/digests", "digests", Scope.READ, _A, primary=True,
          summary="what file versions commit to: size and block digests"),
    # The dashboard: before "/{ref}", which would take "/ui".
    Route("GET", "/ui", "redirect", Scope.PUBLIC, _U, summary="the dashboard", ok=(302,)),
    Route("GET", "/ui/", "page", Scope.PUBLIC, _U, summary="the dashboard"),
    Route("GET", "/ui/app.js", "script", Scope.PUBLIC, _U, summary="the dashboard's script"),
    Route("GET", "/ui/style.css", "style", Scope.PUBLIC, _U, summary="the dashboard's style"),
    Route("GET", "/", "root_index", Scope.TOKEN, _A, summary="the readable datasets (HTML)"),
    Route("GET", "/{ref}", "plain_redirect", Scope.READ, _A, summary="to the dataset's folder",
          ok=(301,)),
    Route("GET", "/{ref}/{path:.*}", "plain_read", Scope.READ, _A,
          summary="a file by path (Range; HEAD too), or a folder's index (HTML)",
          ok=(200, 206, 301)),
)

def canonical(path: str) -> str:
    """A path as aiohttp's ``resource.canonical`` names it: ``{path:.*}`` is ``{path}``."""
    return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path)


# (method, aiohttp's canonical path) -> route. aiohttp adds HEAD beside each GET.
_BY_KEY: dict[tuple[str, str], Route] = {}
for _r in ROUTES:
    _BY_KEY[(_r.method, canonical(_r.path))] = _r
    if _r.method == "GET":
        _BY_KEY[("HEAD", canonical(_r.path))] = _r
assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES), "a route twice in ROUTES"


def lookup(method: str, canonical: str) -> Route | None:
    """The table's route of a matched request (``resource.canonical``); None: matched no
    route (aiohttp answers 404 or 405)."""
    return _BY_KEY.get((method, canonical))


def routes_of(owners: Iterable[Owner]) -> list[Route]:
    wanted = set(owners)
    return [r for r in ROUTES if r.owner in wanted]


def bind(handlers: dict[Owner, Any], forward: Any = None) -> list[web.RouteDef]:
    """aiohttp routes, in the table's order, for the owners in ``handlers``
    (owner -> the object whose attributes answer). With ``forward`` (a replica worker),
    every ``primary`` route is answered by it instead, whoever its owner."""
    out = []
    for r in ROUTES:
        if forward is not None and r.primary:
            fn = forward
        elif r.owner in handlers:
            fn = getattr(handlers[r.owner], r.handler)
        else:
            continue
        # web.get also answers HEAD, as every GET here does (sizes, plain reads).
        out.append(web.get(r.path, fn) if r.method == "GET" else web.route(r.method, r.path, fn))
    return out


# -- the OpenAPI document ------------------------------------------------------------------
# What each path parameter and request body may hold, as the handlers check it (a value past
# these is a 4xx naming it, never a 5xx): ``wire.paths`` (names), ``wire.server``
# (``check_version``, batch reads, digests), ``spoke.routes`` (``Fields``: integers are
# int64 and never negative, unknown fields are ignored, null is absent).
_NAME = {"type": "string", "pattern": f"^{DATASET_NAME.pattern}$"}
_SNAPSHOT = {"type": "string", "pattern": f"^{DATASET_NAME.pattern}$",
             "description": 'a snapshot id, or "latest"'}
_VERSION = {"type": "string", "pattern": "^[A-Za-z0-9]{1,64}$", "description": "a file version"}
_PARAMS: dict[str, dict[str, object]] = {
    "ds": _NAME,
    "snap": _SNAPSHOT,
    "version": _VERSION,
    "job": {"type": "string", "pattern": "^[^/]{1,200}$"},
    "ref": {"type": "string", "description": "a dataset, or DATASET@SNAPSHOT",
            "pattern": f"^{DATASET_NAME.pattern}(@{DATASET_NAME.pattern})?$"},
    "path": {"type": "string", "description": "a path in the snapshot (slashes included)"},
}


def _header(name: str, schema: dict[str, object], about: str) -> dict[str, object]:
    return {"name": name, "in": "header", "required": False, "schema": schema,
            "description": about}


_INT_HEADER = {"type": "string", "pattern": "^[0-9]{1,19}$"}
_RANGE = _header("Range", {"type": "string", "pattern": "^bytes=[0-9]*-[0-9]*$"},
                 "one byte range (RFC 9110): bytes=START-END, START- or -SUFFIX")
_STREAM = [_header(H_READER, {"type": "string", "maxLength": 200},
                   "names one sequential stream of reads (the planner's)"),
           _header(H_JOB, {"type": "string", "maxLength": 200}, "names the training job")]
# handler -> the request headers it reads, besides Authorization.
HEADERS: dict[str, list[dict[str, object]]] = {
    "get_object": [_RANGE, _header(H_SNAPSHOT, _SNAPSHOT, "the snapshot the reader reads "
                                   "from: a spoke keeps its files cached"), *_STREAM],
    "plain_read": [_RANGE, *_STREAM],
    "upload": [
        _header(H_SIZE, {**_INT_HEADER}, "the whole file's size in bytes (required)"),
        _header(H_VERSION, _VERSION, "the version the whole file digests to (required): "
                "integrity.version_id over the dataset's block size"),
        _header(H_OFFSET, {**_INT_HEADER}, "where this body starts in the file (default 0): "
                "the bytes received so far, to resume"),
    ],
}
# handler -> a body of raw bytes, not JSON.
RAW_BODIES = {"upload"}
_INT = {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1}
_TEXT = {"type": "string", "maxLength": 4096}
_FLAG = {"type": "boolean"}
_SNAPSHOTS = {"type": "array", "items": _SNAPSHOT}
_BLOCKS = {"type": "array", "minItems": 1, "items": {
    "type": "array", "prefixItems": [_VERSION, _INT], "minItems": 2, "maxItems": 2}}
_SELECT = {  # files of a snapshot: by path, by manifest index, or every file under a prefix
    "snapshot": _SNAPSHOT, "paths": {"type": "array", "items": _TEXT},
    "indexes": {"type": "array", "items": _INT}, "prefix": _TEXT}
_READ = {"type": "object", "properties": {
    "start": _INT, "end": _INT, "path": _TEXT, "size": _INT, "reader": _TEXT, "job": _TEXT}}
_SECONDS = {"type": "number", "minimum": 0, "maximum": 86_400}


def _object(props: dict[str, object], *required: str, **more: object) -> dict[str, object]:
    out: dict[str, object] = {"type": "object", "properties": props, **more}
    if required:
        out["required"] = list(required)
    return out


# handler -> the JSON body it reads (a route that takes a body and is not named here: ``{}``).
BODIES: dict[str, dict[str, object]] = {
    "order": _object({**_SELECT, "epoch": _INT, "ranges": {"type": "array", "items": {
        "type": "array", "prefixItems": [_INT, {**_INT, "minimum": 1}],
        "minItems": 2, "maxItems": 2}}}),
    "epoch": _object({"epoch": _INT}),
    "steps": _object({"steps": {"type": "array", "items": {
        "type": "array", "prefixItems": [_SECONDS, _SECONDS], "minItems": 2, "maxItems": 2}}},
        "steps"),
    "warm": _object({**_SELECT, "pin": _FLAG}),
    "unpin": _object(_SELECT),
    "residency": _object(_SELECT),
    "purge": _object({"dataset": _NAME, "snapshot": _SNAPSHOT,
                      "keep": {**_SNAPSHOTS, "minItems": 1},
                      "paths": {"type": "array", "items": _TEXT}}),
    "locate": _object({"blocks": _BLOCKS, "fetch": _FLAG, "damaged": _FLAG, "read": _READ,
                       "since": _INT, "snapshots": _SNAPSHOTS}, "blocks"),
    "reads": _object({"reads": {"type": "array", "items": {
        "type": "array", "minItems": 4, "maxItems": 4, "prefixItems": [
            _VERSION, _INT, _INT, {"anyOf": [_READ, {"type": "null"}]}]}},
        "by": _TEXT, "bytes": _INT, "since": _INT, "snapshots": _SNAPSHOTS}, "reads"),
    "counts": _object({}, additionalProperties=_INT, maxProperties=64),
    "flush": _object({}),
    "create_snapshot": _object({}),
    "commit": _object({"paths": {"type": "array", "items": _TEXT}, "prefix": _TEXT}),
    "read_blocks": _object({"blocks": _BLOCKS}, "blocks"),
    "digests": _object({"versions": {"type": "array", "minItems": 1, "items": _VERSION}},
                       "versions"),
}
_ERROR = _object({"error": _object({"code": {"type": "string"}, "message": {"type": "string"}},
                                   "code", "message")}, "error")
_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}}
# A probe's answer (``wire.server``): ok, and when not, a generic reason; nothing else.
_PROBE = _object({"ok": _FLAG, "reason": {"type": "string", "maxLength": 200}}, "ok",
                 additionalProperties=False)
_PROBES = {"healthz", "readyz"}
_STATUSES = {
    200: "ok", 201: "created", 202: "accepted: under way", 206: "the range asked for",
    301: "moved: the folder's URL ends in /", 302: "found: the page is at /ui/",
    400: "a malformed request (a path, a parameter, a body)",
    401: "no token, or one the server does not know",
    403: "a token that does not allow this request", 404: "no such dataset, snapshot, path",
    410: "a file version the hub can no longer serve", 413: "a body, or a list in it, too large",
    409: "out of step: an upload resumed at another offset, a commit of a path that exists",
    416: "a range past the end of the file",
    422: "the uploaded bytes are not the version declared (dropped: send it again)",
    429: "the server's table of jobs is full",
    502: "the upstream's answer was refused", 503: "the upstream is unavailable, or the "
    "server is out of file descriptors (Retry-After)",
    507: "no room on the server's disk for the upload"}


def _answers(r: Route, body: bool) -> dict[str, object]:
    """The statuses a route answers: its successes (``Route.ok``) and the errors that can
    come from where it is answered, each error a JSON ``{"error": {"code", "message"}}``."""
    codes = {*r.ok, 400, 503}  # a malformed request; overloaded (out of file descriptors)
    if r.scope is not Scope.PUBLIC:
        codes |= {401, 403}
    if _params(canonical(r.path)) or body:
        codes |= {404}
    if body:
        codes |= {413}
    if r.scope in (Scope.READ, Scope.ADMIN, Scope.INTERNAL):  # what a spoke asks its upstream
        codes |= {410, 502}
    if r.scope is Scope.WRITE:  # out of step, digest mismatch, no room
        codes |= {409} | ({422, 507} if r.handler in ("upload", "commit") else set())
    if "version" in r.path or r.handler == "plain_read":
        codes |= {416}
    if r.job:
        codes |= {429}
    out: dict[str, object] = {
        str(c): {"description": _STATUSES[c], **({"content": _ERROR_REF} if c >= 400 else {})}
        for c in sorted(codes)}
    if r.handler in _PROBES:  # ok or not, the probe's own document (503: also overloaded)
        out["200"] = {"description": "ok", "content": {"application/json": {"schema": _PROBE}}}
        out["503"] = {"description": "not live or not ready, with a generic reason; or "
                      "overloaded", "content": {"application/json": {"schema": {"anyOf": [
                          _PROBE, {"$ref": "#/components/schemas/error"}]}}}}
    return out


def openapi(owners: Iterable[Owner], title: str) -> dict[str, object]:
    """An OpenAPI 3.1 document of the routes a server of these owners answers: paths,
    methods, the scope each needs (``x-spokefs-scope``), what its path parameters and JSON
    body may hold and the statuses it answers."""
    paths: dict[str, dict[str, object]] = {}
    for r in routes_of(owners):
        path = canonical(r.path)
        params = [{"name": p, "in": "path", "required": True, "schema": _PARAMS[p]}
                  for p in _params(path)] + HEADERS.get(r.handler, [])
        body = r.method in ("POST", "PUT")
        op: dict[str, object] = {
            "summary": r.summary, "operationId": f"{r.owner}_{r.handler}",
            "x-spokefs-scope": str(r.scope), "responses": _answers(r, body)}
        if params:
            op["parameters"] = params
        if r.scope is not Scope.PUBLIC:
            op["security"] = [{"bearer": []}]
        if body:
            if r.handler in RAW_BODIES:
                op["requestBody"] = {"required": True, "content": {
                    "application/octet-stream": {"schema": {"type": "string",
                                                            "format": "binary"}}}}
            else:
                schema = BODIES.get(r.handler, _object({}))
                op["requestBody"] = {"required": "required" in schema, "content": {
                    "application/json": {"schema": schema}}}
        paths.setdefault(path, {})[r.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                           "schemas": {"error": _ERROR}},
            "paths": paths}


def _params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]
