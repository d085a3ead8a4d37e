"""Who may make a request, decided where it is answered, from the route table's scope
(``wire.routetable``).

A request's principal is the token it presents (``wire.auth.TokenFile``), with two
exceptions, both for the spoke's own processes:
- on the spoke's unix socket (only this host's spoke user can reach it), a request a replica
  worker makes for itself carries no token and is the internal principal (read of every
  dataset, the internal routes, no admin); a request it forwards for a reader is marked
  ``X-Spokefs-Forwarded`` and carries the reader's own ``Authorization``, checked here again
  as if it had come over TCP;
- a same-host reader of the cache files (a mount's short circuit) presents the cache
  folder's key (``X-Spokefs-Internal``) for the internal routes, beside its own token.

``JobOwners`` keeps which token announced each job, so only it (or an admin) may change the
job; an owner is recorded when the announce succeeded, and leaves with the job or when the
job goes idle.
"""

from __future__ import annotations

import hmac
import re
import socket
import time
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from spokefs.audit import Audit
from spokefs.errors import (
    BadRequest,
    Forbidden,
    LimitReached,
    RateLimited,
    SpokeError,
    Unauthorized,
)
from spokefs.wire.auth import Token, TokenFile
from spokefs.wire.headers import H_FORWARDED, H_INTERNAL, H_PEER
from spokefs.wire.ratelimit import TokenBuckets
from spokefs.wire.routetable import Route, Scope, lookup

INTERNAL = Token("spoke-worker", admin=False, datasets=None, internal=True)
JOB_IDLE_S = 3600.0   # an owner unheard of for this long leaves (as the spoke's job signal)
MAX_JOBS = 65_536     # owners kept; past this, new jobs are refused until some leave


class JobOwners:
    """(dataset, job) -> the token name that announced it, sans-I/O (the clock is passed)."""

    def __init__(self, idle_s: float = JOB_IDLE_S, most: int = MAX_JOBS) -> None:
        self.idle_s = idle_s
        self.most = most
        self._owners: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def _expire(self, now: float) -> None:
        while self._owners:
            key, (_, seen) = next(iter(self._owners.items()))
            if now - seen <= self.idle_s:
                return
            del self._owners[key]

    def check(self, ds: str, job: str, token: Token, now: float) -> None:
        """Forbidden unless ``token`` may change the job; LimitReached for a new job when
        the table is full (never a job nobody owns)."""
        self._expire(now)
        entry = self._owners.get((ds, job))
        if entry is None:
            if len(self._owners) >= self.most:
                raise LimitReached(f"{len(self._owners):,} jobs are running, the most this "
                                   "spoke tracks; end finished jobs (DELETE .../jobs/JOB) or "
                                   f"wait {self.idle_s:g} s for idle ones to leave")
            return
        if entry[0] != token.name and not token.admin:
            raise Forbidden(f"job {job!r} of {ds!r} was announced with token {entry[0]!r}; "
                            f"token {token.name!r} may not change it")

    def done(self, ds: str, job: str, token: Token, ended: bool, now: float) -> None:
        """After a request on the job succeeded: its owner is the token that first did so
        (an admin's change keeps the owner), and an ended job has none."""
        key = (ds, job)
        if ended:
            self._owners.pop(key, None)
            return
        entry = self._owners.pop(key, None)
        self._owners[key] = (entry[0] if entry is not None else token.name, now)

    def __len__(self) -> int:
        return len(self._owners)


def _dataset_of(request: web.Request) -> str | None:
    ds = request.match_info.get("ds")
    if ds is None and "ref" in request.match_info:
        ds = request.match_info["ref"].partition("@")[0]
    return ds


def route_of(request: web.Request) -> Route | None:
    resource = request.match_info.route.resource
    return lookup(request.method, resource.canonical) if resource is not None else None


def _on_unix_socket(request: web.Request) -> bool:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def check_write(token: Token, ds: str | None) -> None:
    """Forbidden unless ``token`` may write ``ds`` (an upload's route, a same-host handoff)."""
    if not token.may_write(ds):
        raise Forbidden(f"token {token.name!r} ({token.scope}) may not write dataset {ds!r}: "
                        f"that needs a write:{ds} or admin token")


def auth_middleware(tokens: TokenFile, internal_key: Callable[[], bytes | None] | None = None,
                    jobs: JobOwners | None = None, audit: Audit | None = None) -> Callable:
    """``internal_key``: the cache folder's key (a spoke), or None. ``jobs``: where job
    owners are kept (the process that keeps jobs: a spoke's primary, not a replica worker,
    which forwards job requests to it). ``audit``: where refusals are recorded (by the
    token's name, never its secret)."""
    audit = audit or Audit()

    def principal(request: web.Request) -> Token:
        if _on_unix_socket(request) and H_FORWARDED not in request.headers:
            return INTERNAL
        return tokens.check(request.headers.get("Authorization"))

    def key_presented(request: web.Request) -> bool:
        presented = request.headers.get(H_INTERNAL)
        key = internal_key() if internal_key is not None else None
        return bool(presented and key and hmac.compare_digest(presented.encode(), key))

    def authorize(request: web.Request, route: Route, token: Token) -> None:
        internal = route.scope is Scope.INTERNAL or H_PEER in request.headers
        if internal and not (token.internal or key_presented(request)):
            what = (f"a {H_PEER} request" if route.scope is not Scope.INTERNAL
                    else f"{request.method} {route.path}")
            raise Forbidden(f"token {token.name!r} ({token.scope}) may not make {what}: only "
                            "the spoke's own processes and tier members (a 'tier' token) may")
        if route.scope is Scope.ADMIN and not token.admin:
            raise Forbidden(f"token {token.name!r} ({token.scope}) may not "
                            f"{request.method} {route.path}: that needs an admin token")
        if route.scope is Scope.READ:
            ds = _dataset_of(request)
            if not token.may_read(ds):
                raise Forbidden(f"token {token.name!r} ({token.scope}) may not read dataset "
                                f"{ds!r}")
        if route.scope is Scope.WRITE:
            ds = _dataset_of(request)
            check_write(token, ds)

    async def checked(request: web.Request, handler: Callable) -> web.StreamResponse:
        route = route_of(request)
        if route is not None and route.scope is Scope.PUBLIC:
            return await handler(request)
        token = principal(request)
        request["token"] = token  # for the audit log, also when refused below
        if route is None:
            if request.match_info.http_exception is not None:
                return await handler(request)  # matched nothing: aiohttp's 404 or 405
            # Registered, yet not in the table: refused (never open by default).
            raise Forbidden(f"{request.method} {request.path[:100]!r} has no scope in the "
                            "route table; refused")
        authorize(request, route, token)
        if not (route.job and jobs is not None):
            return await handler(request)
        ds, job = request.match_info["ds"], request.match_info["job"]
        jobs.check(ds, job, token, time.monotonic())
        resp = await handler(request)
        if resp.status < 400:
            jobs.done(ds, job, token, request.method == "DELETE", time.monotonic())
        return resp

    @web.middleware
    async def check(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await checked(request, handler)
        except (Unauthorized, Forbidden) as exc:
            token = request.get("token")
            audit.refused(request, exc.status, str(exc), token.name if token else None)
            raise

    return check


def rate_middleware(buckets: TokenBuckets, clock: Callable[[], float] = time.monotonic
                    ) -> Callable:
    """A job's requests (the table's ``job`` routes) at most at the principal's rate
    (``wire.ratelimit``), refused before the handler reads the body. Not limited: the spoke's
    own processes and tier members, and requests a replica worker forwards over the unix
    socket (the replica counted them)."""

    @web.middleware
    async def limit(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.method in ("GET", "HEAD"):  # reads (the hot path): no job route is one
            return await handler(request)
        route = route_of(request)
        if route is None or not route.job or _on_unix_socket(request):
            return await handler(request)
        token: Token | None = request.get("token")
        if token is not None and token.internal:
            return await handler(request)
        who = f"token {token.name!r}" if token is not None else f"client {request.remote}"
        wait = buckets.take(who, clock())
        if wait > 0:
            raise RateLimited(f"{who} made more job requests (orders, epochs, step reports) "
                              f"than {buckets.rate:g} a second after a burst of "
                              f"{buckets.burst:g}; try again in {wait:.1f} s", wait)
        return await handler(request)

    return limit


def admin_audit_middleware(audit: Audit) -> Callable:
    """One audit line per operator action (the table's admin routes), with its outcome."""

    @web.middleware
    async def record(request: web.Request, handler: Callable) -> web.StreamResponse:
        route = route_of(request)
        if route is None or route.scope is not Scope.ADMIN:
            return await handler(request)
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except (web.HTTPException, SpokeError) as exc:
            status = exc.status
            raise
        finally:
            audit.admin(request, status)

    return record


@web.middleware
async def well_formed(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Before anything is checked or forwarded: a path with dot segments (``/x/../v1/...``,
    also percent-encoded) is refused, so a path means one thing to every process that sees
    it; and only a batch read may carry a tier member's mark (``X-Spokefs-Peer``)."""
    segments = request.path.split("/")
    if "." in segments or ".." in segments:
        raise BadRequest("a path may not have . or .. segments")
    if H_PEER in request.headers:
        route = route_of(request)
        if route is None or route.handler != "read_blocks":
            raise BadRequest(f"{H_PEER} marks a batch read only")
    return await handler(request)

def may_see_all(token: Token | None) -> bool:
    """No token (a server without --auth), an admin, or the spoke's own processes."""
    return token is None or token.admin or token is INTERNAL


_DATASET_LABEL = re.compile(rb'dataset="((?:[^"\\]|\\.)*)"')


def visible_metrics(text: bytes, token: Token | None) -> bytes:
    """Prometheus text as ``token`` may see it: the samples labelled with a dataset it may
    not read leave (an admin, and a server without --auth, see all)."""
    if may_see_all(token):
        return text
    assert token is not None
    keep = []
    for line in text.split(b"\n"):
        m = _DATASET_LABEL.search(line) if not line.startswith(b"#") else None
        if m is None or token.may_read(m.group(1).decode("utf-8", "replace")):
            keep.append(line)
    return b"\n".join(keep)


def visible_status(doc: dict[str, object], token: Token | None) -> dict[str, object]:
    """``/v1/status`` as ``token`` may see it: everything for an admin (``may_see_all``);
    else only the datasets it may read, and no paths, URLs or raw errors (a read token
    learns whether the upstream is failing, not what it said). The keys stay, so clients
    that print a status work with either."""
    if may_see_all(token):
        return doc
    assert token is not None
    out = dict(doc)
    if doc.get("role") == "hub":
        out["datasets"] = [{k: v for k, v in d.items() if k != "root"}
                           for d in doc.get("datasets", [])  # type: ignore[union-attr]
                           if token.may_read(str(d.get("name")))]
        return out
    readable = token.may_read

    def scrub(value: object) -> object:
        """Items about a dataset (``{"dataset": ...}`` in any list) the token may not read
        leave, at any depth."""
        if isinstance(value, list):
            return [scrub(v) for v in value
                    if not (isinstance(v, dict) and "dataset" in v
                            and not readable(str(v["dataset"])))]
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items()}
        return value

    doc = scrub(doc)  # type: ignore[assignment]
    out = dict(doc)

    def only_readable(value: object) -> object:
        return ({k: v for k, v in value.items() if readable(str(k))}
                if isinstance(value, dict) else value)

    out["upstream"] = None
    if "upstreams" in out:  # their addresses and errors, like "upstream": admin only
        out["upstreams"] = None
    if doc.get("upstream_error"):
        out["upstream_error"] = "the upstream is failing (details: an admin token's status)"
    cache = doc.get("cache")
    if isinstance(cache, dict):
        out["cache"] = {**cache, "dir": None}
    datasets = doc.get("datasets")
    if isinstance(datasets, dict):
        out["datasets"] = {**datasets, "file": None,
                           **{k: only_readable(datasets.get(k))
                              for k in ("datasets", "resident_bytes", "hits_misses")
                              if k in datasets}}
    stale = doc.get("stale")
    if isinstance(stale, dict):
        out["stale"] = {**stale, "snapshots_in_use": only_readable(stale.get("snapshots_in_use"))}
    tier = doc.get("tier")
    if isinstance(tier, dict):  # how many members and in what state, not where they are
        out["tier"] = {**tier, "self": None, "refresh_error": None,
                       "members": [{**m, "url": None} for m in tier.get("members", [])
                                   if isinstance(m, dict)]}
    return out
