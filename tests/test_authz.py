"""Authorization where a request is answered: every route of the route table, every token
scope, every worker of a spoke with ``--workers 2`` (real hub and spoke processes, tokens
in files); reads bound to their dataset; status as a read token sees it; job owners."""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from servers import ServerProcess, hub, make_dataset, spoke
from spokefs.errors import Forbidden, LimitReached
from spokefs.wire.auth import Token
from spokefs.wire.authz import JobOwners
from spokefs.wire.frames import HEADER_SIZE, decode_header
from spokefs.wire.headers import H_INTERNAL, H_PEER
from spokefs.wire.routetable import ROUTES, Owner, Route, Scope, canonical, lookup

ADMIN = "admin-" + "a" * 32
READER = "reader-" + "r" * 32     # read:ds
OTHER = "other-" + "o" * 32       # read:elsewhere (no dataset these servers have)
TIER = "tier-" + "t" * 32         # a tier member's token
SPOKE = "spoke-" + "s" * 32       # the spoke's own token at the hub
STRANGER = "stranger-" + "x" * 32  # in no token file
WRITER = "writer-" + "w" * 32     # write:ds (the hub's ds is writable)
TOKENS = {"none": None, "stranger": STRANGER, "other": OTHER, "reader": READER,
          "writer": WRITER, "tier": TIER, "admin": ADMIN}
WORKERS = 2
TRIES = 2 * WORKERS  # fresh connections per check: each worker answers some of them

pool = urllib3.PoolManager(retries=False, timeout=30)


def call(method: str, url: str, token: str | None = None, doc: object = None,
         headers: dict[str, str] | None = None) -> urllib3.BaseHTTPResponse:
    h = {"Connection": "close", **(headers or {})}  # a new connection: any worker
    if token:
        h["Authorization"] = f"Bearer {token}"
    body = None
    if doc is not None:
        body, h["Content-Type"] = json.dumps(doc).encode(), "application/json"
    return pool.request(method, url, headers=h, body=body)


def raw_post(base: str, path: str, token: str, doc: object, headers: dict[str, str]
             ) -> tuple[int, bytes]:
    u = urllib3.util.parse_url(base)
    conn = http.client.HTTPConnection(u.host, u.port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(doc).encode(),
                     {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                      **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Path, Path, ServerProcess, ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("authz")
    ds = make_dataset(root / "ds", n_small=4, big_sizes=(300_000,))
    secret = make_dataset(root / "secret", n_small=4, big_sizes=(200_000,), seed=7)
    shutil.copy(ds / "class0" / "img0000.jpg", secret / "same.jpg")  # one file in both
    (root / "hub.tokens").write_text(f"spoke read {SPOKE}\nadmin admin {ADMIN}\n"
                                     f"reader read:ds {READER}\nother read:elsewhere {OTHER}\n"
                                     f"writer write:ds {WRITER}\n")
    (root / "spoke.tokens").write_text(f"admin admin {ADMIN}\nreader read:ds {READER}\n"
                                       f"other read:elsewhere {OTHER}\ntier tier {TIER}\n"
                                       f"writer write:ds {WRITER}\n")
    (root / "spoke.token").write_text(SPOKE + "\n")
    with hub(ds, root / "hubstate", "--dataset", f"secret={secret}", "--writable", "ds",
             "--auth", str(root / "hub.tokens")) as h, \
            spoke(h.url, root / "cache", "256MiB", "--workers", str(WORKERS),
                  "--auth", str(root / "spoke.tokens"),
                  "--upstream-token-file", str(root / "spoke.token")) as s:
        yield ds, secret, h, s, root


def allowed(route: Route, who: str, hub: bool = False) -> bool:
    if route.scope is Scope.PUBLIC:
        return True
    if who in ("none", "stranger") or (hub and who == "tier"):  # the hub knows no tier token
        return False
    return {Scope.TOKEN: True, Scope.READ: who in ("reader", "writer", "tier", "admin"),
            Scope.WRITE: who in ("writer", "admin"),
            Scope.ADMIN: who == "admin", Scope.INTERNAL: who == "tier"}[route.scope]


def url_of(base: str, route: Route, who: str) -> str:
    """The route's path with its parameters filled (the job: one of this token's own)."""
    values = {"ds": "ds", "job": f"job-{who}", "snap": "latest", "version": "0" * 32,
              "path": "class0/img0000.jpg", "ref": "ds"}
    path = canonical(route.path)
    for k, v in values.items():
        path = path.replace("{" + k + "}", v)
    return base + path


def test_every_registered_route_is_in_the_table(tmp_path: Path) -> None:
    """Hub, spoke and replica apps as built: no route without a scope."""
    from spokefs.hub.backend import HubBackend, open_state
    from spokefs.hub.routes import HubRoutes
    from spokefs.spoke.app import build_spoke_app
    from spokefs.spoke.replica import ReplicaBackend, build_replica_app
    from spokefs.spoke.service import SpokeBackend, SpokeConfig
    from spokefs.wire.server import build_app

    (tmp_path / "d").mkdir()
    state = open_state(str(tmp_path / "d"), "d", str(tmp_path / "st"), 1 << 20)
    try:
        apps = {
            "hub": build_app(backend := HubBackend([state]), {Owner.WRITES: HubRoutes(backend)}),
            "spoke": build_spoke_app(SpokeBackend(SpokeConfig(
                upstream="http://127.0.0.1:9", cache_dir=tmp_path / "c",
                cache_size=1 << 30))),
            "replica": build_replica_app(ReplicaBackend(tmp_path / "p.sock")),
        }
        for role, app in apps.items():
            seen = set()
            for r in app.router.routes():
                route = lookup(r.method, r.resource.canonical)  # type: ignore[union-attr]
                assert route is not None, f"{role}: {r.method} {r.resource} has no scope"
                assert route.scope in Scope
                seen.add(route)
            # The replica answers every primary route by forwarding, the rest itself.
            owners = {"hub": {Owner.API, Owner.UI, Owner.WRITES},
                      "spoke": {Owner.API, Owner.UI, Owner.SPOKE, Owner.WRITES},
                      "replica": {Owner.API, Owner.UI, Owner.REPLICA}}[role]
            want = {r for r in ROUTES if r.owner in owners
                    or (role == "replica" and r.primary)}
            assert seen == want, role
    finally:
        state.close()


@pytest.mark.parametrize("who", list(TOKENS))
def test_every_route_answers_only_its_scope(servers, who: str) -> None:
    _, _, h, s, _ = servers
    token = TOKENS[who]
    for base, owners in ((s.url, {Owner.API, Owner.UI, Owner.SPOKE, Owner.WRITES}),
                         (h.url, {Owner.API, Owner.UI, Owner.WRITES})):
        for route in ROUTES:
            if route.owner not in owners:
                continue
            url = url_of(base, route, who)
            doc = {} if route.method in ("POST", "PUT") else None
            for _ in range(TRIES if base == s.url else 1):
                r = call(route.method, url, token, doc)
                what = f"{who}: {route.method} {url} -> {r.status} {r.data[:200]!r}"
                if allowed(route, who, hub=base == h.url):
                    # Past the check: an answer of the handler (a 400 for an empty body,
                    # a 404 for the made-up version), never a refusal or a server error. (A
                    # spoke passes a snapshot request on to the hub with its own read token:
                    # the hub's refusal, relayed.)
                    relayed = b"token 'spoke' (read)" in r.data
                    assert (r.status not in (401, 403) or relayed) and r.status < 500, what
                else:
                    assert r.status in (401, 403), what
                    unknown = token in (None, STRANGER) or (base == h.url and token == TIER)
                    assert r.status == (401 if unknown else 403), what
                    if token is not None:
                        assert token not in r.data.decode(), what  # never echoed


def test_the_public_routes_are_these_and_the_probes_hold_no_data(servers) -> None:
    """A route open to anyone is a deliberate choice: this list. The probes answer every
    token, or none, on every worker, with nothing but ok."""
    _, _, h, s, _ = servers
    assert {(r.method, r.path) for r in ROUTES if r.scope is Scope.PUBLIC} == {
        ("GET", "/v1/openapi.json"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/ui"),
        ("GET", "/ui/"), ("GET", "/ui/app.js"), ("GET", "/ui/style.css")}
    for base in (s.url, h.url):
        for path in ("/healthz", "/readyz"):
            for who, token in TOKENS.items():
                for _ in range(TRIES if base == s.url else 1):
                    r = call("GET", base + path, token)
                    assert (r.status, json.loads(r.data)) == (200, {"ok": True}), (who, path)
                    assert r.headers["Cache-Control"] == "no-store"


def test_requests_a_replica_forwards_are_checked_by_the_primary(servers) -> None:
    _, _, _, s, _ = servers
    blocks = {"blocks": [["0" * 32, 0]]}
    for _ in range(TRIES):
        # Dot segments are refused before any route is matched or forwarded.
        # (http.client sends a path as given; urllib3 would remove the dots itself.)
        for path in ("/x/../v1/datasets/secret/blocks", "/v1/datasets/ds/../secret/blocks",
                     "/v1/./datasets/secret/blocks", "/x/%2e%2e/v1/datasets/secret/blocks"):
            status, body = raw_post(s.url, path, READER, blocks, {H_PEER: "demand"})
            assert status == 400 and b"segments" in body, (path, status, body)
        # A member's mark needs a member's token, whichever worker answers.
        r = call("POST", f"{s.url}/v1/datasets/ds/blocks", READER, blocks, {H_PEER: "demand"})
        assert r.status == 403 and H_PEER.encode() in r.data
        # Only a batch read may carry it.
        r = call("GET", f"{s.url}/v1/datasets/ds", TIER, None, {H_PEER: "demand"})
        assert r.status == 400
        # A read token for one dataset reads nothing of another on any worker.
        r = call("GET", f"{s.url}/secret/class0/img0000.jpg", READER)
        assert r.status == 403
        r = call("GET", f"{s.url}/v1/datasets/secret/snapshots/latest/manifest", READER)
        assert r.status == 403


def _version(base: str, ds: str, path: str) -> str:
    r = call("GET", f"{base}/v1/datasets/{ds}/snapshots/latest/entries/{path}", ADMIN)
    assert r.status == 200, r.data
    return json.loads(r.data)["version"]


def _frames(body: bytes) -> list[tuple[int, bytes]]:
    out, at = [], 0
    while at < len(body):
        head = decode_header(body[at:at + HEADER_SIZE])
        at += HEADER_SIZE
        out.append((head.status, body[at:at + head.length]))
        at += head.length
    return out


def test_a_read_is_served_only_for_a_version_of_its_dataset(servers) -> None:
    ds, secret, _, s, _ = servers
    hidden = _version(s.url, "secret", "class1/img0001.jpg")
    # The admin reads it through its own dataset: it is cached now, on every worker's view.
    for _ in range(TRIES):
        r = call("GET", f"{s.url}/v1/datasets/secret/objects/{hidden}", ADMIN)
        assert r.status == 200 and r.data == (secret / "class1" / "img0001.jpg").read_bytes()
    for _ in range(TRIES):
        # The same version through ds's URL: not a file of ds, whoever asks.
        for token in (READER, ADMIN):
            for method in ("GET", "HEAD"):
                r = call(method, f"{s.url}/v1/datasets/ds/objects/{hidden}", token)
                assert r.status == 404, (method, r.status, r.data)
            r = call("POST", f"{s.url}/v1/datasets/ds/blocks", token,
                     {"blocks": [[hidden, 0]]})
            assert r.status == 200
            ((status, payload),) = _frames(r.data)
            assert status == 404 and b"not a file of dataset 'ds'" in payload
    # Identical content is one version in both datasets: readable through either.
    same = _version(s.url, "secret", "same.jpg")
    assert same == _version(s.url, "ds", "class0/img0000.jpg")
    r = call("GET", f"{s.url}/v1/datasets/ds/objects/{same}", READER)
    assert r.status == 200 and r.data == (ds / "class0" / "img0000.jpg").read_bytes()
    # The hub binds its reads the same way.
    r = call("GET", f"{servers[2].url}/v1/datasets/ds/objects/{hidden}", ADMIN)
    assert r.status in (404, 410)


def test_a_read_token_sees_only_its_datasets_in_status(servers) -> None:
    _, _, h, s, root = servers
    for _ in range(TRIES):
        doc = json.loads(call("GET", f"{s.url}/v1/status", READER).data)
        text = json.dumps(doc)
        assert "secret" not in text and str(root) not in text and h.url not in text
        assert doc["cache"]["dir"] is None and doc["upstream"] is None
        assert doc["upstreams"] is None  # several upstreams' addresses and errors: admin's
        assert doc["cache"]["id"]  # not a path: what a same-host reader checks
        full = json.loads(call("GET", f"{s.url}/v1/status", ADMIN).data)
        assert full["cache"]["dir"] and full["upstream"] == h.url
        assert [u["url"] for u in full["upstreams"]] == [h.url]
    for base in (s.url, h.url):
        names = [d["name"] for d in json.loads(call("GET", f"{base}/v1/datasets",
                                                    READER).data)["datasets"]]
        assert names == ["ds"]
        assert b"secret" not in call("GET", f"{base}/", READER).data
    hub_doc = json.loads(call("GET", f"{h.url}/v1/status", READER).data)
    assert [d["name"] for d in hub_doc["datasets"]] == ["ds"] and "root" not in hub_doc[
        "datasets"][0]


def test_internal_routes_take_the_cache_folders_key(servers) -> None:
    _, _, _, s, root = servers
    key = (root / "cache" / "internal.key").read_text().strip()
    assert (root / "cache" / "internal.key").stat().st_mode & 0o077 == 0
    assert (root / "cache").stat().st_mode & 0o077 == 0
    doc = {"blocks": [[_version(s.url, "ds", "class0/img0000.jpg"), 0]], "fetch": True}
    for _ in range(TRIES):
        r = call("POST", f"{s.url}/v1/datasets/ds/locate", READER, doc)
        assert r.status == 403
        r = call("POST", f"{s.url}/v1/datasets/ds/locate", READER, doc, {H_INTERNAL: "0" * 64})
        assert r.status == 403
        r = call("POST", f"{s.url}/v1/datasets/ds/locate", READER, doc, {H_INTERNAL: key})
        assert r.status == 200 and json.loads(r.data)["blocks"][0] is not None
        r = call("POST", f"{s.url}/v1/workers/counts", READER, {"served_bytes": 1 << 40})
        assert r.status == 403


def test_a_jobs_owner_is_the_token_whose_announce_succeeded(servers) -> None:
    _, _, _, s, _ = servers
    url = f"{s.url}/v1/datasets/ds/jobs/shared"
    # A refused announce (a path not in the snapshot) leaves the job to nobody ...
    r = call("POST", f"{url}/order", READER, {"epoch": 0, "paths": ["no/such/file"]})
    assert r.status == 400
    # ... so the admin's own announce takes it, and the reader may not change it.
    assert call("POST", f"{url}/order", ADMIN, {"epoch": 0, "prefix": "class0"}).status == 200
    r = call("POST", f"{url}/epoch", READER, {"epoch": 1})
    assert r.status == 403 and "announced with token 'admin'" in json.loads(r.data)[
        "error"]["message"]
    assert call("DELETE", url, ADMIN).status == 200
    # Ended: the next announce owns it.
    assert call("POST", f"{url}/order", READER, {"epoch": 0, "prefix": "class0"}).status == 200
    assert call("POST", f"{url}/epoch", READER, {"epoch": 1}).status == 200


def test_job_owners_leave_when_idle_and_never_silently() -> None:
    a, b = Token("a", False, None), Token("b", False, None)
    owners = JobOwners(idle_s=10.0, most=2)
    owners.check("ds", "j1", a, 0.0)
    owners.done("ds", "j1", a, ended=False, now=0.0)
    with pytest.raises(Forbidden):
        owners.check("ds", "j1", b, 5.0)
    owners.done("ds", "j2", a, ended=False, now=6.0)
    with pytest.raises(LimitReached):  # full: a new job is refused, not left unowned
        owners.check("ds", "j3", b, 7.0)
    owners.check("ds", "j1", b, 11.0)  # j1 idle past 10 s: gone, anyone may announce it
    assert len(owners) == 1
    owners.done("ds", "j2", a, ended=True, now=12.0)
    assert len(owners) == 0


def test_the_openapi_document_lists_every_route_with_its_scope(servers) -> None:
    _, _, h, s, _ = servers
    for base, owners in ((s.url, {Owner.API, Owner.UI, Owner.SPOKE, Owner.WRITES}),
                         (h.url, {Owner.API, Owner.UI, Owner.WRITES})):
        doc = json.loads(call("GET", f"{base}/v1/openapi.json").data)
        ops = {(m.upper(), p): op["x-spokefs-scope"] for p, item in doc["paths"].items()
               for m, op in item.items()}
        assert ops == {(r.method, canonical(r.path)): str(r.scope) for r in ROUTES
                       if r.owner in owners}



def test_metrics_show_a_read_token_only_its_datasets(servers) -> None:
    _, _, _, s, _ = servers
    for ds in ("ds", "secret"):  # warm-ups: samples labelled with each dataset
        assert call("POST", f"{s.url}/v1/datasets/{ds}/warm", ADMIN, {"prefix": "class2"}
                    ).status == 202
    full = call("GET", f"{s.url}/metrics", ADMIN).data
    assert b'dataset="secret"' in full
    mine = call("GET", f"{s.url}/metrics", READER).data
    assert b'dataset="secret"' not in mine and b'dataset="ds"' in mine
