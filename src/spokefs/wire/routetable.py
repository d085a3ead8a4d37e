"""Every HTTP route of hub, spoke and replica worker, in one table: method, path, handler,
who may call it (``Scope``), and whether a replica worker forwards it to the primary.

Everything that depends on a route's scope is made from this table and nothing else: the
aiohttp routes (``bind``), the authorization check (``wire.server.auth_middleware``), a
replica's forwarding (``spoke.replica``), the admin audit and the OpenAPI document
(``openapi``). A route that is not in the table cannot be registered (``bind`` is the only
way in), and a request that matches none is answered 404 by aiohttp after its token was
checked, never forwarded.

Scopes:
- ``public``: no token; the dashboard's static files and the OpenAPI document. Nothing in
  them names a dataset, a path or a figure.
- ``token``: any token the server knows; the answer holds only what the token may read
  (``/v1/datasets``, ``/v1/status``, the root index, ``/metrics``).
- ``read``: read of the dataset the path names (``{ds}``, or the dataset of ``{ref}``).
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


class Scope(enum.StrEnum):
    PUBLIC = "public"
    TOKEN = "token"
    READ = "read"
    ADMIN = "admin"
    INTERNAL = "internal"


class Owner(enum.StrEnum):
    """Whose handler answers: every server's API, the spoke's own routes, a replica
    worker's, the dashboard's files."""

    API = "api"
    SPOKE = "spoke"
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


_A, _S, _R, _U = Owner.API, Owner.SPOKE, Owner.REPLICA, Owner.UI
_DS = "/v1/datasets/{ds}"
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
          summary="fetch (and pin) files ahead"),
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
    # A replica worker's own.
    Route("POST", "/v1/workers/flush", "flush", Scope.INTERNAL, _R,
          summary="a replica worker reports what it counted now"),
    # Every server's (wire.server.Api).
    Route("GET", "/v1/openapi.json", "openapi", Scope.PUBLIC, _A,
          summary="this document"),
    Route("GET", "/metrics", "metrics", Scope.TOKEN, _A, primary=True,
          summary="Prometheus metrics"),
    Route("GET", "/v1/status", "status", Scope.TOKEN, _A, primary=True,
          summary="the server's state; without admin, only the token's datasets"),
    Route("GET", "/v1/datasets", "list_datasets", Scope.TOKEN, _A,
          summary="the datasets the token may read"),
    Route("GET", _DS, "get_dataset", Scope.READ, _A, summary="a dataset and its snapshots"),
    Route("POST", _DS + "/snapshots", "create_snapshot", Scope.ADMIN, _A, primary=True,
          summary="record a new snapshot (hub)"),
    Route("GET", _DS + "/snapshots/{snap}", "get_snapshot", Scope.READ, _A,
          summary="a snapshot"),
    Route("GET", _DS + "/snapshots/{snap}/manifest", "get_manifest", Scope.READ, _A,
          summary="a snapshot's manifest (gzip'd JSON)"),
    Route("GET", _DS + "/snapshots/{snap}/entries/{path:.*}", "get_entry", Scope.READ, _A,
          summary="a file or folder of a snapshot"),
    Route("GET", _DS + "/objects/{version}", "get_object", Scope.READ, _A,
          summary="bytes of a file version (Range; HEAD too)"),
    Route("POST", _DS + "/blocks", "read_blocks", Scope.READ, _A,
          summary="a batch read: many whole blocks, framed with their digests"),
    Route("POST", _DS + "/digests", "digests", Scope.READ, _A, primary=True,
          summary="what file versions commit to: size and block digests"),
    # The dashboard: before "/{ref}", which would take "/ui".
    Route("GET", "/ui", "redirect", Scope.PUBLIC, _U, summary="the dashboard"),
    Route("GET", "/ui/", "page", Scope.PUBLIC, _U, summary="the dashboard"),
    Route("GET", "/ui/app.js", "script", Scope.PUBLIC, _U, summary="the dashboard's script"),
    Route("GET", "/ui/style.css", "style", Scope.PUBLIC, _U, summary="the dashboard's style"),
    Route("GET", "/", "root_index", Scope.TOKEN, _A, summary="the readable datasets (HTML)"),
    Route("GET", "/{ref}", "plain_redirect", Scope.READ, _A, summary="to the dataset's folder"),
    Route("GET", "/{ref}/{path:.*}", "plain_read", Scope.READ, _A,
          summary="a file by path (Range; HEAD too), or a folder's index (HTML)"),
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


def openapi(owners: Iterable[Owner], title: str) -> dict[str, object]:
    """An OpenAPI 3.1 document of the routes a server of these owners answers: paths,
    methods and the scope each needs (``x-spokefs-scope``)."""
    paths: dict[str, dict[str, object]] = {}
    for r in routes_of(owners):
        path = canonical(r.path)
        params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                  for p in _params(path)]
        op: dict[str, object] = {
            "summary": r.summary, "operationId": f"{r.owner}_{r.handler}",
            "x-spokefs-scope": str(r.scope),
            "responses": {"200": {"description": "ok"},
                          "default": {"description": 'an error: {"error": {"code", '
                                                     '"message"}}'}}}
        if params:
            op["parameters"] = params
        if r.scope is not Scope.PUBLIC:
            op["security"] = [{"bearer": []}]
        if r.method in ("POST", "PUT"):
            op["requestBody"] = {"required": False, "content": {
                "application/json": {"schema": {"type": "object"}}}}
        paths.setdefault(path, {})[r.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"},
            "components": {"securitySchemes": {"bearer": {"type": "http",
                                                          "scheme": "bearer"}}},
            "paths": paths}


def _params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]
